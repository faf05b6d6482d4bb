"""fp8 (e4m3) kernels for the fp8 weights (octavo.model.quantization):

- dynamic quantization of activations in one kernel: x [T, K] -> (q, scale) with
  x ~ q * scale, one scale per token (`per_token_quant_fp8`) or per token and group of G
  columns (`per_group_quant_fp8`); scale = max|x| / 448 over what it covers. The torch
  references are `quantize_fp8` and `quantize_fp8_blocks`; the same rounding (to nearest,
  clamped to +-448) gives the same codes.
- `fp8_weight_linear`: y = x (W * scale)^T for a few rows of 16-bit x against e4m3 W with a
  scale per output row, W widened in registers (e4m3 is exact in bfloat16), x not quantized:
  at decode batch sizes the product reads the weight once and is bound by that read, where
  cuBLASLt's fp8 GEMM pads the rows to its tile and runs below the copy rate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.pdl import pdl_args


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


@triton.jit
def _fp8_weight_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_x, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None]  # W^T tile [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=(rows[:, None] < M) & (ks[None, :] + k < K), other=0.0)
        w = tl.load(w_ptrs, mask=(cols[None, :] < N) & (ks[:, None] + k < K), other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(s_ptr + cols, mask=cols < N, other=0.0)
    y = acc * scale[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def fp8_weight_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16/fp16, weight e4m3 [N, K] (contiguous), scale float32 [N] -> [M, N] in
    x's dtype. Tiles of 16 output rows, so that even N = 4096 spreads over the SMs."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_m = 16 if m <= 16 else 32
        grid = (triton.cdiv(n, 16), triton.cdiv(m, block_m))
        _fp8_weight_kernel[grid](
            x, weight.view(torch.float8_e4m3fn), scale, y, m, n, k, x.stride(0), y.stride(0),
            BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4,
            **pdl_args(x.device),
        )  # fmt: skip
    return y
