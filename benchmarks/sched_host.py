"""The scheduler's host time a decode step, alone: `Scheduler.schedule` and `update` for 256
running requests of the nano-vllm workload's lengths (16-token blocks, prefix caching on),
with one KV pool and with the two pools of a model with sliding and full layers (Gemma 3:
core/hybrid_kv.py). On a GPU a step whose host work outlasts its device work leaves the device
waiting (step_timeline.py); this isolates the scheduler's share of that host work, on any
machine.

    python benchmarks/sched_host.py [--steps 400] [--seqs 256] [--repeats 3]

Prints the least over repeats of the mean ms a step (the machine's noise only adds), after the first 20 steps (the prompts'
prefill).
"""

from __future__ import annotations

import argparse
import random
import time

from octavo.config import SchedulerConfig
from octavo.core.hybrid_kv import HybridKVCacheManager, sliding_pool_blocks
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.request import Request
from octavo.core.scheduler import Scheduler
from octavo.sampling_params import SamplingParams

BLOCK_SIZE, NUM_BLOCKS, WINDOW = 16, 40_000, 512


def mean_step_ms(two_pools: bool, steps: int, seqs: int) -> float:
    rng = random.Random(0)
    if two_pools:
        sliding = sliding_pool_blocks(NUM_BLOCKS, WINDOW, BLOCK_SIZE, seqs, 16384)
        kv = HybridKVCacheManager(NUM_BLOCKS, sliding, BLOCK_SIZE, True, WINDOW)
    else:
        kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, True)
    scheduler = Scheduler(SchedulerConfig(seqs, 16384, 4096), kv, eos_token_ids=[])
    for i in range(seqs):
        prompt = [rng.randrange(1, 30_000) for _ in range(rng.randint(100, 1024))]
        scheduler.add_request(Request(str(i), prompt, SamplingParams(max_tokens=steps + 100)))
    total = 0.0
    for step in range(steps):
        start = time.perf_counter()
        so = scheduler.schedule()
        scheduler.update(so, {s.request_id: [5] for s in so.scheduled if s.sample})
        if step >= 20:
            total += time.perf_counter() - start
    return 1e3 * total / (steps - 20)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for two_pools in (False, True):
        times = [mean_step_ms(two_pools, args.steps, args.seqs) for _ in range(args.repeats)]
        name = "two pools (sliding + full)" if two_pools else "one pool"
        print(f"{name:28} {min(times):.3f} ms a step at {args.seqs} sequences")


if __name__ == "__main__":
    main()
