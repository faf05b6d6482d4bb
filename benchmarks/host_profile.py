"""Where the host's time goes in the nano-vllm workload: the run under cProfile, the
functions with the most cumulative time first. On a GPU a decode step whose host work takes
longer than its device work leaves the device waiting (step_timeline.py's "host wait" near
zero); this says which Python does it.

    python benchmarks/host_profile.py [--model gemma-3-1b] [--out host.prof] [--top 40]

Dummy weights, the workload's settings as `octavo bench throughput --workload nanovllm`,
one short warm-up; the profiled run uses other prompt tokens of the same lengths, so the
prefix cache holds none of them. cProfile slows the Python it times about 2-3x.
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
    parser.add_argument("--out", default=None, help="write the cProfile stats here")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=16384)
    w = nanovllm_workload()
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in w.max_tokens]
    warm = [{"prompt_token_ids": p} for p in w.prompts[:4]]
    llm.generate(warm, params[:4], use_tqdm=False)
    fresh = [{"prompt_token_ids": [t + 10_001 for t in p]} for p in w.prompts]
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(fresh, params, use_tqdm=False)
    profiler.disable()
    print(f"{args.model}: the profiled run took {time.perf_counter() - start:.2f} s")
    if args.out:
        profiler.dump_stats(args.out)
    pstats.Stats(profiler).sort_stats("cumtime").print_stats(args.top)


if __name__ == "__main__":
    main()
