"""What each CUDA graph of the mixed-step ladder costs at start-up, and what it replays in.

    PYTHONPATH=. python benchmarks/capture_probe.py --model qwen3-8b [--json out.json]

Builds the engine with decode graphs only (cuda_graph_max_tokens=0), then captures the mixed
shapes of the default ladder (up to 512 tokens) into the same pool as the engine does, timing
per shape: the first eager run (the warm-up CudaGraphRunner.capture does), a second eager run,
the capture, and one replay to completion (padding only: every sequence empty).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from octavo import LLM
from octavo.runner.cuda_graph import CudaGraphRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(
        args.model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=2048,
        cuda_graph_max_tokens=0,
    )  # fmt: skip
    runner = llm.engine.runner
    graphs = CudaGraphRunner(runner.model, runner.inputs, 256, 512)
    graphs.pool = runner.graph_runner.pool
    rows = []
    with torch.inference_mode():
        for shape in [s for s in graphs.shapes() if not s.decode]:
            graphs._fill_padding(shape)
            tokens = shape.num_tokens
            inputs = (runner.inputs.input_ids[:tokens], runner.inputs.positions[:tokens])
            md = graphs._metadata(shape)
            marks = [time.perf_counter()]
            for _ in range(2):
                runner.model(*inputs, md)
                torch.cuda.synchronize()
                marks.append(time.perf_counter())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=graphs.pool):
                runner.model(*inputs, md)
            marks.append(time.perf_counter())
            graph.replay()
            torch.cuda.synchronize()
            marks.append(time.perf_counter())
            ms = [1e3 * (b - a) for a, b in itertools.pairwise(marks)]
            rows.append({"tokens": tokens, "seqs": shape.num_seqs, "first_ms": ms[0],
                         "again_ms": ms[1], "capture_ms": ms[2], "replay_ms": ms[3]})  # fmt: skip
    print(f"{args.model}: {'tokens':>7}{'first':>8}{'again':>8}{'capture':>9}{'replay':>8}  (ms)")
    for r in rows:
        print(
            f"{'':>{len(args.model) + 2}}{r['tokens']:>7}{r['first_ms']:>8.1f}{r['again_ms']:>8.1f}"
            f"{r['capture_ms']:>9.1f}{r['replay_ms']:>8.2f}"
        )
    total = sum(r["first_ms"] + r["capture_ms"] for r in rows) / 1e3
    print(f"{len(rows)} shapes: warm-up run + capture {total:.2f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "shapes": rows}, f, indent=2)


if __name__ == "__main__":
    main()
