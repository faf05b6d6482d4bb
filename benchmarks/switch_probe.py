"""One switch off and on in a decode step's layers, inside a CUDA graph:

    --switch pdl    programmatic dependent launch (octavo/kernels/pdl.py)
    --switch norms  the two RMSNorm kernels of each layer; off skips them, an upper bound on
                    what folding them into their neighbours could save

The layers are `overlap_probe.Probe`'s: the engine's kernels over random weights, one graph
for a whole step's layers (no LM head, no sampler), and for the rest without attention. Each
case is timed off, on, off, on, so that drift shows up as a difference between the two runs
of one setting.

    PYTHONPATH=. python benchmarks/switch_probe.py --switch pdl|norms [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from benchmarks.overlap_probe import Probe, probe_cases, time_graph
from octavo.kernels import pdl

CASES = [("qwen3-0.6b", 256, 1024), ("qwen3-0.6b", 64, 1024), ("qwen3-0.6b", 8, 1024),
         ("qwen3-8b", 1, 768), ("qwen3-8b", 64, 1024)]  # fmt: skip
SWITCHES = {
    "pdl": lambda p, on: setattr(pdl, "ENABLED", on),
    "norms": lambda p, on: setattr(p, "norms", on),
}


def measure(p: Probe, switch, replays: int) -> dict:
    row = {}
    for rep, on in enumerate((False, True, False, True)):
        switch(p, on)
        tag = f"{'on' if on else 'off'}{rep // 2}"
        row[f"step_{tag}"] = time_graph(lambda: p.forward(slice(None)), replays)
        row[f"rest_{tag}"] = time_graph(p.rest_only, replays)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    ap.add_argument("--json")
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args()
    rows = probe_cases(CASES, lambda p: measure(p, SWITCHES[args.switch], args.replays))
    print(f"\n{args.switch} off / on")
    print(f"{'model':11} {'batch':>5} {'ctx':>5} | {'step off':>17} {'step on':>17} | "
          f"{'rest off':>17} {'rest on':>17}   ms per step (two runs each)")  # fmt: skip
    for r in rows:
        cells = [f"{r[f'{k}0']:7.3f} {r[f'{k}1']:7.3f}  " for k in
                 ("step_off", "step_on", "rest_off", "rest_on")]  # fmt: skip
        print(f"{r['model']:11} {r['batch']:5} {r['context']:5} | {cells[0]} {cells[1]}| "
              f"{cells[2]} {cells[3]}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
