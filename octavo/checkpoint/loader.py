"""Builds a model and fills its weights: HF safetensors, GGUF, or random ("dummy")."""

from __future__ import annotations

import functools
import glob
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from octavo.model.layers import LINEAR_WEIGHT_DEVICE, Linear, RMSNorm, default_weight_loader
from octavo.model.registry import get_model_class
from octavo.quant import check_quantization, checkpoint_method
from octavo.quant.awq_gptq import CHECKPOINT_METHODS, int4_format, iter_int4_weights
from octavo.quant.fp8_checkpoint import keep_fp8_codes
from octavo.quant.placement import (
    cpu_threads,
    gguf_groups,
    int4_groups,
    keep_gguf_blocks,
    keep_gguf_vocab,
    keep_int4_codes,
    load_nothing,
    quantize_as_placed,
    weight_loaders,
)
from octavo.quant.weights import GroupRows, QuantizedWeight

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LOAD_FORMATS = ("auto", "dummy")
DUMMY_STD = 0.02


def load_model(
    model: str,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
) -> nn.Module:
    """Builds the model class of `hf_config` on `device` in `dtype` and loads its weights.

    Args:
        model: an HF directory (or a path inside it, e.g. its config.json) or a `.gguf` file.
        load_format: "auto" reads the weights from `model`; "dummy" fills them with random
            values of a sane scale, the same for the same seed (on the same device).
        quantization: None, or "int8", "int4" or "fp8": the linear layers' weights
            (qkv, o, gate_up, down) are quantized (quant/weights.py), each as it lands;
            "gguf" (a `.gguf` model only): those whose tensors are Q4_0/Q4_1/Q4_K/Q8_0
            keep their blocks (Q8_0 where the CPU kernel runs it);
            "awq", "gptq" (a checkpoint of that quant_method): they keep its 4-bit groups;
            "fp8" on an HF fp8 checkpoint: they keep its e4m3 blocks. The weights a
            checkpoint keeps quantized are never made in float (quant/placement.py).
    Returns:
        The model in eval mode, with requires_grad off.
    Raises:
        ValueError: unknown load_format or quantization, fp8 on a GPU without FP8, a
            quantization that does not fit the checkpoint's quantization_config, no weight
            files, or a checkpoint that misses or has extra weights.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    device = torch.device(device)
    check_quantization(quantization, device, hf_config, load_format)
    fp8_blocks = load_format != "dummy" and checkpoint_method(hf_config) == "fp8"  # as it is
    _check_gguf_source(quantization, model, load_format)
    # A checkpoint's own quantized tensors stand in for the Linear weights they cover, which
    # are never made in float; float ones quantized on load are made one Linear at a time.
    # Linear weights start on the meta device then (LINEAR_WEIGHT_DEVICE).
    keeps = quantization == "gguf" or quantization in CHECKPOINT_METHODS or fp8_blocks
    rtn = quantization is not None and not keeps and load_format != "dummy"
    with _default_dtype(dtype), device, _linear_weights_on("meta" if keeps or rtn else None):
        net = get_model_class(hf_config)(hf_config)
    net.eval().requires_grad_(False)
    threads = torch.get_num_threads()  # packing for the kernels gains from them, copies not
    with torch.no_grad(), cpu_threads(1 if device.type == "cpu" else None):
        if load_format == "dummy":
            init_dummy_weights(net, seed)
        elif keeps:
            _load_keeping(net, model, hf_config, quantization, device, threads)
        elif rtn:  # each Linear quantized as soon as its float weight has landed
            linears = {m for m in net.modules() if isinstance(m, Linear)}
            _load_float_but(net, model, hf_config, linears, device)
            quantize_as_placed(net, iter_weights(model, hf_config), quantization, device, threads)
        else:
            loaded = net.load_weights(iter_weights(model, hf_config))
            _check_all_loaded(net, loaded, model)
    if quantization is not None and load_format == "dummy":
        _quantize_linears(net, quantization)
    return net


def _check_gguf_source(quantization: str | None, model: str, load_format: str) -> None:
    if quantization == "gguf" and (load_format == "dummy" or not model.endswith(".gguf")):
        raise ValueError(
            f"quantization='gguf' keeps a GGUF file's blocks: it needs a .gguf model file "
            f"loaded from disk, got {model!r} with load_format={load_format!r}"
        )


@torch.no_grad()
def _quantize_linears(net: nn.Module, quantization: str) -> None:
    """Quantizes every Linear's (random) float weight by `quantization`."""
    for module in list(net.modules()):
        if isinstance(module, Linear):
            module.quantize(quantization)


def _load_keeping(
    net: nn.Module,
    model: str,
    hf_config: PretrainedConfig,
    quantization: str,
    device: torch.device,
    threads: int,
) -> None:
    """Loads a checkpoint whose Linears keep its quantized tensors as they are (a GGUF
    file's blocks, AWQ/GPTQ groups and codes, an fp8 checkpoint's e4m3 codes): first their
    groups or scales, then every float weight, then their codes a Linear at a time."""
    files = functools.partial(_iter_files, model)
    if quantization == "gguf":  # its Q4 and Q8_0 tensors never dequantized
        grids = gguf_groups(net, model, hf_config, device)
        keep_gguf_vocab(net, model)
    elif quantization == "fp8":
        from octavo.quant.fp8_checkpoint import Fp8Checkpoint

        grids = Fp8Checkpoint(files()).place_scales(net, device)
    else:
        grids = int4_groups(net, files, hf_config, device)
    _load_float_but(net, model, hf_config, set(grids), device)
    if quantization == "gguf":
        keep_gguf_blocks(net, model, hf_config, grids, device, threads)
    elif quantization == "fp8":
        keep_fp8_codes(net, functools.partial(iter_weights, model, hf_config), grids, device)
    else:
        keep_int4_codes(net, files, hf_config, grids, device, threads)


def _load_float_but(
    net: nn.Module,
    model: str,
    hf_config: PretrainedConfig,
    kept: set[Linear],
    device: torch.device,
) -> None:
    """Loads every weight but those of the `kept` Linears (their checkpoint tensors are not
    read), making each other Linear's weight on `device` first."""
    for m in net.modules():
        if isinstance(m, Linear) and m not in kept and m.weight.is_meta:
            old = m.weight
            m.weight = nn.Parameter(torch.empty_like(old, device=device), requires_grad=False)
            m.weight.__dict__.update(old.__dict__)  # its loader and shard ids
    with weight_loaders({m.weight: load_nothing for m in kept}):
        loaded = net.load_weights(iter_weights(model, hf_config))
    _check_all_loaded(net, loaded | _already_kept(net), model)


def _already_kept(net: nn.Module) -> set[str]:
    """Names of the parameters of the quantized forms placed before the float weights load
    (a GGUF file's LM head and embedding): no float tensor loads them."""
    kept = (QuantizedWeight, GroupRows)
    return {f"{prefix}.{name}" for prefix, m in net.named_modules() if isinstance(m, kept)
            for name, _ in m.named_parameters()}  # fmt: skip


@contextmanager
def _linear_weights_on(device: str | None):
    """Makes new Linear weights on `device` (None: the default) while open."""
    token = LINEAR_WEIGHT_DEVICE.set(device)
    try:
        yield
    finally:
        LINEAR_WEIGHT_DEVICE.reset(token)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    """Creates parameters in `dtype`; restores the previous default on exit."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Norm weights 1.0, everything else normal(0, 0.02): activations stay O(1) in bf16.

    Each checkpoint tensor is drawn whole from a seed of its own and goes through its
    parameter's loader, so every tensor-parallel rank keeps its slice of the same model.
    """
    norm_params = {id(p) for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
    device = next(model.parameters()).device
    for name, param in model.named_parameters():  # shared (tied) parameters appear once
        if id(param) in norm_params:
            param.fill_(1.0)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        shapes = getattr(param, "checkpoint_shapes", {None: tuple(param.shape)})
        for shard_id, shape in shapes.items():
            key = zlib.crc32(f"{seed}:{name}:{shard_id}".encode())
            generator = torch.Generator(device=device).manual_seed(key)
            full = torch.empty(shape, dtype=param.dtype, device=device)
            full.normal_(0.0, DUMMY_STD, generator=generator)
            if shard_id is None:
                loader(param, full)
            else:
                loader(param, full, shard_id)


def iter_weights(model: str, hf_config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs from a `.gguf` file or an HF directory's weight files (an AWQ
    or GPTQ checkpoint's packed 4-bit layers as their float weights; an fp8 checkpoint's
    without its scales). A tensor may be lazy
    (LazyTensor, gguf_loader.GGUFWeight): read when a weight loader narrows it."""
    if model.endswith(".gguf"):
        from octavo.checkpoint.gguf import iter_gguf_weights

        yield from iter_gguf_weights(model, hf_config, lazy=True)
    elif checkpoint_method(hf_config) in CHECKPOINT_METHODS:
        yield from iter_int4_weights(_iter_files(model), int4_format(hf_config), "float")
    elif checkpoint_method(hf_config) == "fp8":  # its scales are read apart (Fp8Checkpoint)
        from octavo.quant.fp8_checkpoint import SCALE_SUFFIX

        yield from ((n, t) for n, t in _iter_files(model) if not n.endswith(SCALE_SUFFIX))
    else:
        yield from _iter_files(model)


def _iter_files(model: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs from an HF directory's weight files, as they are stored."""
    directory = model if os.path.isdir(model) else os.path.dirname(model)
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if files:
        yield from _iter_safetensors(files)
        return
    bins = sorted(glob.glob(os.path.join(directory, "pytorch_model*.bin")))
    if not bins:
        raise ValueError(
            f"no *.safetensors or pytorch_model*.bin files in {directory!r} "
            "(use load_format='dummy' for random weights)"
        )
    for path in bins:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, LazyTensor(f.get_slice(name))


class LazyTensor:
    """A safetensors tensor not read yet: `narrow` reads only the rows or columns asked for,
    so a tensor-parallel rank reads its slices and never the whole checkpoint."""

    def __init__(self, tensor_slice) -> None:
        self._slice = tensor_slice
        self.shape = tuple(tensor_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def _check_all_loaded(model: nn.Module, loaded: set[str], source: str) -> None:
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise ValueError(f"checkpoint {source!r} is missing weights: {shown}")
