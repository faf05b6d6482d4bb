"""Decode at long contexts, end to end: `batch` requests with `prompt`-token prompts decode
together; the time per step, against its floor (the step's KV reads and weight reads at the
copy bandwidth), with the KV split count following the step's mean context (the engine's
rule) and with the shape-only count it had before (the same graphs, the context ignored),
alternated in one process.

    python benchmarks/long_decode.py --model qwen3-0.6b [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from octavo import LLM, SamplingParams
from octavo.entrypoints.bench_floor import measure_ceilings, weights_read_per_step
from octavo.kernels.decode_splits import DecodeSplits

CASES = {  # batch, prompt tokens: the rule's changes (2k+ contexts, a quarter to 3 waves)
    "qwen3-0.6b": [
        (8, 8000),
        (16, 4000),
        (32, 8000),
        (40, 4000),
        (48, 3000),
        (2, 8000),
        (64, 4000),
    ],
    "qwen3-8b": [(8, 8000), (16, 4000), (40, 4000)],
}
RULES = ("length", "shape only")


def decode_step_seconds(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """Runs the requests to the end; the wall time per step once all have their first token."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while not all(r.output_token_ids for r in requests):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    while not all(r.is_finished for r in requests):
        engine.step()
    return (time.perf_counter() - start) / (output_len - 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--spread",
        action="store_true",
        help="prompt lengths uniform in [p/2, 3p/2] (fixed per case) instead of all p",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=16384, max_num_seqs=64)
    runner = llm.engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in weights_read_per_step(runner.model))
    kv_cache = runner.kv_caches[0]
    kv_bytes_per_token = (
        kv_cache[0, 0, 0].numel() * 2 * kv_cache.element_size() * len(runner.kv_caches)
    )
    ceilings = measure_ceilings(runner.dtype)
    choose = DecodeSplits.choose
    rng = random.Random(0)
    rows = []
    for batch, prompt_len in CASES[args.model]:
        row = {"batch": batch, "prompt": prompt_len, "output": args.output_len}
        if args.spread:
            lens = [rng.randint(prompt_len // 2, prompt_len * 3 // 2) for _ in range(batch)]
        else:
            lens = [prompt_len] * batch
        row["prompt_lens"] = lens
        mean_context = sum(lens) / batch + args.output_len / 2
        floor = (
            batch * mean_context * kv_bytes_per_token + weight_bytes
        ) / ceilings.copy_bytes_per_s
        row["floor_ms"] = floor * 1e3
        graph = runner.graph_runner.shape_for(batch, batch) if runner.graph_runner else None
        padded = graph.num_seqs if graph is not None else batch  # the batch the rule sees
        row["splits"] = {
            RULES[0]: choose(runner.decode_splits, padded, int(mean_context)),
            RULES[1]: choose(runner.decode_splits, padded, 0),
        }
        for i in range(args.rounds):
            for rule in RULES if i % 2 == 0 else RULES[::-1]:  # each first in turn
                if rule == RULES[0]:
                    DecodeSplits.choose = choose
                else:
                    DecodeSplits.choose = lambda self, n, _context: choose(self, n, 0)
                prompts = [[rng.randint(0, 10000) for _ in range(n)] for n in lens]
                seconds = decode_step_seconds(llm, prompts, args.output_len)
                row.setdefault(f"ms_{rule}", []).append(seconds * 1e3)
        DecodeSplits.choose = choose
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{args.model}: decode step at long contexts ({'spread' if args.spread else 'equal'} "
          f"prompts), {args.output_len} tokens, ms per step "
          f"(best of {args.rounds}), floor = (KV + weights) / {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s")  # fmt: skip
    print(f"{'batch':>5} {'prompt':>6} {'floor':>7} | {'splits':>7} {'length':>8} {'of floor':>8} | "
          f"{'splits':>7} {'shape':>8} {'of floor':>8} | change")  # fmt: skip
    for r in rows:
        new, old = min(r[f"ms_{RULES[0]}"]), min(r[f"ms_{RULES[1]}"])
        print(f"{r['batch']:5} {r['prompt']:6} {r['floor_ms']:7.2f} | {r['splits'][RULES[0]]:7} "
              f"{new:8.2f} {r['floor_ms'] / new:8.1%} | {r['splits'][RULES[1]]:7} {old:8.2f} "
              f"{r['floor_ms'] / old:8.1%} | {new / old - 1:+.1%}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "copy_bytes_per_s": ceilings.copy_bytes_per_s,
                       "weight_bytes": weight_bytes, "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
