"""quantization="gguf": a GGUF file's Q4_0, Q4_1, Q4_K and Q8_0 blocks kept as they are (the
default for a GGUF file on the CPU, where octavo's kernels run them).

The codes and each group of 32's scale and minimum are read from the file's bytes, never as
floats (checkpoint/gguf_blocks.py), and placed through the model's weight loaders: the groups
first, then the codes a Linear at a time. A Linear whose codes all stay below 16 becomes an
Int4Weight on the file's groups; one with a Q8_0 part a Q8Weight (8-bit codes, where a CPU
kernel runs them). A Linear with a part of another type, or a rank whose columns start inside
a group, loads float. On one rank, a Q8_0 LM head keeps its blocks and a block-typed token
embedding dequantizes only the rows it looks up (GroupRows), as vLLM's GGUF embedding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from octavo.kernels import cpu as cpu_kernels
from octavo.model.layers import Linear, LMHead, VocabEmbedding, stand_in
from octavo.model.parallel import get_tp
from octavo.quant.cpu_packing import q8_planes, scale_zero
from octavo.quant.method import (
    QuantMethod,
    Source,
    linears,
    place,
    place_one_at_a_time,
    scratch,
)
from octavo.quant.rounding import dequantize_int4
from octavo.quant.weights import Int4Weight, QuantizedWeight, frozen, uses_cpu_kernels


class GGUFBlocks(QuantMethod):
    name = "gguf"

    def check(self, device: torch.device, model_path: str | None, load_format: str) -> None:
        if model_path is not None and (load_format == "dummy" or not model_path.endswith(".gguf")):
            raise ValueError(
                f"quantization='gguf' keeps a GGUF file's blocks: it needs a .gguf model file "
                f"loaded from disk, got {model_path!r} with load_format={load_format!r}"
            )

    def claim(self, net: nn.Module, source: Source, device: torch.device) -> dict[Linear, Any]:
        """Each kept Linear's groups [N, K / 16] (scale and minimum of each group of 32); the
        LM head and the embedding keep their blocks here too."""
        make = {m: lambda m=m: scratch(m, m.weight.shape[1] // 16, torch.float32, device)
                for m in linears(net)}  # fmt: skip
        placed = place(net, make, source.gguf_blocks("groups"))
        make = {m: lambda m=m: scratch(m, m.weight.shape[1] // 16, torch.uint8, device)
                for m in placed}  # fmt: skip
        bits = place(net, make, source.gguf_blocks("bits"))
        _keep_q8_0_head(net, source)
        _keep_embedding(net, source)
        _keep_experts(net, source)
        return {m: grid for m, grid in placed.items() if _keeps_blocks(m, grid, bits[m])}

    def fill(self, net, source, claims, device, threads) -> None:
        def keep(m: Linear, codes: torch.Tensor) -> QuantizedWeight:
            grid = claims.pop(m)
            scale, lo = grid[:, 0::2], grid[:, 1::2]
            if codes.max() < 16:
                return Int4Weight(m.weight, 32, grid=(scale, lo), codes=codes)
            return Q8Weight(codes, scale, lo, m.weight.dtype)

        codes = source.gguf_blocks("codes")
        place_one_at_a_time(net, dict(claims), codes, torch.uint8, device, keep, threads)


def _keeps_blocks(linear: Linear, groups: torch.Tensor, bits: torch.Tensor) -> bool:
    """Whether a Linear keeps the blocks placed in it: all its tensors Q4_0, Q4_1, Q4_K or
    Q8_0 (every row landed), whole groups of 32 input features on this rank, and a kernel for
    its codes' bits: the CPU kernels run 8-bit ones too (Q8Weight), elsewhere only a
    Linear with no Q8_0 part is kept."""
    if linear.weight.shape[1] % 32 or groups.isnan().any():
        return False
    dtype = linear.weight.dtype
    return Q8Weight.runs_kernel(groups.device, groups.shape[0], dtype) or not (bits == 8).any()


def _keep_experts(net: nn.Module, source: Source) -> None:
    """Each mixture-of-experts layer whose stacked expert tensors (`ffn_{gate,up,down}_exps`)
    are all block types keeps this rank's experts in their blocks, as a Linear keeps its own:
    gate and up rows one weight, down another (only where octavo's CPU kernels run them, and
    a rank's slice of the experts' features is whole groups of 32)."""
    from octavo.model.moe import FusedMoE

    for name, moe in net.named_modules():
        if not isinstance(moe, FusedMoE) or not name.startswith("model.layers."):
            continue
        layer = name.split(".")[2]
        parts = [
            source.gguf_tensor(f"blk.{layer}.ffn_{p}_exps.weight") for p in ("gate", "up", "down")
        ]
        dtype, device = moe.w13.dtype, moe.w13.device
        if any(t is None or t.bits is None for t in parts) or moe.start % 32 or moe.inter % 32:
            continue
        if not (uses_cpu_kernels(device) and cpu_kernels.available(dtype)):
            continue
        (gate_c, up_c, down_c), (gate_g, up_g, down_g) = zip(
            *((t.codes(), t.groups()) for t in parts), strict=True
        )
        rows = slice(moe.start, moe.start + moe.inter)
        cols = slice(moe.start // 16, (moe.start + moe.inter) // 16)
        w13, w2 = [], []
        for expert in range(moe.first, moe.first + moe.local):
            codes = torch.cat([gate_c[expert, rows], up_c[expert, rows]])
            groups = torch.cat([gate_g[expert, rows], up_g[expert, rows]])
            w13.append(_blocks_weight(codes, groups, dtype))
            codes = down_c[expert][:, rows]
            w2.append(_blocks_weight(codes, down_g[expert][:, cols], dtype))
        moe.keep(w13, w2)


def _blocks_weight(
    codes: torch.Tensor, groups: torch.Tensor, dtype: torch.dtype
) -> QuantizedWeight:
    """A matrix's codes [N, K] and groups of 32 [N, K / 16] as a QuantizedWeight: Int4Weight
    where every code is below 16, else Q8Weight."""
    scale, lo = groups[:, 0::2].contiguous(), groups[:, 1::2].contiguous()
    codes = codes.contiguous()
    if codes.max() < 16:
        meta = torch.empty(codes.shape, dtype=dtype, device="meta")
        return Int4Weight(meta, 32, grid=(scale, lo), codes=codes)
    return Q8Weight(codes, scale, lo, dtype)


def _keep_embedding(net: nn.Module, source: Source) -> None:
    """A block-typed token embedding keeps its codes and groups (GroupRows) in place of its
    float table, unless a tied LM head still multiplies by that table; on one rank only.
    The table becomes an empty parameter that loads nothing."""
    tensor = source.gguf_tensor("token_embd.weight")
    tables = [m for m in net.modules() if type(m) is VocabEmbedding]
    if tensor is None or tensor.bits is None or len(tables) != 1:
        return
    embedding, table = tables[0], tables[0].weight
    heads = [m for m in net.modules() if isinstance(m, LMHead) and m.weight is table]
    if get_tp().size > 1 or any(head.quant is None for head in heads):
        return
    if tuple(tensor.shape) != tuple(table.shape) or table.shape[1] % 32:
        return
    codes, groups = tensor.codes().to(table.device), tensor.groups().to(table.device)
    embedding.kept_rows = GroupRows(codes, groups[:, 0::2], groups[:, 1::2], table.dtype)
    embedding.weight = stand_in(table)
    for head in heads:
        head.weight = embedding.weight


def _keep_q8_0_head(net: nn.Module, source: Source) -> None:
    """A Q8_0 LM head (or a Q8_0 embedding it shares) computes the logits from its int8
    blocks (Q8Weight); on one rank only, where the head holds the whole vocabulary."""
    tensor = source.gguf_tensor("output.weight") or source.gguf_tensor("token_embd.weight")
    head = getattr(net, "lm_head", None)
    if not isinstance(head, LMHead) or tensor is None or tensor.bits != 8 or get_tp().size > 1:
        return
    if tuple(tensor.shape) != tuple(head.weight.shape):
        return
    device = head.weight.device
    codes, groups = tensor.codes().to(device), tensor.groups().to(device)  # u = c + 128; d, -128 d
    head.quant = Q8Weight(codes, groups[:, 0::2], groups[:, 1::2], head.weight.dtype)
    if not any(m.weight is head.weight for m in net.modules() if type(m) is VocabEmbedding):
        head.weight = stand_in(head.weight)  # untied: its own table is never read


class Q8Weight(QuantizedWeight):
    """8-bit codes u [N, K] (uint8) with a scale and a minimum per group of 32 columns
    [N, G]: w = u * scale + min. GGUF's Q8_0 (int8 c with a scale d) is u = c + 128 with
    min -128 d; a 4-bit group (Q4_0, Q4_1, Q4_K) is one whose codes stay below 16.

    On the CPU it runs torch's int4 kernel twice: u is 16 h + l with h, l in 0..15, so the
    product is that of h (scale 16 s, min m) plus that of l (scale s): two 4-bit planes
    that read as many bytes as the 8-bit codes. Elsewhere it dequantizes."""

    method = "gguf"

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype
    ) -> None:
        super().__init__(torch.empty(codes.shape, dtype=dtype, device="meta"))
        self.cpu_kernel = Q8Weight.runs_kernel(codes.device, codes.shape[0], dtype)
        self.packed = None
        if self.cpu_kernel and cpu_kernels.available(dtype):
            self.packed = cpu_kernels.pack_weight(codes=codes, scale=scale, lo=lo)
            self.codes = frozen(self.packed.data)  # codes with their scales and minimums
        elif self.cpu_kernel:
            s, m = scale.to(torch.bfloat16), lo.to(torch.bfloat16)
            # The minimum joins the plane where the kernel's bfloat16 zero stays exact: the
            # high one for Q8_0's -128 s (its zero is then 0), else the low one (a 4-bit
            # group's zero is then Int4Weight's).
            m_high = torch.where(m == -128 * s, m, torch.zeros_like(m))
            self.high, self.low = map(frozen, q8_planes(codes))
            self.high_scale_zero = frozen(scale_zero(16 * s, m_high))  # 16 s h (+ m)
            self.low_scale_zero = frozen(scale_zero(s, m - m_high))  # s l (+ m)
        else:
            self.codes = frozen(codes)
            self.scale, self.min = frozen(scale.to(dtype)), frozen(lo.to(dtype))

    @staticmethod
    def runs_kernel(device: torch.device, rows: int, dtype: torch.dtype) -> bool:
        """Whether codes of `rows` rows on `device` run a CPU kernel (else each product
        dequantizes): octavo's for float32, torch's for 16-bit rows in 16s."""
        return uses_cpu_kernels(device) and (rows % 16 == 0 or cpu_kernels.available(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_kernels.linear(x, self.packed)
        if self.cpu_kernel:
            x16 = x.to(torch.bfloat16)
            y = torch._weight_int4pack_mm_for_cpu(x16, self.high, 32, self.high_scale_zero)
            y = y.float() + torch._weight_int4pack_mm_for_cpu(
                x16, self.low, 32, self.low_scale_zero
            )
            return y.to(x.dtype)
        return cpu_kernels.dense(
            x, dequantize_int4(self.codes, self.scale, self.min, self.in_features, x.dtype)
        )


class GroupRows(nn.Module):
    """An embedding table kept as codes u [V, H] (uint8) with a scale and a minimum per group
    of 32 columns [V, H / 32] (float32): w = u * scale + min, as in Q8Weight. A lookup
    dequantizes only the rows it reads, in float32 and then `dtype`: a GGUF file's token
    embedding stays in its blocks, as vLLM keeps it."""

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.codes, self.scale, self.min = frozen(codes), frozen(scale), frozen(lo)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> rows [T, H] in `dtype`."""
        codes, scale, lo = self.codes[ids], self.scale[ids], self.min[ids]
        return dequantize_int4(codes, scale, lo, codes.shape[1], torch.float32).to(self.dtype)
