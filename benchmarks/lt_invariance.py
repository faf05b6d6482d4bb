"""Which cuBLASLt algorithms give fixed_gemm's bits (deterministic mode's products), and how
fast they are: for each Qwen3-8B projection shape, cuBLASLt's first heuristic algorithms at
8,192 rows with K unsplit, each run at several row counts; an algorithm "matches" when every
row count gives every row the same bits as fixed_gemm (whose rows are the same at any row
count: tests/gpu/test_fixed_order.py). Times are against F.linear and fixed_gemm.

    python benchmarks/lt_invariance.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from octavo.kernels import cublaslt
from octavo.kernels.fixed_gemm import fixed_gemm

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288)}  # fmt: skip
CHECK_ROWS = [1, 3, 64, 200, 512, 1000, 4096, 8192]
TIME_ROWS = [64, 512, 2048, 8192]
SMALL_ROWS = [32, 64, 128, 256, 384, 512, 768, 1024]


def _us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    if args.small:
        return small(args)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    out = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=dtype)
        x = torch.randn(max(CHECK_ROWS), k, device=dev, dtype=dtype)
        ref = fixed_gemm(x, w)
        base = {}  # F.linear and fixed_gemm at each timed row count
        for m in TIME_ROWS:
            xm = x[:m].contiguous()
            base[m] = {"cublas": _us(lambda xm=xm, w=w: F.linear(xm, w)),
                       "fixed": _us(lambda xm=xm, w=w: fixed_gemm(xm, w))}  # fmt: skip
        algos = cublaslt.LtGemm(8192, n, k, dtype).candidates(args.candidates, splits=(1,))
        for index, algo in enumerate(algos):
            matches, invariant, accepted = True, True, []
            own = cublaslt.LtGemm(max(CHECK_ROWS), n, k, dtype)(x, w, algo)
            for m in CHECK_ROWS:
                gemm = cublaslt.LtGemm(m, n, k, dtype)
                if not gemm.accepts(algo):
                    continue
                accepted.append(m)
                y = gemm(x[:m].contiguous(), w, algo)
                matches &= torch.equal(y, ref[:m])
                invariant &= torch.equal(y, own[:m])  # its own rows at any row count
            times = {}
            for m in TIME_ROWS:
                gemm = cublaslt.LtGemm(m, n, k, dtype)
                if gemm.accepts(algo):
                    xm = x[:m].contiguous()
                    lt = _us(lambda g=gemm, xm=xm, w=w, a=algo: g(xm, w, a))
                    times[m] = {"lt": lt, **base[m]}
            row = {"shape": name, "algo": index, "matches_fixed_gemm": bool(matches),
                   "row_invariant": bool(invariant),
                   "accepted_rows": accepted, "us": times}  # fmt: skip
            out.append(row)
            cells = " ".join(
                f"{m}:{t['lt']:.0f}/{t['cublas']:.0f}/{t['fixed']:.0f}" for m, t in times.items()
            )
            print(f"{name:8} algo {index}: fixed={matches!s:5} own={invariant!s:5} rows={accepted} "
                  f"us lt/cuBLAS/fixed {cells}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def small_row(name: str, w: torch.Tensor, m: int, count: int) -> dict:
    """At m rows: cuBLASLt's first `count` picks for m rows (K unsplit), the fastest of those
    that give fixed_gemm's bits, F.linear and fixed_gemm."""
    n, k = w.shape
    x = torch.randn(m, k, device=w.device, dtype=w.dtype)
    ref = fixed_gemm(x, w)
    gemm = cublaslt.LtGemm(m, n, k, w.dtype)
    times = []  # (us, index) of the candidates that give fixed_gemm's bits
    algos = gemm.candidates(count, splits=(1,))
    for index, algo in enumerate(algos):
        if gemm.accepts(algo) and torch.equal(gemm(x, w, algo), ref):
            times.append((_us(lambda a=algo: gemm(x, w, a)), index))
    best = min(times) if times else (float("nan"), -1)
    return {"shape": name, "rows": m, "candidates": len(algos), "matching": len(times),
            "best_index": best[1], "best_lt_us": best[0],
            "cublas_us": _us(lambda: F.linear(x, w)),
            "fixed_us": _us(lambda: fixed_gemm(x, w))}  # fmt: skip


def small(args) -> None:
    torch.manual_seed(0)
    out = []
    print(f"{'shape':8}{'rows':>6}{'match':>7}{'best lt us':>12}{'cuBLAS us':>11}{'fixed us':>10}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in SMALL_ROWS:
            r = small_row(name, w, m, args.candidates)
            out.append(r)
            print(
                f"{name:8}{m:>6}{r['matching']:>4}/{r['candidates']:<2}{r['best_lt_us']:>12.1f}"
                f"{r['cublas_us']:>11.1f}{r['fixed_us']:>10.1f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
