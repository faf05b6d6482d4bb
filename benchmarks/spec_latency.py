"""Speculative decoding's bounds on one request (dummy weights, 512 random prompt ids, greedy):
time per emitted token (TPOT) without speculation, then with proposers that are always right
(they replay the tokens of the run without speculation), never right, and n-gram lookup, at
each k. The weight-read floor per token is measured as in benchmarks/latency.py.

    python benchmarks/spec_latency.py --model qwen3-8b --k 2 4 [--batch 1 16] [--json out.json]

The replaying proposer is a benchmark tool: it shows what a step that verifies k guesses
costs against k + 1 plain decode steps, and the never-right one what a useless guess costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import torch

from octavo import LLM, RequestOutputKind, SamplingParams
from octavo.engine.speculative import NgramProposer, Speculator
from octavo.entrypoints.bench_floor import bytes_read_per_token, measure_ceilings


class Replay:
    """Guesses, for each prompt, the tokens of an earlier run: right where that run's tokens
    are the model's (`shift` 0), each one wrong (`shift` 1)."""

    def __init__(self, tokens: dict[tuple, list[int]], vocab: int, shift: int = 0) -> None:
        self.tokens, self.vocab, self.shift = tokens, vocab, shift

    def propose(self, requests, k):
        guesses = []
        for r in requests:
            known = self.tokens[tuple(r.prompt_token_ids)][r.num_output_tokens :][:k]
            guesses.append([(t + self.shift) % self.vocab for t in known])
        return guesses


def decode(engine, prompts: list[list[int]], params: SamplingParams):
    """(TTFT, TPOT, tokens of each prompt) of the prompts run together: TTFT until every
    request has its first token, TPOT per emitted token of a request after that."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    ids = {}
    for prompt in prompts:
        ids[f"r{time.monotonic_ns()}"] = tuple(prompt)
        engine.add_request(prompt, params, list(ids)[-1])
    tokens: dict[tuple, list[int]] = {p: [] for p in ids.values()}
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[ids[out.request_id]] += out.outputs[0].token_ids
        if first is None and all(tokens.values()):
            first = time.perf_counter()
    end = time.perf_counter()
    count = sum(len(t) for t in tokens.values()) / len(tokens)
    return first - start, (end - first) / max(count - 1, 1), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b", help='a bundled config, or "embedded"')
    p.add_argument("--k", type=int, nargs="+", default=[4])
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--modes", nargs="+", default=["replay", "never", "ngram"])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    k_max = max(args.k)
    model = None if args.model == "embedded" else args.model
    llm = LLM(model, load_format="auto" if model is None else "dummy", max_model_len=4096,
              max_num_seqs=max(8, *args.batch),
              speculative_config={"num_speculative_tokens": k_max})  # fmt: skip
    engine = llm.engine
    vocab = engine.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    # Every batch speculates here: the sweep is what sets the default limit.
    config = dataclasses.replace(engine.speculator.config, disable_by_batch_size=1 << 30)

    def prompts_of(batch: int) -> list[list[int]]:
        return [[rng.randint(0, 10000) for _ in range(args.prompt_len)] for _ in range(batch)]

    def run(name, k, proposer, prompts):
        engine.speculator = None if proposer is None else Speculator(config, proposer)
        if proposer is not None:
            engine.speculator.k = k
        ttft, tpot, tokens = decode(engine, prompts, params)
        stats = engine.speculator.stats.as_dict() if proposer else {}
        kept = stats.get("spec_accepted_tokens", 0) / max(stats.get("spec_draft_tokens", 0), 1)
        return {"mode": name, "k": k if proposer else 0, "batch": len(prompts), "ttft_s": ttft,
                "tpot_s": tpot, "mean_accepted_length": stats.get("spec_mean_accepted_length", 1),
                "kept": kept, "tokens": tokens}  # fmt: skip

    def replay(k, prompts, source):
        """Replays earlier tokens until a run keeps every guess: off the float path a step
        of k + 1 rows may round a token differently from a step of one, so the model's own
        greedy tokens under speculation are found by running it (a few times at most)."""
        for _ in range(12):
            row = run("replay", k, Replay(source, vocab), prompts)
            if row["kept"] == 1.0:
                break
            source = row["tokens"]
        return row

    run("warm-up", 0, None, prompts_of(2))
    run("warm-up", k_max, NgramProposer(2, 4), prompts_of(2))
    rows = []
    for batch in args.batch:
        prompts = prompts_of(batch)
        plain = run("plain", 0, None, prompts)
        rows.append(plain)
        for k in args.k:
            for mode in args.modes:
                if mode == "replay":
                    row = replay(k, prompts, plain["tokens"])
                elif mode == "never":
                    row = run(mode, k, Replay(plain["tokens"], vocab, shift=1), prompts)
                else:
                    ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                    row = run(mode, k, ngram, prompts)
                row["same_tokens"] = row["tokens"] == plain["tokens"]
                row["tpot_over_plain"] = row["tpot_s"] / plain["tpot_s"]
                rows.append(row)
    runner = engine.runner
    on_gpu = torch.cuda.is_available()
    bandwidth = measure_ceilings(runner.dtype).copy_bytes_per_s if on_gpu else float("nan")
    floor = bytes_read_per_token(runner.model) / bandwidth
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    print(f"{args.model} on {device}: floor {floor * 1e3:.2f} ms per token (weights read once)")
    print(f"{'mode':<8}{'batch':>6}{'k':>3}{'TTFT ms':>9}{'TPOT ms':>9}{'x plain':>9}"
          f"{'x floor':>9}{'accepted':>10}{'kept':>6}{'same':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['mode']:<8}{r['batch']:>6}{r['k']:>3}{r['ttft_s'] * 1e3:>9.1f}"
              f"{r['tpot_s'] * 1e3:>9.2f}{r.get('tpot_over_plain', 1.0):>9.2f}"
              f"{r['tpot_s'] / floor:>9.2f}{r['mean_accepted_length']:>10.2f}"
              f"{r['kept']:>6.2f}{r.get('same_tokens', '')!s:>6}")  # fmt: skip
    if args.json:
        for r in rows:
            del r["tokens"]
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": device, "floor_s": floor, "rows": rows},
                      f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
