"""Decode-size linear layers inside a CUDA graph: cuBLAS against a split-K Triton GEMM.

At 32-256 rows a decode step's GEMMs are latency-bound: cuBLAS runs Qwen3-0.6B's four
projections of a layer in 6.5-8.8 us each inside the decode graph, against weight-read
floors of 1.4-4.3 us (docs/PERFORMANCE.md). With N = 1024 outputs and 64-wide tiles only
16-64 tiles exist, so each program walks the whole K loop alone. Split-K gives each tile
SPLIT_K programs over slices of K; the last one to finish (an atomic counter per tile) sums
the fp32 partials in a fixed order, so results do not depend on timing, and resets its
counter for the next launch (CUDA-graph safe: one launch, no memset).

Timing is per projection, inside a graph of 28 launches over 28 distinct weights (more bytes
than L2 holds, as in a decode step where attention streams gigabytes between the GEMMs).

    PYTHONPATH=. python benchmarks/gemm_splitk.py [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.runtime.errors

from benchmarks.gemm_small import SHAPES  # (name, N, K): the four projections of a layer
from octavo.entrypoints.bench_floor import measure_ceilings


@triton.jit
def _splitk_gemm_kernel(
    x_ptr,  # [M, K], K contiguous
    w_ptr,  # [N, K], K contiguous
    y_ptr,  # [M, N], contiguous
    part_ptr,  # [SPLIT_K, M, N] fp32 workspace
    count_ptr,  # [tiles] int32, zero between launches
    M,
    N,
    K,
    stride_x,
    stride_w,
    k_per_split,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of SPLIT_K * BLOCK_K
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_lo = pid_k * k_per_split
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + (k_lo + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k_lo + k + offs_k) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        mn = M * N
        tl.store(part_ptr + pid_k * mn + y_offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the count moves
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last of the tile's programs sums, in split order
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(
                    part_ptr + s * mn + y_offs, mask=mask, other=0.0, cache_modifier=".cg"
                )
            tl.store(y_ptr + y_offs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def splitk_gemm(x: torch.Tensor, weight: torch.Tensor, config: dict[str, int]) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, fp32 accumulation, split over K."""
    m, k = x.shape
    n = weight.shape[0]
    bm, bn, bk, split = config["block_m"], config["block_n"], config["block_k"], config["split_k"]
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split if split > 1 else 0, m, n, dtype=torch.float32, device=x.device)
    counters = _COUNTERS.get(x.device)
    if counters is None or counters.numel() < grid[0] * grid[1]:
        counters = _COUNTERS[x.device] = torch.zeros(1 << 16, dtype=torch.int32, device=x.device)
    _splitk_gemm_kernel[grid](
        x, weight, y, part, counters, m, n, k, x.stride(0), weight.stride(0),
        triton.cdiv(triton.cdiv(k, split), bk) * bk, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT_K=split, EVEN_K=k % (split * bk) == 0, num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )  # fmt: skip
    return y


ROWS = [32, 64, 128, 256]
LAYERS = 28


def configs(m: int) -> list[dict[str, int]]:
    block_ms = [bm for bm in (16, 32, 64, 128) if bm <= max(16, m)]
    out = []
    for bm, bn, bk, split, warps in itertools.product(
        block_ms[-2:], [32, 64, 128], [64, 128], [1, 2, 4, 8], [4]
    ):
        out.append({"block_m": bm, "block_n": bn, "block_k": bk, "split_k": split,
                    "num_warps": warps, "num_stages": 4})  # fmt: skip
    return out


def graph_us(fns) -> float:
    """Microseconds per call of each of `fns`, replayed as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--models", default="qwen3-0.6b")
    parser.add_argument("--no-triton", action="store_true", help="cuBLAS cold and L2-hot only")
    args = parser.parse_args()
    copy = measure_ceilings(torch.bfloat16).copy_bytes_per_s
    rows = []
    print(f"{'model':<11}{'proj':<8}{'M':>4}{'floor us':>9}{'cublas':>8}{'L2 hot':>8}{'splitk':>8}"
          "  best")
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
                  for _ in range(LAYERS)]  # fmt: skip
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, ws[0]).float()
                cublas = graph_us([lambda w=w: F.linear(x, w) for w in ws])  # noqa: B023
                # The same weight 28 times: after the first call it is served from L2.
                hot = graph_us([lambda w=ws[0]: F.linear(x, w)] * LAYERS)  # noqa: B023
                timed = []
                for cfg in [] if args.no_triton else configs(m):
                    try:
                        got = splitk_gemm(x, ws[0], cfg)
                    except triton.runtime.errors.OutOfResources:
                        continue
                    err = ((got.float() - ref).norm() / ref.norm()).item()
                    again = splitk_gemm(x, ws[0], cfg)
                    if err > 1e-2 or not torch.equal(got, again):
                        raise AssertionError(f"{model} {name} M={m} {cfg}: rel err {err}")
                    t = graph_us([lambda w=w, c=cfg: splitk_gemm(x, w, c) for w in ws])  # noqa: B023
                    timed.append((t, cfg))
                best_us, best = min(timed, key=lambda t: t[0]) if timed else (float("nan"), {})
                floor = n * k * 2 / copy * 1e6
                rows.append({"model": model, "proj": name, "m": m, "n": n, "k": k,
                             "floor_us": floor, "cublas_us": cublas, "cublas_l2_hot_us": hot, "splitk_us": best_us,
                             "best": best})  # fmt: skip
                cfg_s = " ".join(f"{a}={b}" for a, b in best.items())
                print(f"{model:<11}{name:<8}{m:>4}{floor:>9.1f}{cublas:>8.1f}{hot:>8.1f}{best_us:>8.1f}  "
                      f"{cfg_s}", flush=True)  # fmt: skip
            del ws
    for model in args.models.split(","):
        for m in ROWS:
            sel = [r for r in rows if r["model"] == model and r["m"] == m]
            print(f"{model} M={m}: a layer's floor {sum(r['floor_us'] for r in sel):.1f} us, "
                  f"cuBLAS {sum(r['cublas_us'] for r in sel):.1f} (L2-hot "
                  f"{sum(r['cublas_l2_hot_us'] for r in sel):.1f}), split-K "
                  f"{sum(r['splitk_us'] for r in sel):.1f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bytes_per_s": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
