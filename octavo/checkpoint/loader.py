"""Builds a model and fills its weights: HF safetensors, GGUF, or random ("dummy")."""

from __future__ import annotations

import glob
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from octavo.config import LOAD_FORMATS
from octavo.model.layers import (
    LINEAR_WEIGHT_DEVICE,
    Linear,
    RMSNorm,
    default_weight_loader,
    load_nothing,
)
from octavo.model.registry import get_model_class
from octavo.quant import get_method
from octavo.quant.method import cpu_threads, weight_loaders

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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
        quantization: None, or a method of octavo/quant (its __init__ lists them): the
            Linears it claims take its QuantizedWeights, never made whole in float.
    Returns:
        The model in eval mode, with requires_grad off.
    Raises:
        ValueError: unknown load_format or quantization, a quantization that does not fit
            the device or the checkpoint, no weight files, or a checkpoint that misses or has
            extra weights.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    device = torch.device(device)
    method = get_method(quantization, device, hf_config, model, load_format)
    # Linear weights start on the meta device where a method will make them (one Linear at a
    # time), so that a load never holds the float projections together.
    meta = method.name is not None and load_format != "dummy"
    with _default_dtype(dtype), device, _linear_weights_on("meta" if meta else None):
        net = get_model_class(hf_config)(hf_config)
    net.eval().requires_grad_(False)
    threads = torch.get_num_threads()  # packing for the kernels gains from them, copies not
    with torch.no_grad(), cpu_threads(1 if device.type == "cpu" else None):
        if load_format == "dummy":
            init_dummy_weights(net, seed)
        else:
            source = Checkpoint(model, hf_config)
            claims = method.claim(net, source, device)
            _load_float_but(net, method.float_weights(source), set(claims), device, model)
            method.fill(net, source, claims, device, threads)
    if load_format == "dummy":
        with torch.no_grad():
            method.quantize_random(net)
    return net


def _load_float_but(
    net: nn.Module,
    weights: Iterator[tuple[str, torch.Tensor]],
    kept: set[Linear],
    device: torch.device,
    source: str,
) -> None:
    """Loads every weight from `weights` but those of the `kept` Linears (their checkpoint
    tensors are not read), making each other Linear's weight on `device` first."""
    for m in net.modules():
        if isinstance(m, Linear) and m not in kept and m.weight.is_meta:
            old = m.weight
            m.weight = nn.Parameter(torch.empty_like(old, device=device), requires_grad=False)
            m.weight.__dict__.update(old.__dict__)  # its loader and shard ids
    with weight_loaders({m.weight: load_nothing for m in kept}):
        loaded = net.load_weights(weights)
    _check_all_loaded(net, loaded | _already_kept(net), source)


def _already_kept(net: nn.Module) -> set[str]:
    """Names of the parameters of the quantized forms placed before the float weights load
    (a GGUF file's LM head and embedding): no float tensor loads them."""
    return {f"{prefix}.{name}" for prefix, m in net.named_modules()
            if prefix.endswith((".quant", ".kept_rows"))
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


class Checkpoint:
    """A model's weight files, as quantization methods read them (quant/method.py's Source):
    an HF directory's safetensors (or pytorch_model*.bin) or a GGUF file."""

    def __init__(self, path: str, hf_config: PretrainedConfig) -> None:
        self.path, self.hf_config = path, hf_config

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs as stored (a GGUF file's dequantized), lazy where they
        can be (LazyTensor, gguf.GGUFWeight: read when a weight loader narrows them)."""
        if self.path.endswith(".gguf"):
            from octavo.checkpoint.gguf import iter_gguf_weights

            return iter_gguf_weights(self.path, self.hf_config, lazy=True)
        return _iter_files(self.path)

    def gguf_blocks(self, part: str) -> Iterator[tuple[str, torch.Tensor]]:
        from octavo.checkpoint.gguf import iter_gguf_blocks

        return iter_gguf_blocks(self.path, self.hf_config, part)

    def gguf_tensor(self, name: str):
        """The GGUF file's tensor `name` as a GGUFWeight, or None."""
        from octavo.checkpoint.gguf import GGUFWeight, open_gguf

        tensor = open_gguf(self.path).tensors.get(name)
        return None if tensor is None else GGUFWeight(tensor, None)


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
