"""Where a prefill step's host time goes, and whether a token count seen for the first time
stalls it.

    PYTHONPATH=. python benchmarks/prefill_host_probe.py [--model qwen3-0.6b] [--json out.json]

Settings as `octavo bench throughput --workload nanovllm` (dummy weights, 16,384 batched
tokens), with the same warm-up generate. Then one prefill step at a time, each from an empty
device queue: prompts of at most 1,024 fresh random tokens adding up to N, max_tokens 1. Each N
runs twice, so the first row of a pair shows what a token count costs the first time (cuBLAS
picking kernels for a new shape, CUDA loading their modules) and the second what it costs
after. Printed per step: the host's time in schedule, input building, the forward's launches,
the LM head and sampler launches, and the device time until the sampled tokens are back.
Last, the launch of a step with a new token count (5,555), then of one with the same count,
each under cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import time
from collections import defaultdict

import torch

from octavo import LLM, SamplingParams

COUNTS = [16384, 16384, 12823, 12823, 9001, 9001, 3001, 3001, 777, 777]


def timed(target, name: str, totals: dict[str, float]) -> None:
    """Wraps target.name so that its host seconds add up in totals[name]."""
    real = getattr(target, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    setattr(target, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--json", default=None)
    parser.add_argument("--counts", type=int, nargs="+", default=COUNTS)
    parser.add_argument("--load-format", default="dummy")
    args = parser.parse_args()
    start = time.perf_counter()
    llm = LLM(
        args.model, load_format=args.load_format, max_model_len=4096, max_num_batched_tokens=16384
    )
    print(f"LLM(...) took {time.perf_counter() - start:.1f} s")
    engine = llm.engine
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    runner = engine.runner
    totals: dict[str, float] = defaultdict(float)
    timed(engine.scheduler, "schedule", totals)
    timed(runner.inputs, "build", totals)
    timed(runner, "_forward", totals)
    timed(runner.model, "compute_logits", totals)
    timed(runner, "sampler", totals)
    rng = random.Random(1)
    rows = []
    print("tokens  prompts  schedule  build  forward  lm_head  sampler  host ms  device ms")
    for n in args.counts:
        lens: list[int] = []
        while sum(lens) < n:
            lens.append(min(rng.randint(100, 1024), n - sum(lens)))
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        for length in lens:
            engine.add_request([rng.randrange(10000) for _ in range(length)], params)
        totals.clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()  # schedules and launches; async scheduling returns before the device
        launched = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        done = time.perf_counter()
        row = {
            "tokens": n,
            "prompts": len(lens),
            **{k: v * 1e3 for k, v in totals.items()},
            "host_ms": (launched - start) * 1e3,
            "device_ms": (done - start) * 1e3,
        }
        rows.append(row)
        print(
            f"{n:6d}  {len(lens):7d}  {row['schedule']:8.2f}  {row['build']:5.2f}  "
            f"{row['_forward']:7.2f}  {row['compute_logits']:7.2f}  {row['sampler']:7.2f}  "
            f"{row['host_ms']:7.2f}  {row['device_ms']:9.2f}"
        )
    profiles = {}
    for label in ("first", "second"):  # a token count not seen before, then again
        lens = [1000] * 5 + [555]
        for length in lens:
            engine.add_request([rng.randrange(10000) for _ in range(length)], params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        engine.step()
        prof.disable()
        while engine.has_unfinished_requests():
            engine.step()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        profiles[label] = text.getvalue()
        print(f"\n{sum(lens)} tokens, {label} time, launch under cProfile:")
        print("\n".join(profiles[label].splitlines()[:30]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rows": rows, "profiles": profiles}, f, indent=1)


if __name__ == "__main__":
    main()
