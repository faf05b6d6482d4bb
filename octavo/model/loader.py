"""Builds a model and fills its weights: HF safetensors, GGUF, or random ("dummy")."""

from __future__ import annotations

import functools
import glob
import os
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from octavo.model.int4_checkpoint import CHECKPOINT_METHODS, int4_format, iter_int4_weights
from octavo.model.layers import LINEAR_WEIGHT_DEVICE, Linear, RMSNorm, default_weight_loader
from octavo.model.quant_method import check_quantization, checkpoint_method
from octavo.model.quantization import Fp8BlockWeight, Int4Weight, Q8Weight
from octavo.model.registry import get_model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from octavo.model.fp8_checkpoint import BlockGrid

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
    fp8_blocks = load_format != "dummy" and checkpoint_method(hf_config) == "fp8"  # as it is
    if quantization == "gguf" and (load_format == "dummy" or not model.endswith(".gguf")):
        raise ValueError(
            f"quantization='gguf' keeps a GGUF file's blocks: it needs a .gguf model file "
            f"loaded from disk, got {model!r} with load_format={load_format!r}"
        )
    # A checkpoint's own quantized tensors stand in for the Linear weights they cover, which
    # are never made in float: Linear weights start on the meta device (LINEAR_WEIGHT_DEVICE).
    keeps = quantization == "gguf" or quantization in CHECKPOINT_METHODS or fp8_blocks
    with _default_dtype(dtype), device, _linear_weights_on("meta" if keeps else None):
        net = get_model_class(hf_config)(hf_config)
    net.eval().requires_grad_(False)
    with torch.no_grad(), _cpu_threads(1 if device.type == "cpu" else None):
        if load_format == "dummy":
            init_dummy_weights(net, seed)
        elif quantization == "gguf":  # its Q4 and Q8_0 tensors never dequantized
            kept = _load_gguf_placing_blocks(net, model, hf_config, device)
        elif quantization in CHECKPOINT_METHODS:  # its 4-bit layers never dequantized
            grids = _load_int4_placing_groups(net, model, hf_config, device)
        elif fp8_blocks:  # its e4m3 layers never made in float
            grids = _load_fp8_placing_scales(net, model, hf_config, device)
        else:
            loaded = net.load_weights(iter_weights(model, hf_config))
            _check_all_loaded(net, loaded, model)
    # Packing for the kernels runs on all of torch's threads: on a large model it is work
    # enough to gain from them, unlike the loaders' copies above.
    with torch.no_grad():
        if quantization == "gguf":
            _keep_gguf_blocks(net, model, kept)
        elif quantization in CHECKPOINT_METHODS:
            _keep_int4_codes(net, model, hf_config, grids, device)
        elif fp8_blocks:
            _keep_fp8_codes(net, model, hf_config, grids, device)
        elif quantization is not None:
            for module in list(net.modules()):
                if isinstance(module, Linear):
                    module.quantize(quantization)
    return net


_Kept = tuple[Linear, torch.Tensor, torch.Tensor, type]  # Linear, groups, codes, weight class


def _load_gguf_placing_blocks(
    net: nn.Module, path: str, hf_config: PretrainedConfig, device: torch.device
) -> list[_Kept]:
    """Loads a GGUF file into `net` but for each Linear whose tensors are all Q4_0, Q4_1,
    Q4_K or Q8_0 (and, on this rank, whole groups of 32 input features): for those, returns
    (the Linear, its groups, its codes, the QuantizedWeight class to keep them in) read from
    the file's bytes, for _keep_gguf_blocks; their float weights are never made. Every other
    weight loads as float (iter_weights).

    The model's own weight loaders place the codes and groups (_place) into scratch weights:
    the codes uint8 [N, K], the groups float32 [N, K / 16] (each group's scale and minimum,
    iter_gguf_blocks). The groups' scratch is NaN where no such tensor landed: a Linear with
    such rows stays float (its codes go unread).
    """
    from octavo.model.gguf_loader import iter_gguf_blocks

    linears = [m for m in net.modules() if isinstance(m, Linear)]
    groups = _place(
        net,
        {m: functools.partial(_scratch, m, m.weight.shape[1] // 16, torch.float32, device)
         for m in linears},
        iter_gguf_blocks(path, hf_config, "groups"),
    )  # fmt: skip
    codes = _place(
        net,
        {m: functools.partial(_scratch, m, m.weight.shape[1], torch.uint8, device)
         for m in groups},
        iter_gguf_blocks(path, hf_config, "codes"),
    )  # fmt: skip
    kept = [(m, groups[m], codes[m], _kept_class(m, groups[m], codes[m])) for m in groups]
    kept = [entry for entry in kept if entry[3] is not None]
    _load_float_but(net, path, hf_config, {m for m, *_ in kept}, device)
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


def _scratch(
    linear: Linear, columns: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """[the Linear's rows, columns] in `dtype` on `device`: NaN if floating, else empty."""
    shape = (linear.weight.shape[0], columns)
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


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
    with _weight_loaders({m.weight: _load_nothing for m in kept}):
        loaded = net.load_weights(iter_weights(model, hf_config))
    _check_all_loaded(net, loaded, model)


@contextmanager
def _weight_loaders(loaders: dict[nn.Parameter, Callable]):
    """Gives each parameter its loader here while open; restores theirs on exit (a
    parameter without one, such as a QuantizedWeight's, is left without)."""
    saved = {param: param.__dict__.get("weight_loader") for param in loaders}
    for param, loader in loaders.items():
        param.weight_loader = loader
    try:
        yield
    finally:
        for param, loader in saved.items():
            if loader is None:
                del param.weight_loader
            else:
                param.weight_loader = loader


def _load_nothing(param: nn.Parameter, loaded_weight, *shard_id) -> None:
    """The weight loader of a weight kept in another form: the checkpoint tensor is not read."""


def _load_int4_placing_groups(
    net: nn.Module, model: str, hf_config: PretrainedConfig, device: torch.device
) -> dict[Linear, torch.Tensor]:
    """Loads an AWQ or GPTQ checkpoint into `net` but for each Linear whose tensors are all
    4-bit: for those, returns their groups (_keep_int4_codes keeps them with their codes);
    their float weights are never made. Every other weight loads as float.

    The groups [N, 2 K / kernel_group_size] (each run of input features' scale and minimum,
    iter_int4_weights) are placed by the model's own weight loaders, as it places weights.

    Raises:
        ValueError: a tensor-parallel shard that starts inside a group (naming the method).
    """
    fmt = int4_format(hf_config)
    names = {m: name for name, m in net.named_modules() if isinstance(m, Linear)}
    run = fmt.kernel_group_size

    def scratch(m: Linear) -> torch.Tensor:
        rows, columns = m.weight.shape
        if columns % run:
            raise ValueError(
                f"quantization={fmt.method!r}: {names[m]} holds {columns} input features on "
                f"this rank, not whole groups of {run}; use a tensor_parallel_size that "
                "splits them into whole groups"
            )
        return torch.full((rows, 2 * columns // run), float("nan"), device=device)

    stream = iter_int4_weights(_iter_files(model), fmt, "groups")
    placed = _place(net, {m: functools.partial(scratch, m) for m in names}, stream)
    grids = {m: grid for m, grid in placed.items() if not grid.isnan().any()}
    _load_float_but(net, model, hf_config, set(grids), device)  # a part not 4-bit: float
    return grids


def _keep_int4_codes(
    net: nn.Module,
    model: str,
    hf_config: PretrainedConfig,
    grids: dict[Linear, torch.Tensor],
    device: torch.device,
) -> None:
    """Gives each Linear of `grids` an Int4Weight on its checkpoint's codes and groups: the
    codes uint8 [N, K] are placed one Linear at a time and packed as soon as all its parts
    have landed, so the load never holds more than a Linear's codes beyond the packed model.
    With GPTQ's act order (desc_act) each column's group is placed first: the Linear's
    columns are sorted by group, so groups are runs.
    """
    fmt = int4_format(hf_config)
    names = {m: name for name, m in net.named_modules() if isinstance(m, Linear)}
    run, columns = fmt.kernel_group_size, {}

    def order(m: Linear, ids: torch.Tensor) -> None:
        if (cols := _group_order(ids, run, names[m])) is not None:
            columns[m] = cols.to(device)

    def keep(m: Linear, codes: torch.Tensor) -> None:
        grid, cols = grids.pop(m), columns.pop(m, None)  # each dropped once packed
        if cols is not None:
            codes = codes[:, cols]
        grid = (grid[:, 0::2], grid[:, 1::2])
        m.quant = Int4Weight(m.weight, run, grid=grid, columns=cols, codes=codes)
        m.weight = None

    if fmt.act_order:  # each column's group, on the CPU
        ids = iter_int4_weights(_iter_files(model), fmt, "group_ids")
        make = {m: functools.partial(_scratch, m, m.weight.shape[1], torch.float32, "cpu")
                for m in grids}  # fmt: skip
        _place(net, make, ids, finish=order)
    codes = iter_int4_weights(_iter_files(model), fmt, "codes")
    make = {m: functools.partial(_scratch, m, m.weight.shape[1], torch.uint8, device)
            for m in grids}  # fmt: skip
    _place(net, make, codes, finish=keep)
    if grids:
        raise RuntimeError(f"the checkpoint's codes did not reach {[names[m] for m in grids]}")


def _load_fp8_placing_scales(
    net: nn.Module, model: str, hf_config: PretrainedConfig, device: torch.device
) -> dict[Linear, BlockGrid]:
    """Loads an HF fp8 checkpoint into `net` but for each Linear its scales cover: for those,
    returns their grids of scales (model/fp8_checkpoint.py); their float weights are never
    made. Every other weight loads as float (a module the checkpoint keeps in float)."""
    from octavo.model.fp8_checkpoint import Fp8Checkpoint

    grids = Fp8Checkpoint(_iter_files(model)).place_scales(net, device)
    _load_float_but(net, model, hf_config, set(grids), device)
    return grids


def _keep_fp8_codes(
    net: nn.Module,
    model: str,
    hf_config: PretrainedConfig,
    grids: dict[Linear, BlockGrid],
    device: torch.device,
) -> None:
    """Gives each Linear of `grids` an Fp8BlockWeight on its checkpoint's e4m3 codes, placed
    into scratch one Linear at a time (as _keep_int4_codes)."""

    def keep(m: Linear, codes: torch.Tensor) -> None:
        m.quant = Fp8BlockWeight(codes, grids.pop(m).blocks, m.weight.dtype)
        m.weight = None

    fp8 = torch.float8_e4m3fn
    make = {m: functools.partial(torch.empty, tuple(m.weight.shape), dtype=fp8, device=device)
            for m in grids}  # fmt: skip
    _place(net, make, iter_weights(model, hf_config), finish=keep)
    if grids:
        raise RuntimeError(f"the checkpoint's codes did not reach {len(grids)} Linears")


def _place(
    net: nn.Module,
    make: dict[Linear, Callable[[], torch.Tensor]],
    stream: Iterator[tuple[str, torch.Tensor]],
    finish: Callable[[Linear, torch.Tensor], None] | None = None,
) -> dict[Linear, torch.Tensor]:
    """Feeds `stream` (checkpoint tensors, some standing for Linear weights) through each
    Linear m of `make` to its own weight loader, which fuses and shards them as it does
    weights, into a scratch made by make[m]() at m's first tensor instead of into its weight
    (not touched: it may be on the meta device); every other parameter takes nothing.
    Returns the scratches made. With `finish`, finish(m, scratch) runs as soon as all of m's
    parts have landed, and the scratch is dropped then.
    """
    made: dict[Linear, torch.Tensor] = {}
    seen: dict[Linear, set] = {}

    def load(m: Linear, param: nn.Parameter, tensor, *shard_id) -> None:
        if m not in made:
            made[m] = make[m]()
        m.weight_loader(made[m], tensor, *shard_id)
        seen.setdefault(m, set()).update(shard_id or (None,))
        if finish is not None and seen[m] >= set(getattr(param, "shard_ids", (None,))):
            finish(m, made.pop(m))

    loaders = {p: _load_nothing for p in net.parameters()}
    loaders |= {m.weight: functools.partial(load, m) for m in make}
    with _weight_loaders(loaders):
        net.load_weights(stream)
    return made


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
    or GPTQ checkpoint's packed 4-bit layers as their float weights; an fp8 checkpoint's
    without its scales). A tensor may be lazy
    (LazyTensor, gguf_loader.GGUFWeight): read when a weight loader narrows it."""
    if model.endswith(".gguf"):
        from octavo.model.gguf_loader import iter_gguf_weights

        yield from iter_gguf_weights(model, hf_config, lazy=True)
    elif checkpoint_method(hf_config) in CHECKPOINT_METHODS:
        yield from iter_int4_weights(_iter_files(model), int4_format(hf_config), "float")
    elif checkpoint_method(hf_config) == "fp8":  # its scales are read apart (Fp8Checkpoint)
        from octavo.model.fp8_checkpoint import SCALE_SUFFIX

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
