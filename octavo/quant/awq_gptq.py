"""quantization="awq" | "gptq": an AWQ or GPTQ checkpoint's 4-bit weights (packed eight to an
int32) read as their codes and their groups' scales and minimums and kept as Int4Weights on
the checkpoint's own groups; a layer with a part that is not 4-bit loads as the float weights
they stand for. No 4-bit layer is made in float.

    AWQ (AutoAWQ, GEMM version)              GPTQ (AutoGPTQ, GPTQModel; formats v1 and v2)
    qweight int32 [K, N / 8]: 8 output       qweight int32 [K / 8, N]: 8 input rows a word,
      columns a word, nibble i (bits 4i..)     nibble i holding row 8 r + i
      holding column AWQ_ORDER[i] of its 8
    qzeros  int32 [G, N / 8], as qweight     qzeros  int32 [G, N / 8], in order; v1 stores z - 1
    scales  fp16  [G, N]                     scales  fp16  [G, N]
                                             g_idx   int32 [K]: each input row's group
    w[n, k] = (q[k, n] - z[g, n]) * s[g, n], with g = k // group_size (GPTQ: g_idx[k])

K input features, N output features, G groups of group_size input features (-1: one group).
GPTQ's act order (desc_act) numbers the groups in another order than the input features.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from octavo.model.config import get_head_dim
from octavo.model.layers import Linear, read_whole
from octavo.quant.method import QuantMethod, Source, place, place_one_at_a_time
from octavo.quant.weights import Int4Weight

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHECKPOINT_METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Group sizes of torch's CPU int4 kernel: a checkpoint's groups are kept as runs of the
# largest that divides them, each with its group's scale and minimum.
KERNEL_GROUP_SIZES = (128, 64, 32)
_TENSORS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
}


class Int4Checkpoint(QuantMethod):
    """An AWQ or GPTQ checkpoint's own groups and codes. GPTQ's act order (desc_act) is
    kept by sorting each Linear's columns by group and permuting its input to match."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        self.fmt = int4_format(hf_config)
        self.name = self.fmt.method

    def float_weights(self, source: Source) -> Iterator[tuple[str, Any]]:
        return iter_int4_weights(source.tensors(), self.fmt, "float")

    def claim(self, net: nn.Module, source: Source, device: torch.device) -> dict[Linear, Any]:
        """The groups [N, 2 K / kernel_group_size] (each run of input features' scale and
        minimum) of each Linear whose tensors are all 4-bit; the others load as float.

        Raises:
            ValueError: a tensor-parallel shard that starts inside a group.
        """
        names = {m: name for name, m in net.named_modules() if isinstance(m, Linear)}
        run = self.fmt.kernel_group_size

        def grid(m: Linear) -> torch.Tensor:
            rows, columns = m.weight.shape
            if columns % run:
                raise ValueError(
                    f"quantization={self.name!r}: {names[m]} holds {columns} input features "
                    f"on this rank, not whole groups of {run}; use a tensor_parallel_size that "
                    "splits them into whole groups"
                )
            return torch.full((rows, 2 * columns // run), float("nan"), device=device)

        stream = iter_int4_weights(source.tensors(), self.fmt, "groups")
        placed = place(net, {m: lambda m=m: grid(m) for m in names}, stream)
        return {m: grid for m, grid in placed.items() if not grid.isnan().any()}  # else float

    def fill(self, net, source, claims, device, threads) -> None:
        """Each claimed Linear's codes uint8 [N, K], packed with its groups as soon as all its
        parts have landed (with act order, each column's group is placed first)."""
        run, columns = self.fmt.kernel_group_size, {}
        names = {m: name for name, m in net.named_modules()}
        if self.fmt.act_order:  # each column's group, on the CPU

            def order(m: Linear, ids: torch.Tensor) -> None:
                if (cols := _group_order(ids, run, names[m])) is not None:
                    columns[m] = cols.to(device)

            ids = iter_int4_weights(source.tensors(), self.fmt, "group_ids")
            place(net, {m: lambda m=m: _ids_scratch(m) for m in claims}, ids, order)

        def keep(m: Linear, codes: torch.Tensor) -> Int4Weight:
            grid, cols = claims.pop(m), columns.pop(m, None)  # each dropped once packed
            codes = codes if cols is None else codes[:, cols]
            grid = (grid[:, 0::2], grid[:, 1::2])
            return Int4Weight(m.weight, run, grid=grid, columns=cols, codes=codes)

        codes = iter_int4_weights(source.tensors(), self.fmt, "codes")
        place_one_at_a_time(net, dict(claims), codes, torch.uint8, device, keep, threads)


def _ids_scratch(m: Linear) -> torch.Tensor:
    return torch.empty(m.weight.shape, dtype=torch.float32)


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


@dataclass(frozen=True)
class Int4Format:
    """How an AWQ or GPTQ checkpoint's weights are packed (see the module docstring)."""

    method: str
    group_size: int | None  # None: one group over all input features
    kernel_group_size: int  # the runs Int4Weight keeps the groups as
    act_order: bool  # GPTQ's desc_act: g_idx may number the groups out of order
    zero_offset: int  # added to a stored zero: 1 in GPTQ's v1 format, else 0


def int4_format(hf_config: PretrainedConfig) -> Int4Format:
    """Reads the config's `quantization_config` (of an "awq" or "gptq" checkpoint).

    Raises:
        ValueError: naming a field whose value octavo does not read (bits other than 4, a
            group size not a multiple of 32, AWQ's GEMV layout, ...).
    """
    config = hf_config.quantization_config
    config = config if isinstance(config, dict) else config.to_dict()
    method = str(config.get("quant_method")).lower()
    bits = config.get("bits", config.get("w_bit"))
    group = config.get("group_size", config.get("q_group_size"))
    layout = config.get("checkpoint_format", "gptq")
    _require(bits == 4, method, "bits", bits, "4")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        _require(version == "gemm", method, "version", version, "'gemm'")
        _require(config.get("zero_point", True), method, "zero_point", False, "True")
    else:
        _require(layout in ("gptq", "gptq_v2"), method, "checkpoint_format", layout, "gptq(_v2)")
    # -1: one group of each layer's input features; the kernel's runs must divide them all.
    heads = hf_config.num_attention_heads * get_head_dim(hf_config)
    whole = math.gcd(hf_config.hidden_size, hf_config.intermediate_size, heads)
    columns = whole if group == -1 else max(group or 1, 1)
    kernel = next((size for size in KERNEL_GROUP_SIZES if columns % size == 0), None)
    _require(kernel is not None, method, "group_size", group, "-1 or a multiple of 32")
    return Int4Format(
        method,
        None if group == -1 else group,
        kernel,
        method == "gptq" and bool(config.get("desc_act", False)),
        1 if method == "gptq" and layout == "gptq" else 0,
    )


def _require(ok: bool, method: str, key: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(
            f"quantization={method!r}: the checkpoint's quantization_config has {key}={value!r}; "
            f"octavo reads {key} {allowed}"
        )


def iter_int4_weights(
    weights: Iterable[tuple[str, torch.Tensor]], fmt: Int4Format, part: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of a checkpoint's `weights`, each layer's packed tensors
    (`prefix.qweight`, ...) yielded once as `prefix.weight`, made when a loader narrows it
    (_Layer):

        part "float": its float weight [N, K] (float32), and every other tensor as it is;
        "codes": only those, their codes [N, K] (uint8, 0..15);
        "groups": only those, [N, 2 K / kernel_group_size]: for each run of
            kernel_group_size input features of one group, in group order, the group's scale
            and its minimum (-z * s); qweight is not read;
        "group_ids": only those, each input feature's group (g_idx) in every row [N, K].
    """
    names = _TENSORS[fmt.method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        if suffix not in names:
            if part == "float":
                yield name, tensor
            continue
        layer = pending.setdefault(prefix, {})
        layer[suffix] = tensor if suffix == "qweight" else read_whole(tensor)
        if len(layer) == len(names):
            yield f"{prefix}.weight", _Layer(prefix, pending.pop(prefix), fmt, part)
    if pending:
        raise ValueError(f"checkpoint lacks some of {names} for {sorted(pending)}")


class _Layer:
    """One packed layer as the tensor `part` asks for (iter_int4_weights), made only for the
    rows or columns a weight loader narrows it to (`shape` and `narrow`, as checkpoint/loader.py's
    LazyTensor): a tensor-parallel rank reads only its words of qweight. The scales, zeros
    and g_idx (an eighth of qweight or less) are read whole."""

    def __init__(self, prefix: str, tensors: dict, fmt: Int4Format, part: str) -> None:
        awq = fmt.method == "awq"
        self.order = AWQ_ORDER if awq else range(8)
        self.packed_dim = 1 if awq else 0  # qweight [K, N / 8] or [K / 8, N]
        self.qweight, self.part, self.run = tensors["qweight"], part, fmt.kernel_group_size
        k = self.qweight.shape[0] * (1 if awq else 8)
        self.scale = tensors["scales"].float()  # [G, N]
        self.lo = -(_unpack(tensors["qzeros"], 1, self.order) + fmt.zero_offset) * self.scale
        group = fmt.group_size or k
        g_idx = tensors["g_idx"].long() if "g_idx" in tensors else torch.arange(k) // group
        in_order = torch.arange(k) // group
        if self.scale.shape[0] * group != k or not torch.equal(g_idx.sort().values, in_order):
            raise ValueError(f"{prefix}: its {k} input features are not whole groups of {group}")
        if not fmt.act_order and not torch.equal(g_idx, in_order):
            raise ValueError(
                f"{prefix}: g_idx numbers the groups out of order, but desc_act is off"
            )
        self.g_idx = g_idx
        # "groups" counts two columns a run of input features: its loaders narrow in those.
        self.columns_per_unit = self.run // 2 if part == "groups" else 1
        self.shape = (self.scale.shape[1], k // self.columns_per_unit)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        rows = slice(start, start + length) if dim == 0 else slice(None)
        unit = self.columns_per_unit
        cols = slice(start * unit, (start + length) * unit) if dim == 1 else slice(None)
        scale, lo, g_idx = self.scale[:, rows], self.lo[:, rows], self.g_idx[cols]
        if self.part == "group_ids":
            return g_idx.float().expand(scale.shape[1], len(g_idx))
        if self.part == "groups":  # each run's group, in g_idx's stable order
            groups = g_idx[torch.argsort(g_idx, stable=True)[0 :: self.run]]
            return torch.stack([scale[groups].t(), lo[groups].t()], dim=-1).flatten(1)
        q = self._codes(1 - dim, start, length)  # [K, N] or the slice asked for
        if self.part == "codes":
            return q.t().to(torch.uint8)
        return (q * scale[g_idx] + lo[g_idx]).t()

    def _codes(self, dim: int, start: int, length: int) -> torch.Tensor:
        """The codes [K, N], unpacked, of `length` rows (dim 0) or columns (dim 1) from
        `start`: only the int32 words that hold them are read."""
        if dim != self.packed_dim:
            return _unpack(self.qweight.narrow(dim, start, length), self.packed_dim, self.order)
        first, last = start // 8, -(-(start + length) // 8)
        words = self.qweight.narrow(dim, first, last - first)
        return _unpack(words, dim, self.order).narrow(dim, start - 8 * first, length)


def _unpack(packed: torch.Tensor, dim: int, order: Sequence[int]) -> torch.Tensor:
    """int32 words of eight 4-bit values along `dim` (nibble i holding value order[i] of its
    eight) -> the values in 0..15 (int32), eight times as many along `dim`."""
    shifts = torch.tensor([4 * list(order).index(j) for j in range(8)], dtype=torch.int32)
    shifts = shifts.view(8, *[1] * (packed.dim() - 1 - dim))
    return ((packed.unsqueeze(dim + 1) >> shifts) & 0xF).flatten(dim, dim + 1)
