"""Builds a model and fills its weights: HF safetensors, GGUF, or random ("dummy")."""

from __future__ import annotations

import glob
import os
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from octavo.model.int4_checkpoint import CHECKPOINT_METHODS, int4_format, iter_int4_weights
from octavo.model.layers import Linear, RMSNorm, default_weight_loader
from octavo.model.quant_method import check_quantization, checkpoint_method
from octavo.model.quantization import Int4Weight, Q8Weight
from octavo.model.registry import get_model_class

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
            (qkv, o, gate_up, down) are quantized once loaded (model/quantization.py);
            "gguf" (a `.gguf` model only): those whose tensors are Q4_0/Q4_1/Q4_K/Q8_0
            keep their blocks (Q8_0 where the CPU kernel runs it);
            "awq", "gptq" (a checkpoint of that quant_method): they keep its 4-bit groups.
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
    fp8_blocks = None  # an fp8 checkpoint read as it is
    if load_format != "dummy" and checkpoint_method(hf_config) == "fp8":
        from octavo.model.fp8_checkpoint import Fp8Checkpoint

        fp8_blocks = Fp8Checkpoint()
    if quantization == "gguf" and (load_format == "dummy" or not model.endswith(".gguf")):
        raise ValueError(
            f"quantization='gguf' keeps a GGUF file's blocks: it needs a .gguf model file "
            f"loaded from disk, got {model!r} with load_format={load_format!r}"
        )
    with _default_dtype(dtype), device:
        net = get_model_class(hf_config)(hf_config)
    net.eval().requires_grad_(False)
    with torch.no_grad(), _cpu_threads(1 if device.type == "cpu" else None):
        if load_format == "dummy":
            init_dummy_weights(net, seed)
        elif quantization == "gguf":  # its Q4 and Q8_0 tensors never dequantized
            kept = _load_gguf_placing_blocks(net, model, hf_config)
        else:
            weights = iter_weights(model, hf_config)
            if fp8_blocks is not None:
                weights = fp8_blocks.weights(weights)
            loaded = net.load_weights(weights)
            _check_all_loaded(net, loaded, model)
    # Packing for the kernels runs on all of torch's threads: on a large model it is work
    # enough to gain from them, unlike the loaders' copies above.
    with torch.no_grad():
        if quantization == "gguf":
            _keep_gguf_blocks(net, model, kept)
        elif quantization in CHECKPOINT_METHODS:
            fmt = int4_format(hf_config)
            groups, ids = (iter_int4_weights(_iter_files(model), fmt, p) for p in _INT4_PARTS)
            ids = ids if fmt.act_order else None
            _keep_int4_groups(net, groups, fmt.kernel_group_size, ids, quantization)
        elif fp8_blocks is not None:
            fp8_blocks.keep_blocks(net)
        elif quantization is not None:
            for module in list(net.modules()):
                if isinstance(module, Linear):
                    module.quantize(quantization)
    return net


_INT4_PARTS = ("groups", "group_ids")


_Kept = tuple[Linear, torch.Tensor, torch.Tensor, type]  # Linear, groups, codes, weight class


def _load_gguf_placing_blocks(
    net: nn.Module, path: str, hf_config: PretrainedConfig
) -> list[_Kept]:
    """Loads a GGUF file into `net` but for each Linear whose tensors are all Q4_0, Q4_1,
    Q4_K or Q8_0 (and, on this rank, whole groups of 32 input features): for those, returns
    (the Linear, its groups, its codes, the QuantizedWeight class to keep them in) read from
    the file's bytes, for _keep_gguf_blocks; their float weights are never filled. Every
    other weight loads as float (iter_weights).

    The model's own weight loaders place the codes and groups, fusing and sharding them as
    they do weights, into scratch weights: the codes uint8 [N, K], the groups float32
    [N, K / 16] (each group's scale and minimum, iter_gguf_blocks). The groups' scratch is
    NaN where no such tensor landed: a Linear with such rows stays float (its codes go
    unread).
    """
    from octavo.model.gguf_loader import iter_gguf_blocks

    linears = [m for m in net.modules() if isinstance(m, Linear)]
    groups = {m: _scratch(m, m.weight.shape[1] // 16, torch.float32) for m in linears}
    _place(net, groups, iter_gguf_blocks(path, hf_config, "groups"))
    codes = {m: _scratch(m, m.weight.shape[1], torch.uint8) for m in linears}
    _place(net, codes, iter_gguf_blocks(path, hf_config, "codes"))
    kept = [(m, groups[m], codes[m], _kept_class(m, groups[m], codes[m])) for m in linears]
    kept = [entry for entry in kept if entry[3] is not None]
    for m, *_ in kept:
        m.weight.weight_loader = _load_nothing
    loaded = net.load_weights(iter_weights(path, hf_config))
    _check_all_loaded(net, loaded, path)
    return kept


def _kept_class(linear: Linear, groups: torch.Tensor, codes: torch.Tensor) -> type | None:
    """Where a Linear keeps the codes and groups placed in it: an Int4Weight if every code is
    below 16 (all parts 4-bit), else a Q8Weight (a Q8_0 part) where that runs a kernel; None
    (float) if a row did not land or its input features are not whole groups."""
    if linear.weight.shape[1] % 32 or groups.isnan().any():
        return None
    if codes.max() < 16:
        return Int4Weight
    return Q8Weight if Q8Weight.runs_kernel(codes) else None


def _keep_gguf_blocks(net: nn.Module, path: str, kept: list[_Kept]) -> None:
    """Gives each Linear of `kept` the file's own codes, scales and minimums in its class (its
    float weight is None from then on), and a Q8_0 LM head its blocks (_keep_gguf_q8_0_head)."""
    for m, groups, codes, cls in kept:
        scale, lo = groups[:, 0::2], groups[:, 1::2]
        weight = m.weight.detach()
        if cls is Int4Weight:
            m.quant = Int4Weight(weight, 32, grid=(scale, lo), codes=codes)
        else:
            m.quant = Q8Weight(codes, scale, lo, weight.dtype)
        m.weight = None
    _keep_gguf_q8_0_head(net, path)


def _scratch(linear: Linear, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """[the Linear's rows, columns] in `dtype` on its device: NaN if floating, else empty."""
    shape, device = (linear.weight.shape[0], columns), linear.weight.device
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _load_nothing(param: nn.Parameter, loaded_weight, *shard_id) -> None:
    """The weight loader of a weight kept in another form: the checkpoint tensor is not read."""


def _keep_int4_groups(
    net: nn.Module,
    groups: Iterable[tuple[str, torch.Tensor]],
    group_size: int,
    group_ids: Iterable[tuple[str, torch.Tensor]] | None,
    method: str,
) -> None:
    """Gives each Linear whose checkpoint tensors are all 4-bit an Int4Weight on their groups
    (an AWQ or GPTQ checkpoint's, `method`).

    `groups` holds, per such tensor [N, K], each group's scale and minimum in the group's
    first two columns: the model's own weight loaders place them where they placed its
    values, fusing and sharding alike, into a scratch weight; the codes follow from the
    float weight (quantize_int4_on_grid). `group_ids` (GPTQ's act order) holds each column's
    group in every row: the Linear's columns are sorted by group first, so groups are runs.

    Raises:
        ValueError: a tensor-parallel shard that starts inside a group (naming `method`).
    """
    linears = {name: m for name, m in net.named_modules() if isinstance(m, Linear)}
    placed = {m: torch.full_like(m.weight.data, float("nan")) for m in linears.values()}
    _place(net, placed, groups)
    ids = {}
    if group_ids is not None:
        ids = {m: torch.full_like(m.weight.data, float("nan"), dtype=torch.float32) for m in placed}
        _place(net, ids, group_ids)
    for name, module in linears.items():
        grid = placed[module]
        if grid.isnan().all():
            continue  # no 4-bit tensor landed here
        columns = _group_order(ids[module], group_size, name) if module in ids else None
        if grid.shape[1] % group_size:
            raise ValueError(
                f"quantization={method!r}: {name} holds {grid.shape[1]} input features on "
                f"this rank, not whole groups of {group_size}; use a tensor_parallel_size "
                "that splits them into whole groups"
            )
        if columns is not None:
            grid = grid[:, columns]
        scale, lo = grid[:, 0::group_size], grid[:, 1::group_size]
        if scale.isnan().any() or lo.isnan().any():
            continue  # a part is not 4-bit: it stays float
        weight = module.weight.data if columns is None else module.weight.data[:, columns]
        module.quant = Int4Weight(weight, group_size, grid=(scale, lo), columns=columns)
        module.weight = None


def _place(net: nn.Module, scratch: dict[Linear, torch.Tensor], stream) -> None:
    """Fills `scratch[m]` with what the model's weight loaders put from `stream` into each
    Linear m's weight (the weights are back in place on return)."""
    weights = {m: m.weight.data for m in scratch}
    for m, tensor in scratch.items():
        m.weight.data = tensor
    try:
        net.load_weights((name, t) for name, t in stream if not name.endswith(_NOT_LINEAR))
    finally:
        for m, w in weights.items():
            m.weight.data = w


def _group_order(ids: torch.Tensor, size: int, name: str) -> torch.Tensor | None:
    """The column order that turns `ids` [N, K] (each column's group, in every row) into runs
    of `size` columns of one group; None when they are in order already."""
    order = torch.argsort(ids[0], stable=True)
    runs = ids[0][order].view(-1, size) if ids.shape[1] % size == 0 else None
    if (ids != ids[:1]).any() or runs is None or (runs != runs[:, :1]).any():
        raise ValueError(
            f"{name}: the checkpoint's act order (desc_act) does not give its input features "
            f"on this rank in whole groups of {size} shared by its fused parts; use "
            "tensor_parallel_size=1"
        )
    return None if torch.equal(order, torch.arange(len(order))) else order


_NOT_LINEAR = ("embed_tokens.weight", "lm_head.weight")


def _keep_gguf_q8_0_head(net: nn.Module, path: str) -> None:
    """A Q8_0 LM head (or a Q8_0 embedding it shares) computes the logits from its int8
    blocks (Q8Weight); on one rank only, where the head holds the whole vocabulary."""
    from octavo.model.gguf_loader import Q8_0, block_codes, block_groups, open_gguf
    from octavo.model.layers import LMHead
    from octavo.model.parallel import get_tp

    tensors = open_gguf(path).tensors
    tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
    head = getattr(net, "lm_head", None)
    if not isinstance(head, LMHead) or tensor is None or tensor.ggml_type != Q8_0:
        return
    if get_tp().size > 1:
        return
    codes = torch.from_numpy(block_codes(tensor))  # the int8 codes + 128
    if tuple(codes.shape) != tuple(head.weight.shape):
        return
    groups = torch.from_numpy(block_groups(tensor)).to(head.weight.device)  # d, -128 d
    codes = codes.to(head.weight.device)
    head.quant = Q8Weight(codes, groups[:, 0::2], groups[:, 1::2], head.weight.dtype)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    """Creates parameters in `dtype`; restores the previous default on exit."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextmanager
def _cpu_threads(num_threads: int | None):
    """Runs the block with torch's CPU thread pool at `num_threads` (None: as it is); restores
    the previous count on exit.

    NOTE: loading on the CPU is one memory-bound copy per tensor, which one thread does at
    full speed, while the pool's threads, when other processes share the cores, wait for one
    another far longer than the copy takes.
    """
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


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
    or GPTQ checkpoint's packed 4-bit layers as their float weights). A tensor may be lazy
    (LazyTensor, gguf_loader.GGUFWeight): read when a weight loader narrows it."""
    if model.endswith(".gguf"):
        from octavo.model.gguf_loader import iter_gguf_weights

        yield from iter_gguf_weights(model, hf_config, lazy=True)
    elif checkpoint_method(hf_config) in CHECKPOINT_METHODS:
        yield from iter_int4_weights(_iter_files(model), int4_format(hf_config), "float")
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
