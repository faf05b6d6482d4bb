"""A linear layer for few rows, with the small kernels around it folded in (Triton).

An experiment, not used by the engine: `benchmarks/fused_linear_probe.py` times it against
the engine's kernels, and docs/PERFORMANCE.md (session 7) says why it stays out.

At decode batches of a few rows a projection reads its whole weight to produce a few
outputs, and the RMSNorm before it, the SiLU-and-mul after gate/up and the residual add after
o/down each cost a launch of their own for almost no bytes. This kernel does one projection
and whichever of those belong to it:

    NORM      y = (x * g) @ W.T * rsqrt(mean(x^2) + eps)     RMSNorm before the projection
    GATED     y = silu(x @ Wg.T) * (x @ Wu.T)                gate/up rows [gate | up] of W
    RESIDUAL  y = x @ W.T + r                                the residual add after it

So a pre-norm decoder layer runs as four of these around attention, on the residual stream h:

    qkv = L(h; NORM g_in, W_qkv)      attention      h = L(a; W_o, RESIDUAL h)
    act = L(h; NORM g_post, GATED W_gate_up)         h = L(act; W_down, RESIDUAL h)

The row scale of the norm commutes with the projection, so it is applied to the fp32
accumulator at the end, while the sum of squares builds up in the same loop over K. Each
program owns BLOCK_N output columns (for GATED, the same columns of gate and up) of up to
BLOCK_M rows, and walks K once: the weight is read once in all, the rows of x once per program.

Numerics differ from the unfused layers by rounding only: the unfused path rounds the normed
rows, the gate/up output and the projection output to the dtype before the next op; here the
accumulators stay fp32 until the single rounding at the store. The torch reference is
`fused_linear_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.pdl import pdl_args


@triton.jit
def _k_step(acc, acc_up, sum_sq, x, w, w_up, g_ptr, k, offs_k, NORM: tl.constexpr,
            GATED: tl.constexpr):  # fmt: skip
    """One BLOCK_K slice: the norm's sum of squares and weight, then the products."""
    if NORM:
        xf = x.to(tl.float32)
        sum_sq += tl.sum(xf * xf, 1)
        g = tl.load(g_ptr + k + offs_k).to(tl.float32)
        x = (xf * g[None, :]).to(w.dtype)
    acc = tl.dot(x, tl.trans(w), acc)
    if GATED:
        acc_up = tl.dot(x, tl.trans(w_up), acc_up)
    return acc, acc_up, sum_sq


@triton.jit
def _fused_linear_kernel(
    x_ptr,  # [M, K], last dim contiguous
    w_ptr,  # [N (x 2 if GATED), K], contiguous (nn.Linear layout)
    out_ptr,  # [M, N], contiguous
    res_ptr,  # [M, N] (read if RESIDUAL)
    g_ptr,  # [K] norm weight (read if NORM)
    M,
    N,
    K,
    stride_x,
    stride_r,
    eps,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides K
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # N % BLOCK_N == 0
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    up = N.to(tl.int64) * K  # gate row n + N is up row n
    # The weights never depend on the previous kernel: the first slice is loaded before
    # waiting for it, so with PDL its latency overlaps the previous kernel's tail.
    w = tl.load(w_ptrs)
    w_up = tl.load(w_ptrs + up) if GATED else w
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
    acc, acc_up, sum_sq = _k_step(acc, acc_up, sum_sq, x, w, w_up, g_ptr, 0, offs_k, NORM, GATED)
    for k in range(BLOCK_K, K, BLOCK_K):
        x = tl.load(x_ptrs + k, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs + k)
        w_up = tl.load(w_ptrs + up + k) if GATED else w
        acc, acc_up, sum_sq = _k_step(
            acc, acc_up, sum_sq, x, w, w_up, g_ptr, k, offs_k, NORM, GATED
        )
    if NORM:
        inv_rms = tl.rsqrt(sum_sq / K + eps)
        acc = acc * inv_rms[:, None]
        acc_up = acc_up * inv_rms[:, None]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_mask = m_ok[:, None]
    if RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None].to(tl.int64) * stride_r + offs_n[None, :],
                    mask=out_mask, other=0.0)  # fmt: skip
        acc += r.to(tl.float32)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def default_fused_linear_config(num_rows: int, n: int, k: int, gated: bool) -> dict[str, int]:
    """Tile and launch knobs: BLOCK_M covers the rows (at least 16, tl.dot's minimum), and
    as many pipeline stages as fit in shared memory (227 KB on Hopper) beside the first
    slice, which is loaded ahead of the loop, up to four."""
    block_m = max(16, triton.next_power_of_2(num_rows)) if num_rows <= 64 else 64
    block_n = 32 if n >= 4096 else 16
    block_k = 256 if k % 256 == 0 else 128
    stage_bytes = (block_m + block_n * (2 if gated else 1)) * block_k * 2
    return {
        "block_m": block_m,
        "block_n": block_n,
        "block_k": block_k,
        "num_warps": 4,
        "num_stages": max(1, min(4, (220 << 10) // stage_bytes - 1)),
    }


def fused_linear_supported(n: int, k: int) -> bool:
    """Shapes the kernel takes: output and input widths in whole tiles."""
    return n % 32 == 0 and k % 128 == 0


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """One projection of x [M, K] by weight [N, K] (or [2N, K] = [gate | up] when `gated`),
    with an RMSNorm before it (`norm_weight` [K]), SiLU-and-mul after it (`gated`) and a
    residual add (`residual` [M, N]), each optional (see the module doc). Returns [M, N] in
    x's dtype. No bias: layers with one take the unfused path.
    """
    num_rows, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if (
        weight.shape[1] != k
        or not weight.is_contiguous()
        or x.stride(1) != 1
        or not fused_linear_supported(n, k)
    ):
        raise ValueError(
            f"fused_linear takes x [M, K] (last dim contiguous) and a contiguous weight "
            f"[N, K] with N % 32 == 0 and K % 128 == 0; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight must be [{k}], got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != (num_rows, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [{num_rows}, {n}], got {tuple(residual.shape)}")
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    cfg = config or default_fused_linear_config(num_rows, n, k, gated)
    grid = (n // cfg["block_n"], triton.cdiv(num_rows, cfg["block_m"]))
    _fused_linear_kernel[grid](
        x,
        weight,
        out,
        residual if residual is not None else out,
        norm_weight if norm_weight is not None else weight,
        num_rows,
        n,
        k,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        eps,
        NORM=norm_weight is not None,
        GATED=gated,
        RESIDUAL=residual is not None,
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl_args(x.device),
    )
    return out


def fused_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unfused layers in torch, in float32 throughout (the probe compares both to it)."""
    h = x.float()
    if norm_weight is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = h @ weight.float().T
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)
