"""A checkpoint's quantized tensors kept as they are: GGUF blocks, AWQ/GPTQ 4-bit groups and
codes, an fp8 checkpoint's e4m3 codes. They go through the model's own weight loaders
(`place`), which fuse q/k/v and gate/up and shard for tensor parallelism as they do for
weights, into scratch tensors; a Linear whose parts all arrive keeps them in a
QuantizedWeight (quant/weights.py), and its float weight, made on the meta device
(layers.LINEAR_WEIGHT_DEVICE), is never made whole. Float weights quantized on load take
the same path, a Linear at a time (`quantize_as_placed`). checkpoint/loader.py loads everything
else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from octavo.model.layers import Linear
from octavo.quant.awq_gptq import int4_format, iter_int4_weights
from octavo.quant.weights import GroupRows, Int4Weight, Q8Weight

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Files = Callable[[], Iterator[tuple[str, torch.Tensor]]]  # a checkpoint's tensors, read anew


def gguf_groups(
    net: nn.Module, path: str, hf_config: PretrainedConfig, device: torch.device
) -> dict[Linear, torch.Tensor]:
    """The groups [N, K / 16] (each group of 32's scale and minimum, iter_gguf_blocks) of
    each Linear of `net` that keeps its blocks of a GGUF file (_keeps_blocks), for
    keep_gguf_blocks. The other Linears load as float."""
    from octavo.checkpoint.gguf import iter_gguf_blocks

    def scratch(dtype: torch.dtype, m: Linear) -> torch.Tensor:
        return _scratch(m, m.weight.shape[1] // 16, dtype, device)

    linears = [m for m in net.modules() if isinstance(m, Linear)]
    make = {m: functools.partial(scratch, torch.float32, m) for m in linears}
    placed = place(net, make, iter_gguf_blocks(path, hf_config, "groups"))
    make = {m: functools.partial(scratch, torch.uint8, m) for m in placed}
    bits = place(net, make, iter_gguf_blocks(path, hf_config, "bits"))
    return {m: grid for m, grid in placed.items() if _keeps_blocks(m, grid, bits[m])}


def _keeps_blocks(linear: Linear, groups: torch.Tensor, bits: torch.Tensor) -> bool:
    """Whether a Linear keeps the blocks placed in it: all its tensors Q4_0, Q4_1, Q4_K or
    Q8_0 (every row landed), whole groups of 32 input features on this rank, and a kernel for
    its codes' bits: the CPU kernels run 8-bit ones too (Q8Weight), elsewhere only a
    Linear with no Q8_0 part is kept."""
    if linear.weight.shape[1] % 32 or groups.isnan().any():
        return False
    dtype = linear.weight.dtype
    return Q8Weight.runs_kernel(groups.device, groups.shape[0], dtype) or not (bits == 8).any()


def keep_gguf_blocks(
    net: nn.Module,
    path: str,
    hf_config: PretrainedConfig,
    groups: dict[Linear, torch.Tensor],
    device: torch.device,
    threads: int,
) -> None:
    """Gives each Linear of `groups` the file's own codes (uint8 [N, K], placed one Linear at a
    time as keep_int4_codes does), scales and minimums: an Int4Weight where every code is
    below 16, else a Q8Weight (a Q8_0 part)."""
    from octavo.checkpoint.gguf import iter_gguf_blocks

    def keep(m: Linear, codes: torch.Tensor) -> None:
        grid = groups.pop(m)
        scale, lo = grid[:, 0::2], grid[:, 1::2]
        with cpu_threads(threads):
            if codes.max() < 16:
                m.quant = Int4Weight(m.weight, 32, grid=(scale, lo), codes=codes)
            else:
                m.quant = Q8Weight(codes, scale, lo, m.weight.dtype)
        m.weight = None

    make = {m: functools.partial(_scratch, m, m.weight.shape[1], torch.uint8, device)
            for m in groups}  # fmt: skip
    place(net, make, iter_gguf_blocks(path, hf_config, "codes"), finish=keep)


def keep_gguf_vocab(net: nn.Module, path: str) -> None:
    """Before the float weights load: a Q8_0 LM head keeps its blocks (Q8Weight), then a
    Q4_0/Q4_1/Q4_K/Q8_0 token embedding its codes and groups (GroupRows), unless a tied LM
    head still multiplies by its table; the table is then never loaded."""
    _keep_gguf_q8_0_head(net, path)
    _keep_gguf_embedding(net, path)


def _scratch(
    linear: Linear, columns: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """[the Linear's rows, columns] in `dtype` on `device`: NaN if floating, else empty."""
    shape = (linear.weight.shape[0], columns)
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@contextmanager
def weight_loaders(loaders: dict[nn.Parameter, Callable]):
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


def load_nothing(param: nn.Parameter, loaded_weight, *shard_id) -> None:
    """The weight loader of a weight kept in another form: the checkpoint tensor is not read."""


@contextmanager
def cpu_threads(num_threads: int | None):
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


def int4_groups(
    net: nn.Module, files: Files, hf_config: PretrainedConfig, device: torch.device
) -> dict[Linear, torch.Tensor]:
    """The groups of each Linear of `net` whose tensors in an AWQ or GPTQ checkpoint (`files`)
    are all 4-bit, for keep_int4_codes. The other Linears load as float.

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

    stream = iter_int4_weights(files(), fmt, "groups")
    placed = place(net, {m: functools.partial(scratch, m) for m in names}, stream)
    return {m: grid for m, grid in placed.items() if not grid.isnan().any()}  # else float


def keep_int4_codes(
    net: nn.Module,
    files: Files,
    hf_config: PretrainedConfig,
    grids: dict[Linear, torch.Tensor],
    device: torch.device,
    threads: int,
) -> None:
    """Gives each Linear of `grids` an Int4Weight on its checkpoint's codes and groups: the
    codes uint8 [N, K] are placed one Linear at a time and packed (on `threads` CPU threads)
    as soon as all its parts have landed, so the load never holds more than a Linear's codes
    beyond the packed model.
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
        with cpu_threads(threads):
            m.quant = Int4Weight(m.weight, run, grid=grid, columns=cols, codes=codes)
        m.weight = None

    if fmt.act_order:  # each column's group, on the CPU
        ids = iter_int4_weights(files(), fmt, "group_ids")
        make = {m: functools.partial(_scratch, m, m.weight.shape[1], torch.float32, "cpu")
                for m in grids}  # fmt: skip
        place(net, make, ids, finish=order)
    codes = iter_int4_weights(files(), fmt, "codes")
    make = {m: functools.partial(_scratch, m, m.weight.shape[1], torch.uint8, device)
            for m in grids}  # fmt: skip
    place(net, make, codes, finish=keep)


def quantize_as_placed(
    net: nn.Module,
    weights: Iterator[tuple[str, torch.Tensor]],
    method: str,
    device: torch.device,
    threads: int,
) -> None:
    """Quantizes each Linear of `net` by round to nearest (Linear.quantize, `method` int8,
    int4 or fp8) as soon as its float weight has landed from `weights` in a scratch, so a
    load holds the quantized model and one Linear's float weight, never the float model."""

    def keep(m: Linear, weight: torch.Tensor) -> None:
        m.weight = nn.Parameter(weight, requires_grad=False)
        with cpu_threads(threads):
            m.quantize(method)

    make = {m: functools.partial(torch.empty, tuple(m.weight.shape), dtype=m.weight.dtype,
                                 device=device)
            for m in net.modules() if isinstance(m, Linear)}  # fmt: skip
    place(net, make, weights, finish=keep)


def place(
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

    Raises:
        RuntimeError: with `finish`, a Linear of `make` whose parts did not all land.
        ValueError: with `finish`, a tensor of a Linear that came again once it finished
            (a checkpoint that stores it twice).
    """
    made: dict[Linear, torch.Tensor] = {}
    seen: dict[Linear, set] = {}

    def load(m: Linear, param: nn.Parameter, tensor, *shard_id) -> None:
        if m not in made:
            if m in seen:  # finished and dropped: a second copy would fill a fresh scratch
                name = next(n for n, module in net.named_modules() if module is m)
                raise ValueError(f"the checkpoint holds a tensor of {name} twice")
            made[m] = make[m]()
        m.weight_loader(made[m], tensor, *shard_id)
        seen.setdefault(m, set()).update(shard_id or (None,))
        if finish is not None and seen[m] >= set(getattr(param, "shard_ids", (None,))):
            finish(m, made.pop(m))

    loaders = {p: load_nothing for p in net.parameters()}
    loaders |= {m.weight: functools.partial(load, m) for m in make}
    with weight_loaders(loaders):
        net.load_weights(stream)
    unfinished = [m for m in make if m not in seen or m in made]
    if finish is not None and unfinished:
        raise RuntimeError(f"the tensors of {len(unfinished)} Linears did not all land")
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


def _keep_gguf_embedding(net: nn.Module, path: str) -> None:
    """A Q4_0/Q4_1/Q4_K/Q8_0 token embedding keeps its codes and groups (GroupRows) in place of
    its float table, unless a tied LM head still multiplies by that table; on one rank only.
    The table becomes an empty parameter that loads nothing."""
    from octavo.checkpoint.gguf import open_gguf
    from octavo.checkpoint.gguf_blocks import BLOCK_TYPES, block_codes, block_groups
    from octavo.model.layers import LMHead, VocabEmbedding
    from octavo.model.parallel import get_tp

    tensor = open_gguf(path).tensors.get("token_embd.weight")
    tables = [m for m in net.modules() if type(m) is VocabEmbedding]
    if tensor is None or tensor.ggml_type not in BLOCK_TYPES or len(tables) != 1:
        return
    embedding, table = tables[0], tables[0].weight
    heads = [m for m in net.modules() if isinstance(m, LMHead) and m.weight is table]
    if get_tp().size > 1 or any(head.quant is None for head in heads):
        return
    codes = torch.from_numpy(block_codes(tensor)).to(table.device)
    if tuple(codes.shape) != tuple(table.shape) or table.shape[1] % 32:
        return
    groups = torch.from_numpy(block_groups(tensor)).to(table.device)
    embedding.kept_rows = GroupRows(codes, groups[:, 0::2], groups[:, 1::2], table.dtype)
    embedding.weight = _empty_table(table)
    for head in heads:
        head.weight = embedding.weight


def _empty_table(table: nn.Parameter) -> nn.Parameter:
    """A [0, hidden] stand-in for a vocabulary table kept in another form: it loads nothing."""
    empty = torch.empty(0, table.shape[1], dtype=table.dtype, device=table.device)
    param = nn.Parameter(empty, requires_grad=False)
    param.weight_loader = load_nothing
    return param


def _keep_gguf_q8_0_head(net: nn.Module, path: str) -> None:
    """A Q8_0 LM head (or a Q8_0 embedding it shares) computes the logits from its int8
    blocks (Q8Weight); on one rank only, where the head holds the whole vocabulary."""
    from octavo.checkpoint.gguf import open_gguf
    from octavo.checkpoint.gguf_blocks import Q8_0, block_codes, block_groups
    from octavo.model.layers import LMHead, VocabEmbedding
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
    if not any(m.weight is head.weight for m in net.modules() if type(m) is VocabEmbedding):
        head.weight = _empty_table(head.weight)  # untied: its own table is never read
