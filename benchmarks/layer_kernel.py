"""An experiment: the part of a decode layer between two attentions as one persistent kernel.

After attention, a Qwen3 decode layer runs seven kernels: o_proj, RMSNorm with the residual
add, gate/up, SiLU-and-mul, down, and the next layer's RMSNorm and qkv projection. Inside the
decode graph each GEMM costs ~6-8 us at any batch from 8 to 256 rows, several times its
weight-read or FLOP floor (docs/PERFORMANCE.md): launch, pipeline fill and drain. Here one
program per SM runs all of it in four phases, with a grid-wide barrier between phases:

    A  o = a @ Wo^T;  r1 = o + residual;  partial sums of r1^2 per row and column tile
    B  h = rmsnorm(r1) * ln2 (from the partial sums);  act = silu(h @ Wg^T) * (h @ Wu^T)
    C  d = act @ Wd^T;  r2 = d + r1;  partial sums of r2^2
    D  h' = rmsnorm(r2) * ln1';  qkv' = h' @ Wqkv'^T      (the next layer's input)

Rounding follows the engine's kernels step by step (each GEMM output rounded to bf16, the
residual add and the normalised row rounded where `rms_norm` rounds them); only the order of
the fp32 sums differs. `PHASE` >= 0 runs one phase alone, with no barrier, so the same tiles
can be launched as four kernels (and run in Triton's interpreter).

All programs must be resident at once for the barrier: the grid is one program per SM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.pdl import pdl_args

# The most column tiles of the hidden size a phase may write partial sums for (the row
# stride of the partial-sums buffer).
SSQ_COLS = tl.constexpr(64)


@triton.jit
def _grid_sync(sync_ptr, target):
    """Waits until every program has arrived `target // num_programs` times in all."""
    tl.debug_barrier()  # this program's stores are issued before it arrives
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _proj_residual(
    x_ptr, w_ptr, res_ptr, out_ptr, ssq_ptr, M, pid,
    N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NPROG: tl.constexpr,
):  # fmt: skip
    """out = bf16(bf16(x @ W^T) + res), and per row the sum of out^2 over each BN columns."""
    num_m = tl.cdiv(M, BM)
    for t in range(pid, num_m * (N // BN), NPROG):
        rows = (t % num_m) * BM + tl.arange(0, BM)
        nb = t // num_m
        cols = nb * BN + tl.arange(0, BN)
        kk = tl.arange(0, BK)
        rmask = rows < M
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            x = tl.load(x_ptr + rows[:, None] * K + (k + kk)[None, :], mask=rmask[:, None],
                        other=0.0, cache_modifier=".cg")  # fmt: skip
            w = tl.load(w_ptr + cols[None, :] * K + (k + kk)[:, None])  # [BK, BN]
            acc = tl.dot(x, w, acc)
        r = tl.load(res_ptr + rows[:, None] * N + cols[None, :], mask=rmask[:, None], other=0.0,
                    cache_modifier=".cg")  # fmt: skip
        out = (acc.to(r.dtype).to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], out, mask=rmask[:, None])
        of = out.to(tl.float32)
        tl.store(ssq_ptr + rows * SSQ_COLS + nb, tl.sum(of * of, axis=1), mask=rmask)


@triton.jit
def _norm_proj(
    x_ptr, ssq_ptr, ln_ptr, w_ptr, out_ptr, M, pid, eps,
    N_OUT: tl.constexpr, K: tl.constexpr, NSSQ: tl.constexpr, GATED: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NPROG: tl.constexpr,
):  # fmt: skip
    """out = bf16(norm(x) @ W^T), norm(x) = bf16(bf16(x * rstd) * ln) with rstd from the
    partial sums; GATED: W is [2 * N_OUT, K] (gate rows, then up rows) and
    out = bf16(silu(g) * u) with g, u the two projections rounded to bf16."""
    num_m = tl.cdiv(M, BM)
    for t in range(pid, num_m * (N_OUT // BN), NPROG):
        rows = (t % num_m) * BM + tl.arange(0, BM)
        cols = (t // num_m) * BN + tl.arange(0, BN)
        kk = tl.arange(0, BK)
        rmask = rows < M
        ssq = tl.load(ssq_ptr + rows[:, None] * SSQ_COLS + tl.arange(0, NSSQ)[None, :],
                      mask=rmask[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
        rstd = tl.rsqrt(tl.sum(ssq, axis=1) / K + eps)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            x = tl.load(x_ptr + rows[:, None] * K + (k + kk)[None, :], mask=rmask[:, None],
                        other=0.0, cache_modifier=".cg")  # fmt: skip
            ln = tl.load(ln_ptr + k + kk).to(tl.float32)
            h = ((x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32) * ln[None, :])
            h = h.to(x.dtype)
            w = tl.load(w_ptr + cols[None, :] * K + (k + kk)[:, None])
            acc = tl.dot(h, w, acc)
            if GATED:
                wu = tl.load(w_ptr + (N_OUT + cols)[None, :] * K + (k + kk)[:, None])
                acc_up = tl.dot(h, wu, acc_up)
        if GATED:
            g = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            u = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + rows[:, None] * N_OUT + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None])  # fmt: skip


@triton.jit(do_not_specialize=["M"])  # one compile serves every batch size
def _layer_rest_kernel(
    a_ptr, res_ptr, wo_ptr, ln2_ptr, wgu_ptr, wd_ptr, ln1_ptr, wqkv_ptr,
    r1_ptr, act_ptr, ssq_ptr, r2_ptr, qkv_ptr, sync_ptr, M, eps,
    H: tl.constexpr, Q: tl.constexpr, INTER: tl.constexpr, NQKV: tl.constexpr,
    BM: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr,
    BN_QKV: tl.constexpr, BK: tl.constexpr, NPROG: tl.constexpr, PHASE: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    pid = tl.program_id(0)
    if PHASE < 0 or PHASE == 0:
        _proj_residual(a_ptr, wo_ptr, res_ptr, r1_ptr, ssq_ptr, M, pid, H, Q, BM, BN_O, BK, NPROG)
    if PHASE < 0:
        _grid_sync(sync_ptr, NPROG)
    if PHASE < 0 or PHASE == 1:
        _norm_proj(r1_ptr, ssq_ptr, ln2_ptr, wgu_ptr, act_ptr, M, pid, eps, INTER, H, H // BN_O,
                   True, BM, BN_GU, BK, NPROG)  # fmt: skip
    if PHASE < 0:
        _grid_sync(sync_ptr, 2 * NPROG)
    if PHASE < 0 or PHASE == 2:
        _proj_residual(act_ptr, wd_ptr, r1_ptr, r2_ptr, ssq_ptr, M, pid, H, INTER, BM, BN_D, BK,
                       NPROG)  # fmt: skip
    if PHASE < 0:
        _grid_sync(sync_ptr, 3 * NPROG)
    if PHASE < 0 or PHASE == 3:
        _norm_proj(r2_ptr, ssq_ptr, ln1_ptr, wqkv_ptr, qkv_ptr, M, pid, eps, NQKV, H, H // BN_D,
                   False, BM, BN_QKV, BK, NPROG)  # fmt: skip


def num_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


class LayerRest:
    """Scratch buffers for up to `max_rows` rows and the launch of one layer's rest.

    cfg: BM, BN_O, BN_GU, BN_D, BN_QKV, BK, num_warps, num_stages."""

    def __init__(self, hidden, q_size, inter, qkv_size, max_rows, device, dtype, layers) -> None:
        self.shape = (hidden, q_size, inter, qkv_size)
        e = dict(device=device, dtype=dtype)
        self.r1 = torch.empty(max_rows, hidden, **e)
        self.act = torch.empty(max_rows, inter, **e)
        self.ssq = torch.empty(max_rows, SSQ_COLS.value, device=device, dtype=torch.float32)
        self.sync = torch.zeros(layers, dtype=torch.int32, device=device)
        self.nprog = num_programs(torch.device(device))

    def __call__(self, layer, a, res, wo, ln2, wgu, wd, ln1, wqkv, r2, qkv, eps, cfg, split=False):
        hidden, q_size, inter, qkv_size = self.shape
        m = a.shape[0]
        if hidden // cfg["BN_O"] > SSQ_COLS.value or hidden // cfg["BN_D"] > SSQ_COLS.value:
            raise ValueError("BN_O and BN_D must leave at most 64 column tiles")
        kw = dict(H=hidden, Q=q_size, INTER=inter, NQKV=qkv_size,
                  **{k: cfg[k] for k in ("BM", "BN_O", "BN_GU", "BN_D", "BN_QKV", "BK")},
                  NPROG=self.nprog, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  **pdl_args(a.device))  # fmt: skip
        args = (a, res, wo, ln2, wgu, wd, ln1, wqkv, self.r1, self.act, self.ssq, r2, qkv,
                self.sync[layer:], m, eps)  # fmt: skip
        for phase in range(4) if split else (-1,):
            _layer_rest_kernel[(self.nprog,)](*args, PHASE=phase, **kw)
