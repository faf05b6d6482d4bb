"""What the RMSNorm kernels cost a decode step: `overlap_probe.Probe`'s layers in one CUDA
graph, with the two norms of each layer and without them (the rest unchanged). An upper bound
on what folding the norms into neighbouring kernels could save.

    PYTHONPATH=. python benchmarks/norm_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from benchmarks.overlap_probe import Probe, probe_cases, time_graph

CASES = [("qwen3-0.6b", 256, 1024), ("qwen3-0.6b", 64, 1024), ("qwen3-0.6b", 8, 1024),
         ("qwen3-8b", 1, 768)]  # fmt: skip


def measure(p: Probe) -> dict:
    row = {}
    for rep, norms in enumerate((True, False, True, False)):
        p.norms = norms
        tag = f"{'with' if norms else 'without'}{rep // 2}"
        row[f"step_{tag}"] = time_graph(lambda: p.forward(slice(None)), 30)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = probe_cases(CASES, measure)
    print(
        f"\n{'model':11} {'batch':>5} {'ctx':>5} | {'with norms':>15} | {'without':>15}   ms/step"
    )
    for r in rows:
        w = f"{r['step_with0']:7.3f} {r['step_with1']:7.3f}"
        wo = f"{r['step_without0']:7.3f} {r['step_without1']:7.3f}"
        print(f"{r['model']:11} {r['batch']:5} {r['context']:5} | {w} | {wo}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
