"""Single-request latency (BENCHMARKS.md section 2): a 512-token prompt, 256 greedy output
tokens; time per output token against the weight-read floor W / B.

    python benchmarks/latency.py --model qwen3-8b [--enforce-eager] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time

import torch

from octavo import LLM, SamplingParams
from octavo.entrypoints.bench_floor import measure_ceilings, weights_read_per_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then decode once more under cProfile and print where the host's time goes",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    llm = LLM(
        args.model,
        load_format="dummy",
        max_model_len=2048,
        max_num_seqs=8,
        enforce_eager=args.enforce_eager,
    )
    rng = random.Random(0)
    prompt = [rng.randint(0, 10000) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm up on other tokens of the same length: with the timed prompt itself, the prefix
    # cache would answer all but its last token and TTFT would not measure a prefill.
    warm = [rng.randint(10_001, 20_000) for _ in range(args.prompt_len)]
    llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)

    engine = llm.engine
    torch.cuda.synchronize()
    start = time.perf_counter()
    request = engine.add_request(prompt, params)
    first = None
    while not request.is_finished:
        engine.step()
        if first is None and request.output_token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    tpot = (end - first) / (args.output_len - 1)

    runner = engine.runner
    params_ = weights_read_per_step(runner.model)
    weight_bytes = sum(p.numel() * p.element_size() for p in params_)
    ceilings = measure_ceilings(runner.dtype)
    floor = weight_bytes / ceilings.copy_bytes_per_s
    report = {
        "model": args.model,
        "ttft_s": first - start,
        "tpot_s": tpot,
        "weight_bytes": weight_bytes,
        "copy_bytes_per_s": ceilings.copy_bytes_per_s,
        "floor_s_per_token": floor,
        "tpot_over_floor": tpot / floor,
        "cuda_graphs": runner.graph_runner is not None,
    }
    print(
        f"{args.model}: TTFT {report['ttft_s'] * 1e3:.1f} ms, TPOT {tpot * 1e3:.2f} ms, "
        f"floor {floor * 1e3:.2f} ms/token (W {weight_bytes / 1e9:.2f} GB, "
        f"B {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s): {tpot / floor:.2f}x the floor"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.profile:
        profile_decode(
            engine, [rng.randint(20_001, 30_000) for _ in range(args.prompt_len)], params
        )


def profile_decode(engine, prompt: list[int], params: SamplingParams) -> None:
    """The same single-request decode under cProfile (after the timed run, so it is not slowed)."""
    import cProfile
    import pstats

    request = engine.add_request(prompt, params)
    engine.step()  # the prefill, outside the profile
    profiler = cProfile.Profile()
    steps = 0
    start = time.perf_counter()
    profiler.enable()
    while not request.is_finished:
        engine.step()
        steps += 1
    profiler.disable()
    print(
        f"under cProfile: {steps} steps, {(time.perf_counter() - start) / steps * 1e3:.2f} ms a step"
    )
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
