"""Round-to-nearest quantizers and their inverses: what quantization="int8" / "int4" / "fp8"
make of float weights (and fp8 of activations), and the dequantize-then-matmul references the
quantized products are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
FP8_BLOCK = 128  # an HF fp8 checkpoint's weight_block_size, each way


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scale [N]) with w ~ q * scale, |q| <= 127."""
    scale = (w.float().abs().amax(dim=1) / 127).clamp(min=1e-12).to(scale_dtype)
    q = torch.round(w.float() / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)[:, None]


def quantize_int4(
    w: torch.Tensor, group_size: int, param_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q uint8 [N, Kp] in 0..15, scale [N, G], min [N, G]) with
    w ~ q * scale + min per group of `group_size` columns.

    K is padded to Kp = G * group_size: a last, partial group takes its range from its real
    columns only, and its padding columns meet zero activations.
    """
    n, k = w.shape
    groups = -(-k // group_size)
    pad = groups * group_size - k
    w = w.float()
    grouped = (F.pad(w, (0, pad)) if pad else w).view(n, groups, group_size)
    lo, hi = grouped.amin(dim=2), grouped.amax(dim=2)
    if pad:  # the last group's range from its real columns, not the zeros padding it
        tail = w[:, (groups - 1) * group_size :]
        lo[:, -1], hi[:, -1] = tail.amin(dim=1), tail.amax(dim=1)
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(param_dtype)
    lo = lo.to(param_dtype)
    q = (grouped - lo.float()[..., None]).div_(scale.float()[..., None]).round_().clamp_(0, 15)
    return q.view(n, -1).to(torch.uint8), scale, lo


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, in_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """The inverse of quantize_int4: [N, K] in `dtype`; as well any codes (8-bit ones too) on
    a grid of group scales and minimums [N, G]."""
    n, groups = scale.shape
    grouped = q.view(n, groups, q.shape[1] // groups).to(dtype)
    w = grouped * scale.to(dtype)[..., None] + lo.to(dtype)[..., None]
    return w.flatten(1)[:, :in_features]


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q e4m3 [R, C], scale float32 [R]) with x ~ q * scale, one scale per row
    (a weight's output channel, or an activation's token)."""
    scale = (x.float().abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def quantize_fp8_blocks(
    x: torch.Tensor, block_rows: int, block_cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q e4m3 [R, C], scale float32 [ceil(R / block_rows), ceil(C / block_cols)])
    with x ~ q * scale in each block: an HF fp8 checkpoint's weights in 128 x 128, activations
    in 1 x 128. A last, partial block takes its range from its real elements."""
    r, c = x.shape
    grid_rows, grid_cols = -(-r // block_rows), -(-c // block_cols)
    x = x.float()
    if (grid_rows * block_rows, grid_cols * block_cols) != (r, c):
        x = F.pad(x, (0, grid_cols * block_cols - c, 0, grid_rows * block_rows - r))
    blocks = x.reshape(grid_rows, block_rows, grid_cols, block_cols)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(x.shape)[:r, :c].contiguous(), scale


def dequantize_fp8_blocks(
    q: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """The inverse of quantize_fp8_blocks: [R, C] in `dtype`."""
    r, c = q.shape
    scale = scale.repeat_interleave(block_rows, dim=0)[:r].repeat_interleave(block_cols, dim=1)
    return (q.float() * scale[:, :c]).to(dtype)
