"""Dynamic fp8 (e4m3) quantization of activations in one kernel, for the fp8 weights'
scaled matmuls (octavo.quant.weights): x [T, K] -> (q, scale) with x ~ q * scale, one
scale per token (`per_token_quant_fp8`) or per token and group of G columns
(`per_group_quant_fp8`); scale = max|x| / 448 over what it covers. The torch references are
`quantize_fp8` and `quantize_fp8_blocks`; the same rounding (to nearest, clamped to +-448)
gives the same codes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _per_token_kernel(x_ptr, q_ptr, s_ptr, stride_x, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):  # pass 1: the row's max |x|
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    for start in range(0, K, BLOCK):  # pass 2: the codes (the row is back from L2)
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    tl.store(s_ptr + row, scale)


@triton.jit
def _per_group_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_s_row, stride_s_group, K,
    G: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
    offs = groups[:, None] * G + tl.arange(0, G)[None, :]  # [GROUPS, G]
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / 448.0, 1e-12)  # [GROUPS]
    q = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    s_offs = row * stride_s_row + groups * stride_s_group
    tl.store(s_ptr + s_offs, scale, mask=groups * G < K)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q e4m3 [T, K], scale float32 [T])."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = min(triton.next_power_of_2(k), 4096)
        _per_token_kernel[(rows,)](x, q, scale, x.stride(0), k, BLOCK=block, num_warps=8)
    return q, scale


def per_group_quant_fp8(
    x: torch.Tensor, group: int, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (`group` a power of two dividing K) -> (q e4m3 [T, K], scale float32
    [T, K / group]), the scales laid out column-major if asked (as cuBLASLt's block-wise
    scaled matmul takes them)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, k = x.shape
    num_groups = k // group
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    if column_major_scales:
        scale = torch.empty(num_groups, rows, dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty(rows, num_groups, dtype=torch.float32, device=x.device)
    if rows:
        per_program = max(1, min(triton.next_power_of_2(num_groups), 4096 // group))
        grid = (rows, triton.cdiv(num_groups, per_program))
        _per_group_kernel[grid](
            x, q, scale, x.stride(0), scale.stride(0), scale.stride(1), k,
            G=group, GROUPS=per_program, num_warps=4,
        )  # fmt: skip
    return q, scale
