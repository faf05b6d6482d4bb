"""Decode attention at small batches, inside a CUDA graph: the time per layer for each
number of KV splits (`overlap_probe.Probe`'s fused kernel, all layers in one graph).

At batch 1-32 the engine's decode steps are latency-bound, and up to ~128 partly so; the
split count decides how many programs run and whether a second (reduce) kernel follows.
`choose_num_splits` picks it from the batch and the block-table width (max_model_len 4096
here, as the benchmarks run, or more for the long cases). The sequences run longest first,
as the engine passes them; a last column runs one split without that order. `mean` is the
drawn contexts' mean (they are uniform in [ctx/2, 3 ctx/2]).

NOTE: the probe times attention alone, every layer's back to back in one graph. In session
17 a split count it measured 6-11% faster (more splits at 2k-8k contexts and batches 8-48)
changed a step by -6% to +1% end to end with lengths spread as here, and lost 1-11% with
equal lengths (docs/PERFORMANCE.md). The block layout did not explain it: `--layout runs`
(each sequence's blocks neighbours, as the engine's pool hands them out) agreed with the
default random permutation within 3%. Confirm a count end to end before adopting it.

    PYTHONPATH=. python benchmarks/split_probe.py [--json out.json] [--layout runs] [--long]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.overlap_probe import Probe, probe_cases, time_graph
from octavo.kernels.decode_attention import choose_num_splits, num_sms

CASES = [("qwen3-8b", 1, 768), ("qwen3-8b", 1, 8192), ("qwen3-0.6b", 1, 256),
         ("qwen3-0.6b", 1, 1024), ("qwen3-0.6b", 1, 2048), ("qwen3-0.6b", 1, 4096),
         ("qwen3-0.6b", 1, 8192), ("qwen3-0.6b", 2, 8192), ("qwen3-0.6b", 4, 4096),
         ("qwen3-0.6b", 4, 1024), ("qwen3-0.6b", 8, 1024), ("qwen3-0.6b", 8, 8192),
         ("qwen3-0.6b", 16, 1024), ("qwen3-0.6b", 16, 4096), ("qwen3-0.6b", 20, 1024),
         ("qwen3-0.6b", 24, 1024), ("qwen3-0.6b", 28, 1024), ("qwen3-0.6b", 32, 1024),
         ("qwen3-0.6b", 32, 2048), ("qwen3-0.6b", 48, 1024), ("qwen3-0.6b", 64, 1024),
         ("qwen3-0.6b", 96, 1024), ("qwen3-0.6b", 128, 1024), ("qwen3-8b", 64, 1024),
         ("qwen3-0.6b", 28, 4096), ("qwen3-0.6b", 32, 4096), ("qwen3-0.6b", 40, 4096),
         ("qwen3-0.6b", 48, 4096), ("qwen3-0.6b", 64, 4096), ("qwen3-0.6b", 96, 4096),
         ("qwen3-0.6b", 128, 2048), ("qwen3-0.6b", 128, 4096), ("qwen3-0.6b", 256, 2048),
         ("qwen3-0.6b", 28, 8192), ("qwen3-0.6b", 32, 8192), ("qwen3-0.6b", 64, 8192),
         ("qwen3-8b", 28, 4096), ("qwen3-8b", 32, 8192), ("qwen3-8b", 96, 2048)]  # fmt: skip
SPLITS = (1, 2, 4, 8, 16, 32, 64)
MAX_MODEL_LEN = 4096  # or the longest context a case's sequences reach, if more


def lay_out_in_runs(p: Probe) -> None:
    """Gives each sequence one run of neighbouring blocks, as a fresh block pool does (the
    probe's default is a random permutation of the blocks)."""
    batch, width = p.block_tables.shape
    blocks = torch.arange(batch * width, dtype=torch.int32, device=p.block_tables.device) + 1
    p.set_block_tables(blocks.view(batch, width))


def measure(p: Probe, layout: str = "random") -> dict:
    if layout == "runs":
        lay_out_in_runs(p)
    mean = int(p.seq_lens.float().mean())
    shape = (p.batch, p.s["kv_heads"], max(MAX_MODEL_LEN, p.context * 3 // 2), num_sms(p.x.device))
    row = {"mean_context": mean, "engine_splits": choose_num_splits(*shape)}
    for splits in SPLITS:
        p.num_splits = splits
        row[f"us_{splits}"] = time_graph(p.attn_only, 30) * 1e3 / p.s["layers"]
    p.ordered, p.num_splits = False, 1  # what the longest-first order buys
    row["us_1_unordered"] = time_graph(p.attn_only, 30) * 1e3 / p.s["layers"]
    p.ordered = True
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--layout", choices=["random", "runs"], default="random")
    ap.add_argument("--long", action="store_true", help="only the 0.6B's 2k-8k cases at 8-64")
    args = ap.parse_args()
    cases = CASES
    if args.long:
        cases = [c for c in CASES if c[0] == "qwen3-0.6b" and c[2] >= 2048 and 8 <= c[1] <= 64]
    rows = probe_cases(cases, lambda p: measure(p, args.layout))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    head = " ".join(f"{f'{s} split':>8}" for s in SPLITS) + f" {'1,unord':>8}"
    print(
        f"\n{'model':11} {'batch':>5} {'ctx':>5} {'mean':>5} {'engine':>6} | {head}   us per layer"
    )
    for r in rows:
        cells = " ".join(f"{r[f'us_{s}']:8.1f}" for s in SPLITS) + f" {r['us_1_unordered']:8.1f}"
        print(f"{r['model']:11} {r['batch']:5} {r['context']:5} {r['mean_context']:5} "
              f"{r['engine_splits']:6} | {cells}")  # fmt: skip
    over = [r[f"us_{r['engine_splits']}"] / min(r[f"us_{s}"] for s in SPLITS) - 1 for r in rows]
    print(f"engine's count: {sum(over) / len(over):+.1%} over the best on average, "
          f"{max(over):+.1%} at worst")  # fmt: skip


if __name__ == "__main__":
    main()
