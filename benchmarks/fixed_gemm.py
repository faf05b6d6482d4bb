"""fixed_gemm (deterministic mode's products) against cuBLAS (F.linear) at Qwen3-8B's
projection shapes, with each shape's floor: max(weight + activation bytes / bandwidth,
flops / peak). With --sweep, every candidate tile too, and the fastest per row count (all
give the same bits: tests/gpu/test_fixed_order.py).

    python benchmarks/fixed_gemm.py [--sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from octavo.kernels.fixed_gemm import fixed_gemm, tile_config

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "lm_head": (151936, 4096)}  # fmt: skip
ROWS = [1, 8, 32, 64, 128, 256, 512, 2048, 8192]
CANDIDATES = [
    (64, bn, bk, 4, st) for bn in (16, 32, 64, 128) for bk in (64, 128, 256) for st in (3, 4, 5)
] + [(128, bn, 64, 8, st) for bn in (128, 256) for st in (3, 4)]
BANDWIDTH, PEAK = 3.35e12, 989e12  # H100 SXM: HBM3 bytes/s, dense bf16 flop/s


def _us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=30) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows_out = []
    print(
        f"{'shape':8} {'rows':>5} {'floor':>8} {'cuBLAS':>8} {'fixed':>8} "
        f"{'fixed/cuBLAS':>12}"
    )
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            floor = max(2 * (n * k + m * k + m * n) / BANDWIDTH, 2 * m * n * k / PEAK) * 1e6
            ref = _us(lambda x=x, w=w: F.linear(x, w))
            ours = _us(lambda x=x, w=w: fixed_gemm(x, w))
            row = {"shape": name, "n": n, "k": k, "rows": m, "floor_us": floor,
                   "cublas_us": ref, "fixed_us": ours,
                   "tile": tile_config(m, n, k)}  # fmt: skip
            if args.sweep:
                best = None
                for bm, bn, bk, warps, stages in CANDIDATES:
                    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                           "num_stages": stages}  # fmt: skip
                    try:
                        t = _us(lambda x=x, w=w, cfg=cfg: fixed_gemm(x, w, config=cfg))
                    except Exception as e:  # noqa: BLE001 (shared memory: a tile too large)
                        print(f"  {cfg}: {type(e).__name__}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                row["best_us"], row["best_tile"] = best
            rows_out.append(row)
            extra = f"  best {row['best_us']:.1f} {row['best_tile']}" if args.sweep else ""
            print(
                f"{name:8} {m:>5} {floor:8.1f} {ref:8.1f} {ours:8.1f} "
                f"{ours / ref:12.2f}{extra}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
