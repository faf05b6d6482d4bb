"""n-gram speculative decoding on the CPU: one request at a time, prompts whose answers copy
their input (repeat, edit, rename, summarise with quotes), greedy; tok/s with and without
speculation, whether the tokens are the same, and the mean accepted length.

    python benchmarks/spec_decode.py --k 2 4 6 --max-tokens 160
    python benchmarks/spec_decode.py --batch 1 4 16   # all prompts at once, copies of them

`--batch B` runs B requests at a time (the prompts, repeated) and reports tok/s of each
setting at each B: where speculation stops paying as the batch grows.
"""

from __future__ import annotations

import argparse
import time

from octavo import LLM, SamplingParams

CODE = """def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config needs a name")
    return Config(name=data["name"], size=data.get("size", 1))
"""
TEXT = (
    "The committee met on Tuesday to review the budget. Maria said that the library needs "
    "new shelves before the winter. Tom replied that the roof repairs must come first, "
    "because the rain damaged three rooms last year. In the end they agreed to fund both."
)
LIST = "apples, pears, plums, cherries, grapes, lemons, limes, oranges, peaches, apricots"

PROMPTS = {
    "repeat": [
        f"Repeat the following text exactly:\n\n{TEXT}",
        f"Write this list again, one item per line: {LIST}",
    ],
    "edit": [
        f"Fix the spelling and repeat the text: {TEXT.replace('budget', 'budgett')}",
        f"Add a docstring to this function and show the whole function:\n\n{CODE}",
    ],
    "rename": [
        f"Rename the function load_config to read_config and show the code:\n\n{CODE}",
        f"Rename the variable data to raw in this code and show all of it:\n\n{CODE}",
    ],
    "quote": [
        f"Summarise the text, quoting what Maria and Tom said word for word:\n\n{TEXT}",
        f"Which sentence mentions the roof? Quote it exactly.\n\n{TEXT}",
    ],
}


def run(llm: LLM, max_tokens: int) -> dict[str, tuple[float, int, list[list[int]]]]:
    """Per category: seconds, tokens and each answer's token ids, one request at a time."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    results = {}
    for category, prompts in PROMPTS.items():
        seconds, tokens, answers = 0.0, 0, []
        for prompt in prompts:
            start = time.perf_counter()
            (out,) = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
            seconds += time.perf_counter() - start
            tokens += len(out.outputs[0].token_ids)
            answers.append(list(out.outputs[0].token_ids))
        results[category] = (seconds, tokens, answers)
    return results


def run_batched(llm: LLM, batch: int, max_tokens: int) -> tuple[float, int, list]:
    """Seconds, tokens and answers of `batch` requests at once, the prompts in turn."""
    prompts = [p for group in PROMPTS.values() for p in group]
    chats = [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return (
        seconds,
        sum(len(o.outputs[0].token_ids) for o in outs),
        [o.outputs[0].token_ids for o in outs],
    )


def main_batched(args) -> None:
    print(f"{'k':>3}{'batch':>7}{'tokens':>8}{'tok/s':>8}{'speed-up':>9}{'same':>6}")
    base = {}
    for k in [0, *args.k]:
        config = {"num_speculative_tokens": k} if k else None
        llm = LLM(quantization=args.quantization, speculative_config=config)
        run_batched(llm, 2, 8)  # warm-up
        for batch in args.batch:
            seconds, tokens, answers = run_batched(llm, batch, args.max_tokens)
            base.setdefault(batch, (seconds, tokens, answers))
            speedup = tokens / seconds / (base[batch][1] / base[batch][0])
            same = "yes" if answers == base[batch][2] else "NO"
            print(f"{k:>3}{batch:>7}{tokens:>8}{tokens / seconds:>8.1f}{speedup:>9.2f}{same:>6}")
        llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--batch", type=int, nargs="+", default=None)
    args = p.parse_args()
    if args.batch:
        main_batched(args)
        return
    configs = [None] + [{"method": "ngram", "num_speculative_tokens": k} for k in args.k]
    runs = []
    for config in configs:
        llm = LLM(quantization=args.quantization, speculative_config=config)
        run(llm, 8)  # warm-up
        runs.append((config, run(llm, args.max_tokens), llm.get_stats()))
        llm.shutdown()
    base = runs[0][1]
    print(f"{'k':>3} {'category':<8}{'tokens':>7}{'tok/s':>8}{'speed-up':>9}{'same':>6}")
    for config, results, stats in runs:
        k = config["num_speculative_tokens"] if config else 0
        total_s = total_t = 0
        for category, (seconds, tokens, answers) in results.items():
            same = answers == base[category][2]
            speedup = base[category][0] / seconds * tokens / base[category][1]
            print(f"{k:>3} {category:<8}{tokens:>7}{tokens / seconds:>8.1f}{speedup:>9.2f}"
                  f"{'yes' if same else 'NO':>6}")  # fmt: skip
            total_s, total_t = total_s + seconds, total_t + tokens
        base_rate = sum(b[1] for b in base.values()) / sum(b[0] for b in base.values())
        mean = stats.get("spec_mean_accepted_length", 0.0)
        rate = total_t / total_s
        print(f"{k:>3} {'all':<8}{total_t:>7}{rate:>8.1f}{rate / base_rate:>9.2f}"
              f"   mean accepted length {mean:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
