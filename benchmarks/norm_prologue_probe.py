"""Where an RMSNorm folded into a projection's loop over K costs its time (Triton, H200).

`benchmarks/fused_linear.py` with NORM ran the qkv projection 3x slower than without it
(Qwen3-8B, one row: ~50 against ~16 us). This kernel is that projection with one part of the
norm at a time, each variant timed over every layer's weight in one CUDA graph:

    0  plain projection
    1  sum of squares (tl.sum over each slice) and the norm weight, both in the loop
    2  sum of squares in the loop only
    3  norm weight in the loop only (x * g before the product)
    4  sum of squares in a loop of its own first, slices of BLOCK_K
    5  squares added up elementwise in the loop, reduced once after it
    6  5 with the norm weight
    7  sum of squares in a loop of its own first, slices of 1024

    PYTHONPATH=. python benchmarks/norm_prologue_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from benchmarks.overlap_probe import Probe, time_graph

MODES = range(8)
CASES = [("qwen3-8b", 1), ("qwen3-8b", 16), ("qwen3-0.6b", 8)]


@triton.jit
def _norm_mode_kernel(x_ptr, w_ptr, out_ptr, g_ptr, M, N, K, stride_x, eps,
                      MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):  # fmt: skip
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    if MODE == 4:
        for k in range(0, K, BLOCK_K):
            xf = tl.load(x_rows + k + offs_k[None, :], mask=m_ok[:, None], other=0.0)
            sum_sq += tl.sum(xf.to(tl.float32) * xf.to(tl.float32), 1)
    if MODE == 7:
        offs_c = tl.arange(0, 1024)
        for k in range(0, K, 1024):
            xf = tl.load(x_rows + k + offs_c[None, :], mask=m_ok[:, None], other=0.0)
            sum_sq += tl.sum(xf.to(tl.float32) * xf.to(tl.float32), 1)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_rows + k + offs_k[None, :], mask=m_ok[:, None], other=0.0)
        if MODE == 1 or MODE == 2:
            xf = x.to(tl.float32)
            sum_sq += tl.sum(xf * xf, 1)
        if MODE == 5 or MODE == 6:
            xf = x.to(tl.float32)
            squares += xf * xf
        if MODE == 1 or MODE == 3 or MODE == 6:
            g = tl.load(g_ptr + k + offs_k).to(tl.float32)
            x = (x.to(tl.float32) * g[None, :]).to(w_ptr.dtype.element_ty)
        acc = tl.dot(x, tl.trans(tl.load(w_ptrs + k)), acc)
    if MODE == 5 or MODE == 6:
        sum_sq = tl.sum(squares, 1)
    if MODE != 0 and MODE != 3:
        acc = acc * tl.rsqrt(sum_sq / K + eps)[:, None]
    out_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


def _case(p: Probe) -> dict:
    m = p.batch
    x = torch.randn(m, p.s["hidden"], device="cuda").to(torch.bfloat16)

    def run(mode: int) -> None:
        for q in p.layers:
            w = q["qkv"]
            out = torch.empty(m, w.shape[0], device="cuda", dtype=torch.bfloat16)
            _norm_mode_kernel[(w.shape[0] // 32, 1)](
                x, w, out, q["ln1"], m, w.shape[0], w.shape[1], x.stride(0), 1e-6, MODE=mode,
                BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4,
            )  # fmt: skip

    return {
        f"mode{mode}_us": time_graph(lambda mode=mode: run(mode), 30) * 1e3 / len(p.layers)
        for mode in MODES
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    rows = []
    for model, m in CASES:
        rows.append({"model": model, "rows": m, **_case(Probe(model, m, 256))})
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    print(f"\n{'model':11} {'rows':>4} | " + " ".join(f"{f'mode {i}':>7}" for i in MODES)
          + "   us per qkv call")  # fmt: skip
    for r in rows:
        print(f"{r['model']:11} {r['rows']:4} | "
              + " ".join(f"{r[f'mode{i}_us']:7.1f}" for i in MODES))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
