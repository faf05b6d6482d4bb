"""Parallel sampling on the CPU with the embedded model: peak KV blocks and output tok/s of
SamplingParams(n=k) against k independent requests per prompt, for k = 1, 4, 8.

    python benchmarks/parallel_sampling.py [--json docs/results/parallel_sampling.json]

Prefix caching is off, so independent requests cannot share the prompt's blocks through the
cache: the saving shown is n > 1's block sharing alone. 8 chat prompts, 64 tokens each,
temperature 0.8, ignore_eos.
"""

from __future__ import annotations

import argparse
import json
import time

from octavo import LLM, SamplingParams
from octavo.model.tokenizer import apply_chat_template

QUESTIONS = [
    "What is the capital of France? Answer in one paragraph with some history.",
    "Write a haiku about the sea, then explain each line.",
    "Explain what a hash table is, with an example in Python.",
    "List three prime numbers and say why each is prime.",
    "How do I reverse a list in Python? Show three ways.",
    "Translate 'good morning, how are you today?' into Spanish and French.",
    "What is 12 times 12? Show the working step by step.",
    "Give me five names for a friendly robot and say why.",
]


def run(llm: LLM, prompts: list[list[int]], k: int, shared: bool) -> dict:
    kv = llm.engine.kv
    kv.sharing.peak_blocks_used = 0  # idle engine: restart the high-water mark
    base = dict(temperature=0.8, max_tokens=64, ignore_eos=True)
    if shared:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        params = [SamplingParams(n=k, seed=i, **base) for i in range(len(prompts))]
    else:
        inputs = [{"prompt_token_ids": p} for p in prompts for _ in range(k)]
        params = [SamplingParams(seed=i, **base) for i in range(len(inputs))]
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "k": k,
        "mode": f"n={k}" if shared else f"{k} x n=1",
        "peak_kv_blocks": kv.sharing.peak_blocks_used,
        "output_tokens": tokens,
        "seconds": seconds,
        "tok_per_s": tokens / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(enable_prefix_caching=False, max_num_batched_tokens=8192)
    tok = llm.get_tokenizer()
    prompts = [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    rows = []
    for k in (1, 4, 8):
        for shared in (True, False):
            if k == 1 and not shared:
                continue  # the same run as n=1
            rows.append(run(llm, prompts, k, shared))
    prompt_tokens = [len(p) for p in prompts]
    print(f"8 prompts of {min(prompt_tokens)}-{max(prompt_tokens)} tokens, 64 output tokens each")
    print(f"{'mode':<10}{'peak blocks':>12}{'tokens':>8}{'seconds':>9}{'tok/s':>8}")
    for r in rows:
        print(f"{r['mode']:<10}{r['peak_kv_blocks']:>12}{r['output_tokens']:>8}"
              f"{r['seconds']:>9.2f}{r['tok_per_s']:>8.1f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompt_tokens": prompt_tokens, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
