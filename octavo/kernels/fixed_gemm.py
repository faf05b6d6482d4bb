"""y = x @ w.T (+ b) on CUDA with every output computed the same way whatever the row count.

cuBLAS picks its kernel by the shape: at 1 row a split-K kernel, at 256 rows another tile,
each summing a row's K products in another order, so a token's logits change with the batch
it shares a step with. Here every output y[m, n] is one float32 accumulator that takes its K
products 16 at a time, k = 0, 16, 32, ..., in order (tl.dot chained on the accumulator: one
Hopper wgmma per 16 columns), rounded once at the end, never split over programs:

    y[m, n] = round( ((0 + x[m, 0:16] . w[n, 0:16]) + x[m, 16:32] . w[n, 16:32]) + ... )

A tile only decides which outputs one program computes, so the tile shape follows the row
count for speed without changing a bit (tests/gpu/test_fixed_gemm.py checks each shape
against one row at a time). Every tile has BLOCK_M >= 64 rows, so that every tile runs the
same tensor-core instruction (wgmma on Hopper, whose smallest M is 64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.pdl import pdl_args

DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _fixed_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] (read only with HAS_BIAS)
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # row tiles that walk the same columns together (L2 reuse)
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = pid // per_group * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_m
    tile_n = (pid % per_group) // group_m

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[:, None] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + offs_k)[None, :] < K
        a = tl.load(x_rows + (k + offs_k)[None, :], mask=m_ok & k_ok, other=0.0)
        b = tl.load(w_rows + (k + offs_k)[None, :], mask=n_ok & k_ok, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok & (offs_n[None, :] < N))


def _tile(bm: int, bn: int, bk: int, warps: int, stages: int) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}


def tile_config(m: int, n: int, k: int) -> dict[str, int]:
    """The tile for an [m, k] x [k, n] product: the fastest of a sweep on an H100 at
    Qwen3-8B's shapes (benchmarks/fixed_gemm.py --sweep). Up to 64 rows stream the weight in
    narrow column tiles with long K steps; from 512 rows on, 128-row tiles with 8 warps."""
    if m <= 64:
        return _tile(64, 32 if n <= 8192 else 64, 256 if k > 8192 else 128, 4, 4)
    if m <= 128:
        if n <= 4096:
            return _tile(64, 64, 128, 4, 5)
        if n <= 8192:
            return _tile(64, 128, 128, 4, 4)
        return _tile(64, 128, 64, 4, 3) if n <= 65536 else _tile(128, 128, 64, 8, 4)
    if m <= 256:
        if n <= 4096:
            return _tile(64, 128, 128, 4, 4)
        return _tile(64, 64, 64, 4, 4) if n <= 8192 else _tile(128, 128, 64, 8, 4)
    if m <= 512:
        return _tile(128, 128, 64, 8, 4)
    if m <= 2048 and k <= 8192:
        return _tile(128, 128, 64, 8, 3)
    return _tile(128, 256, 64, 8, 4)


def fixed_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [..., K] @ w[N, K].T (+ bias [N]) -> [..., N] in x's dtype, each output summed in the
    fixed order above. `config` overrides `tile_config` (tests and benchmarks sweep it)."""
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise ValueError(f"fixed_gemm takes bfloat16 or float16 x and w, got {x.dtype}, {w.dtype}")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    m, n = x2.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*lead, n)
    cfg = config or tile_config(m, n, k)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _fixed_gemm_kernel[grid](
        x2, w, bias if bias is not None else w, y, m, n, k, x2.stride(0), w.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, GROUP_M=8, **cfg, **pdl_args(x.device),
    )  # fmt: skip
    return y.view(*lead, n)
