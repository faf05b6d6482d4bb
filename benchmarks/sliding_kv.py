"""KV memory of a long-context workload on a model with full and sliding layers (Gemma 3):
what the blocks in use took at their peak, and what they would take if every layer kept every
block (no pool of the sliding layers' own, nothing given back).

    python benchmarks/sliding_kv.py [--model gemma-3-1b] [--requests 32] [--prompt-len 4096]
        [--output-len 256] [--json out.json]

Dummy weights; random prompt token ids; greedy outputs of exactly --output-len tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from octavo import LLM, SamplingParams
from octavo.runner.kv_setup import kv_bytes_per_block, sliding_layers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma-3-1b")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    llm = LLM(args.model, load_format="dummy", max_model_len=args.prompt_len + args.output_len)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randint(10, 30000) for _ in range(args.prompt_len)]}
        for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.get_stats()
    runner = llm.engine.runner
    kinds = sliding_layers(runner.hf_config)
    size, dtype = llm.engine.cache_config.block_size, runner.kv_cache_dtype
    full_bytes = kv_bytes_per_block(runner.hf_config, size, dtype, kinds.count(False))
    sliding_bytes = kv_bytes_per_block(runner.hf_config, size, dtype, kinds.count(True))
    peak_full = stats["kv_blocks_peak_used"]
    peak_sliding = stats.get("kv_sliding_blocks_peak_used", peak_full)
    held = peak_full * full_bytes + peak_sliding * sliding_bytes
    whole = peak_full * (full_bytes + sliding_bytes)  # every layer keeping every block
    budget = stats["kv_blocks_total"] * full_bytes
    budget += stats.get("kv_sliding_blocks_total", stats["kv_blocks_total"]) * sliding_bytes
    result = {
        "model": args.model,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "seconds": round(seconds, 2),
        "layers_full_sliding": [kinds.count(False), kinds.count(True)],
        "peak_blocks_full_sliding": [peak_full, peak_sliding],
        "peak_kv_bytes": held,
        "peak_kv_bytes_keeping_every_block": whole,
        # Tokens the same KV budget holds on every layer: with the split, the full layers'
        # pool bounds it; keeping every block, the budget over every layer's block.
        "tokens_the_budget_holds": stats["kv_blocks_total"] * size,
        "tokens_the_budget_holds_keeping_every_block": budget // (full_bytes + sliding_bytes)
        * size,
    }
    print(json.dumps(result, indent=1))
    print(
        f"{args.model}: {args.requests} x ({args.prompt_len} + {args.output_len}) tokens in "
        f"{seconds:.1f} s; KV at its peak {held / 2**30:.2f} GiB, "
        f"{whole / 2**30:.2f} GiB if every layer kept every block ({whole / held:.1f}x); "
        f"the budget holds {result['tokens_the_budget_holds']:,} tokens, "
        f"{result['tokens_the_budget_holds_keeping_every_block']:,} keeping every block"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
