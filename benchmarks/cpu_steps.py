"""How long one engine step takes on the CPU while a long prompt is prefilled, at each token
budget (`max_num_batched_tokens`), and what a short request sent meanwhile waits for its
first token. The embedded model, GGUF blocks kept (the default).

    python benchmarks/cpu_steps.py --prompt-len 8000 --budgets 64 128 256
"""

from __future__ import annotations

import argparse
import random
import time

from octavo import LLM, SamplingParams


def run(budget: int, prompt_len: int) -> dict:
    llm = LLM(max_num_batched_tokens=budget, max_model_len=max(8192, prompt_len + 16))
    engine, rng = llm.engine, random.Random(0)
    ids = [rng.randint(100, 40000) for _ in range(prompt_len)]
    engine.add_request(ids[:64], SamplingParams(max_tokens=1))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(ids, SamplingParams(max_tokens=1), "long")
    steps, start, short_sent, ttft = [], time.perf_counter(), None, None
    while engine.has_unfinished_requests():
        if short_sent is None and len(steps) == (prompt_len // budget) * 3 // 4:
            engine.add_request(ids[:4], SamplingParams(max_tokens=1), "short")  # late in it
            short_sent = time.perf_counter()
        begin = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - begin)
        if any(o.request_id == "short" for o in outputs) and ttft is None:
            ttft = time.perf_counter() - short_sent
    total = time.perf_counter() - start
    return {"budget": budget, "steps": len(steps), "first_ms": steps[0] * 1e3,
            "max_ms": max(steps) * 1e3, "prefill_s": total, "tok_per_s": prompt_len / total,
            "short_ttft_s": ttft}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=8000)
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    args = p.parse_args()
    print(f"{'budget':>7}{'steps':>7}{'first ms':>10}{'max ms':>8}{'prefill s':>11}"
          f"{'tok/s':>7}{'short TTFT s':>14}")  # fmt: skip
    for budget in args.budgets:
        r = run(budget, args.prompt_len)
        print(f"{r['budget']:>7}{r['steps']:>7}{r['first_ms']:>10.0f}{r['max_ms']:>8.0f}"
              f"{r['prefill_s']:>11.2f}{r['tok_per_s']:>7.0f}{r['short_ttft_s']:>14.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
