"""Decode-size projections: torch's cuBLAS call against every algorithm cuBLASLt offers.

`F.linear` on a bf16 weight takes cuBLAS's first heuristic choice for the shape. PyTorch's
TunableOp does not search further on CUDA (its only CUDA candidates are the cuBLAS and cuBLASLt
defaults), so no earlier session measured the other algorithms. This asks cuBLASLt's
heuristic for up to `--candidates` algorithms per shape, adds split-K variants of each
(`cublasLtMatmulAlgoCheck` decides which are valid), and times every one that computes the
same product, inside a CUDA graph over one distinct weight per layer (more bytes than L2
holds, as in a decode step).

cuBLASLt is reached through octavo's ctypes binding (octavo/kernels/cublaslt.py), to the
libcublasLt that torch itself loaded. (Session 15's results came from this probe's first
version, commit 12e10ce, with a binding of its own; the candidates are the same.)

    PYTHONPATH=. python benchmarks/cublaslt_probe.py [--models qwen3-0.6b,qwen3-8b] [--json F]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.gemm_small import SHAPES  # (name, N, K): the four projections of a layer
from benchmarks.gemm_splitk import graph_us
from octavo.entrypoints.bench_floor import measure_ceilings
from octavo.kernels import cublaslt

LAYERS = {"qwen3-0.6b": 28, "qwen3-8b": 36}
ROWS = [1, 8, 32, 64, 128, 256]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    copy = measure_ceilings(torch.bfloat16).copy_bytes_per_s
    rows_m = [int(r) for r in args.rows.split(",")]
    rows = []
    print(f"{'model':<11}{'proj':<8}{'M':>4}{'floor':>7}{'torch':>8}{'lt #0':>8}{'best':>8}"
          f"{'tried':>6}  best config")  # fmt: skip
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
                  for _ in range(LAYERS[model])]  # fmt: skip
            for m in rows_m:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, ws[0]).float()
                torch_us = graph_us([lambda w=w: F.linear(x, w) for w in ws])  # noqa: B023
                gemm = cublaslt.LtGemm(m, n, k, torch.bfloat16)
                timed = []
                for rank, algo in enumerate(gemm.candidates(args.candidates)):
                    cfg = cublaslt.describe(algo)
                    err = ((gemm(x, ws[0], algo).float() - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        print(f"  {name} M={m} {cfg}: rel err {err:.3g}, skipped")
                        continue
                    t = graph_us([lambda w=w, a=algo: gemm(x, w, a) for w in ws])  # noqa: B023
                    timed.append({"rank": rank, "us": t, **cfg})
                first = timed[0]["us"] if timed else float("nan")
                best = min(timed, key=lambda r: r["us"]) if timed else {"us": float("nan")}
                floor = n * k * 2 / copy * 1e6
                rows.append({"model": model, "proj": name, "m": m, "n": n, "k": k,
                             "floor_us": floor, "torch_us": torch_us, "lt_first_us": first,
                             "best": best, "tried": timed})  # fmt: skip
                cfg_s = " ".join(f"{a}={b}" for a, b in best.items() if a != "us")
                print(f"{model:<11}{name:<8}{m:>4}{floor:>7.1f}{torch_us:>8.1f}{first:>8.1f}"
                      f"{best['us']:>8.1f}{len(timed):>6}  {cfg_s}", flush=True)  # fmt: skip
            del ws
    print("a layer's four projections, us: floor / torch / best cuBLASLt algorithm")
    for model in args.models.split(","):
        for m in rows_m:
            sel = [r for r in rows if r["model"] == model and r["m"] == m]
            f_, t_ = (sum(r[key] for r in sel) for key in ("floor_us", "torch_us"))
            b_ = sum(r["best"]["us"] for r in sel)
            print(f"{model} M={m:>3}: {f_:7.1f} / {t_:7.1f} / {b_:7.1f}  "
                  f"({(t_ - b_) * LAYERS[model] / 1e3:.3f} ms a step)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bytes_per_s": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
