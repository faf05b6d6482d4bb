"""Where a decode-heavy step's wall time goes on the GPU: cProfile over the nano-vllm prompts
with shorter outputs (host-side Python shows as tottime; GPU waits show in the sync call).

    PYTHONPATH=. python benchmarks/profile_steps.py [--model qwen3-0.6b] [--max-tokens 200]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from octavo import LLM, SamplingParams
from octavo.entrypoints.bench_throughput import nanovllm_workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=4096)
    w = nanovllm_workload()
    prompts = [{"prompt_token_ids": p} for p in w.prompts]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.max_tokens)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profile.disable()
    seconds = time.perf_counter() - start
    steps = llm.get_stats()["num_steps"]
    print(f"{seconds:.2f} s, {steps} steps in all, {256 * args.max_tokens / seconds:.0f} tok/s")
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
