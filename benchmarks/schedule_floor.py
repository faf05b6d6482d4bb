"""The schedule octavo's scheduler gives the nano-vllm workload when the KV cache holds only
so many tokens, and that schedule's floor, on the CPU in a second or two (no model runs:
every step samples a token for each request that asks, and requests stop at max_tokens).

A step's floor is run_profile.py's: the weights its tokens reach or its FLOPs, whichever
takes longer, plus its KV reads. When the cache cannot hold every request at once, the
scheduler admits them in turn (first come, first served) and preempts the newest when the
running ones outgrow it; the schedule then has more steps, each reading the weights again,
and recomputes the preempted requests' tokens. The workload floor assumes a cache that
holds every request, so its share of this schedule's floor is the most a run with this
cache can reach, whatever its kernels.

    python benchmarks/schedule_floor.py --model qwen3-30b-a3b --kv-tokens 126336 \
        [--copy-tb-s 3.03] [--matmul-tflop-s 758] [--longest-first]

--kv-tokens is what the engine reports (run_profile.py prints it); the rates default to an
H100's measured ones. --longest-first submits the requests longest max_tokens first.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from octavo.checkpoint.hf_config import load_hf_config
from octavo.config import SchedulerConfig
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.request import Request
from octavo.core.scheduler import Scheduler
from octavo.entrypoints.bench_floor import DeviceCeilings, meta_model, serial_work, workload_floor
from octavo.entrypoints.bench_throughput import nanovllm_workload
from octavo.sampling_params import SamplingParams

CONFIGS = Path(__file__).resolve().parents[1] / "octavo" / "configs"


def schedule(prompts, max_tokens, kv_tokens: int, block_size: int = 16) -> tuple[list, int]:
    """(each step's (tokens, positions attended), preemptions) under nano-vllm's budgets."""
    kv = KVCacheManager(kv_tokens // block_size, block_size, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(256, 16384, 4096), kv)
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        sched.add_request(Request(str(i), prompt, SamplingParams(max_tokens=m, ignore_eos=True)))
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        attended = sum(s.num_computed_tokens + len(s.token_ids) for s in out.scheduled)
        steps.append((out.num_batched_tokens, attended))
        updated = sched.update(out, {s.request_id: [7] for s in out.scheduled if s.sample})
        for request, status in zip(updated, sched.stops.check_tokens(updated), strict=True):
            if status is not None:
                sched.finish_request(request.request_id, status)
    return steps, sched.num_preemptions


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--kv-tokens", type=int, required=True)
    parser.add_argument("--copy-tb-s", type=float, default=3.03)
    parser.add_argument("--matmul-tflop-s", type=float, default=758.0)
    parser.add_argument("--longest-first", action="store_true")
    args = parser.parse_args()
    w = nanovllm_workload()
    pairs = list(zip(w.prompts, w.max_tokens, strict=True))
    if args.longest_first:
        pairs.sort(key=lambda p: -p[1])
    prompts, max_tokens = [p for p, _ in pairs], [m for _, m in pairs]
    cfg = load_hf_config(str(CONFIGS / args.model))
    model = meta_model(cfg, torch.bfloat16)
    lens = [len(p) for p in prompts]
    work = serial_work(model, cfg, torch.bfloat16, lens, max_tokens)
    ceilings = DeviceCeilings(args.copy_tb_s * 1e12, args.matmul_tflop_s * 1e12)
    workload_s = workload_floor(model, cfg, torch.bfloat16, lens, max_tokens, ceilings).seconds

    def floor(steps) -> float:
        return sum(
            work.gemm_seconds(tokens, ceilings)
            + attended * work.kv_bytes_per_token / ceilings.copy_bytes_per_s
            for tokens, attended in steps
        )

    whole, _ = schedule(prompts, max_tokens, 1 << 30)
    steps, preemptions = schedule(prompts, max_tokens, args.kv_tokens)
    ideal = sum(lens) + sum(max_tokens) - len(lens)  # a request never feeds its last token
    computed = sum(tokens for tokens, _ in steps)
    print(f"{args.model}, nano-vllm workload{', longest first' if args.longest_first else ''}:")
    print(f"  a cache for every request: {len(whole)} steps, floor {floor(whole):.2f} s")
    print(f"  {args.kv_tokens} tokens of cache: {len(steps)} steps, {preemptions} preemptions, "
          f"{computed - ideal} tokens recomputed, floor {floor(steps):.2f} s "
          f"({floor(whole) / floor(steps):.1%} of it is the first's floor)")  # fmt: skip
    print(f"  the workload floor, {workload_s:.2f} s, is {workload_s / floor(steps):.1%} of the "
          "second's: the most a run with this cache can reach")  # fmt: skip


if __name__ == "__main__":
    main()
