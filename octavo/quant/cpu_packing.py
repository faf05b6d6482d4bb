"""Weights laid out for the CPU kernels: torch's weight-packed int4 kernel, which 16-bit
models run (its packed codes, and its scale and zero per group), and octavo's (float32 models:
kernels/cpu.py's blocks, here an int8 weight's)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from octavo.kernels import cpu as cpu_kernels


def pack_int4_for_torch(
    q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] in 0..15 with w = q * scale + min per group (scale, min [N, G]) -> torch's
    CPU int4 kernel's packed weight and its scale and zero [G, N, 2]: the kernel computes
    (q - 8) * scale + zero."""
    return int4pack(q), scale_zero(scale, lo)


def int4pack(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 -> torch's CPU int4 kernel's packed weight, uint8 [N, K / 2]."""
    rows = int4pack_block_rows()
    if rows is None or q.shape[0] % rows:
        return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    return pack_int4_blocks(q, rows)


def scale_zero(scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Per group (scale, min [N, G]) -> torch's CPU int4 kernel's scale and zero [G, N, 2]."""
    zero = lo + 8 * scale
    return torch.stack([scale.t(), zero.t()], dim=-1).contiguous()


def pack_int4_blocks(q: torch.Tensor, rows: int) -> torch.Tensor:
    """q [N, K] (0..15, N a multiple of `rows`) in the layout of torch's CPU int4 packing
    (_convert_weight_to_int4pack_for_cpu) with blocks of `rows` rows: uint8 [N, K / 2], each
    block's bytes [K, rows / 2] with byte (k, j) = q[j, k] | q[j + rows / 2, k] << 4.

    NOTE: torch's own op takes int32 codes, whose copy of a large weight costs more than the
    packing; this one reads the uint8 codes as they are, about three times faster.
    """
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n // rows, 2, rows // 2, k)
    packed = blocks[:, 0] | (blocks[:, 1] << 4)  # [N / rows, rows / 2, K]
    return packed.transpose(1, 2).contiguous().view(n, k // 2)


@functools.cache
def int4pack_block_rows() -> int | None:
    """The rows per block of this torch's CPU int4 packing (64 with AVX-512, 32 with AVX2),
    found by checking pack_int4_blocks against torch's op on a small random weight; None
    where neither matches (torch's op packs then)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (128, 96), dtype=torch.uint8, generator=generator)
    want = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    return next((rows for rows in (64, 32) if torch.equal(pack_int4_blocks(q, rows), want)), None)


# Rows of a Q8Weight's codes split into planes at a time (a multiple of any packing block):
# the planes of an LM head made whole would take ~150 MB of fresh memory, slow to fault in.
Q8_PLANE_ROWS = 4096


def q8_planes(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 codes u [N, K] -> h and l (u = 16 h + l, both 0..15) packed for torch's CPU
    int4 kernel; in runs of rows where its packing keeps runs apart (a known layout)."""
    n, k = codes.shape
    step = n if int4pack_block_rows() is None else Q8_PLANE_ROWS
    high, low = (torch.empty(n, k // 2, dtype=torch.uint8) for _ in range(2))
    for start in range(0, n, step):
        u = codes[start : start + step]
        high[start : start + step] = int4pack(u >> 4)
        low[start : start + step] = int4pack(u & 15)
    return high, low


def pack_int8_for_octavo(q: torch.Tensor, scale: torch.Tensor) -> cpu_kernels.PackedWeight:
    """int8 q [N, K] with a float32 scale per row as octavo's CPU kernel reads 8-bit codes:
    u = q + 128 with min -128 scale (exactly q * scale), one group of all K, padded to runs."""
    k = q.shape[1]
    codes = F.pad((q.to(torch.int16) + 128).to(torch.uint8), (0, -k % cpu_kernels.RUN))
    scale = scale.float()[:, None]
    return cpu_kernels.pack_weight(codes=codes, scale=scale, lo=-128 * scale, in_features=k)
