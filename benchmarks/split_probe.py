"""Decode attention at small batches, inside a CUDA graph: the time per layer for each
number of KV splits (`overlap_probe.Probe`'s fused kernel, all layers in one graph).

At batch 1-32 the engine's decode steps are latency-bound, and up to ~128 partly so; the
split count decides how many programs run and whether a second (reduce) kernel follows.
`choose_num_splits` picks it from the batch and the block-table width (max_model_len 4096
here, as the benchmarks run, or more for the long cases).

    PYTHONPATH=. python benchmarks/split_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from benchmarks.overlap_probe import Probe, probe_cases, time_graph
from octavo.kernels.decode_attention import choose_num_splits, num_sms

CASES = [("qwen3-8b", 1, 768), ("qwen3-8b", 1, 8192), ("qwen3-0.6b", 1, 1024),
         ("qwen3-0.6b", 1, 8192), ("qwen3-0.6b", 4, 1024), ("qwen3-0.6b", 16, 1024),
         ("qwen3-0.6b", 20, 1024), ("qwen3-0.6b", 24, 1024), ("qwen3-0.6b", 28, 1024),
         ("qwen3-0.6b", 32, 1024), ("qwen3-0.6b", 48, 1024), ("qwen3-0.6b", 64, 1024),
         ("qwen3-0.6b", 96, 1024), ("qwen3-0.6b", 128, 1024), ("qwen3-8b", 64, 1024),
         ("qwen3-0.6b", 28, 4096), ("qwen3-0.6b", 32, 4096), ("qwen3-0.6b", 40, 4096),
         ("qwen3-0.6b", 28, 8192), ("qwen3-0.6b", 32, 8192), ("qwen3-8b", 28, 4096)]  # fmt: skip
SPLITS = (1, 2, 4, 8, 16, 32)
MAX_MODEL_LEN = 4096  # or the longest context a case's sequences reach, if more


def measure(p: Probe) -> dict:
    row = {"engine_splits": choose_num_splits(
        p.batch, p.s["kv_heads"], max(MAX_MODEL_LEN, p.context * 3 // 2), num_sms(p.x.device)
    )}  # fmt: skip
    for splits in SPLITS:
        p.num_splits = splits
        row[f"us_{splits}"] = time_graph(p.attn_only, 30) * 1e3 / p.s["layers"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = probe_cases(CASES, measure)
    print(f"\n{'model':11} {'batch':>5} {'ctx':>5} {'engine':>6} | "
          + " ".join(f"{f'{s} split':>8}" for s in SPLITS) + "   us per layer")  # fmt: skip
    for r in rows:
        cells = " ".join(f"{r[f'us_{s}']:8.1f}" for s in SPLITS)
        print(f"{r['model']:11} {r['batch']:5} {r['context']:5} {r['engine_splits']:6} | {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
