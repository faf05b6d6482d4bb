"""What a structured output costs: the same batch decoded plain and under a JSON schema.

    PYTHONPATH=. python benchmarks/structured_probe.py [--batches 1 16 64 256] [--json out.json]

Dummy Qwen3-0.6B weights, with the small BPE tokenizer of tests/gpu/test_structured_gpu.py
or `--tokenizer DIR` (an HF tokenizer directory: a real vocabulary, such as the embedded
SmolLM2's 49,152 tokens, makes llguidance's masks cost what they cost in use).
Each request: 64 random prompt ids, 128 sampled tokens (temperature 1, ignore_eos). Two
schemas, arrays of at least 500 integers or strings (inside a string nearly every token is
allowed, the costlier mask), cannot end within 128 tokens, so every run makes the same
number of tokens and steps. A structured step pays twice (see
octavo/engine/structured_output.py):
- the engine waits for the step in flight before it schedules the next (no async overlap);
- llguidance fills each row's mask on the host, and the sampler unpacks and applies it.
`mask_ms` times the second alone: fill_bitmasks over the batch's grammars after 32 tokens,
best of 5.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
from test_structured_gpu import make_model_dir

from octavo import LLM, SamplingParams, StructuredOutputsParams
from octavo.engine.structured_output import bitmask_width, fill_bitmasks

SCHEMAS = {
    kind: {"type": "array", "items": {"type": kind}, "minItems": 500}
    for kind in ("integer", "string")
}
PROMPT_LEN, MAX_TOKENS = 64, 128


def timed_generate(
    llm: LLM, prompts: list[dict], params: list[SamplingParams], profile: str = ""
) -> float:
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        print(f"--- {profile}: {seconds:.3f} s, the host's busiest functions")
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(14)
        stats.sort_stats("cumulative").print_stats("octavo|llguidance", 30)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    return seconds


def mask_ms(llm: LLM, prompts: list[dict], spec: StructuredOutputsParams) -> float:
    """Host time of one step's masks for len(prompts) grammars, 32 tokens into the text."""
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=32, ignore_eos=True,
                            structured_outputs=spec)  # fmt: skip
    (out,) = llm.generate(prompts[:1], params, use_tqdm=False)
    grammars = [engine._compile_grammar(params) for _ in prompts]
    for g in grammars:
        for token in out.outputs[0].token_ids:
            assert g.accept(token)
    bitmask = torch.empty(len(grammars), bitmask_width(engine.vocab_size), dtype=torch.int32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        fill_bitmasks(grammars, bitmask)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--layers", type=int, help="fewer layers (a quick check on a CPU)")
    parser.add_argument("--tokenizer", help="an HF tokenizer directory to use instead")
    parser.add_argument("--detokenize", action="store_true", help="make each token's text too")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print the host's busiest functions (cProfile) of each run",
    )
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    overrides = {}
    if args.layers:
        overrides = {
            "num_hidden_layers": args.layers,
            "layer_types": ["full_attention"] * args.layers,
        }
    model_dir = make_model_dir(Path(tempfile.mkdtemp()), "qwen3-0.6b", **overrides)
    llm = LLM(model_dir, tokenizer=args.tokenizer, max_model_len=512, seed=0)
    vocab = len(llm.get_tokenizer())
    rng = random.Random(0)
    rows = []
    for batch in args.batches:
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(PROMPT_LEN)]}
                   for _ in range(batch)]  # fmt: skip
        plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True,
                                detokenize=args.detokenize) for i in range(batch)]  # fmt: skip
        timed_generate(llm, prompts, plain)  # warm-up: graphs and kernels
        row = {
            "batch": batch,
            "plain_s": min(timed_generate(llm, prompts, plain) for _ in range(2)),
        }
        for kind, schema in SCHEMAS.items():
            spec = StructuredOutputsParams(json=schema)
            structured = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
                                         ignore_eos=True, structured_outputs=spec,
                                         detokenize=args.detokenize)
                          for i in range(batch)]  # fmt: skip
            timed_generate(llm, prompts, structured)  # warm-up: the grammar compiler
            row[f"{kind}_s"] = min(timed_generate(llm, prompts, structured) for _ in range(2))
            row[f"{kind}_mask_ms"] = mask_ms(llm, prompts, spec)
            if args.profile:
                timed_generate(llm, prompts, structured, profile=f"{kind}s, batch {batch}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    device = llm.engine.runner.device
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\n{name}, a tokenizer of {vocab} tokens: {PROMPT_LEN}-id prompts, {MAX_TOKENS} "
          "tokens each; ms per step, and the host's mask fill for the batch")  # fmt: skip
    print("batch  plain | ints: step  ratio  mask | strings: step  ratio  mask")
    for r in rows:
        plain = r["plain_s"] / MAX_TOKENS * 1e3
        cells = [
            f"{r[f'{k}_s'] / MAX_TOKENS * 1e3:6.2f}  {r[f'{k}_s'] / r['plain_s']:5.2f}  "
            f"{r[f'{k}_mask_ms']:5.2f}"
            for k in SCHEMAS
        ]
        print(f"{r['batch']:5d}  {plain:5.2f} | {cells[0]} | {cells[1]}")
    if args.json:
        result = {"device": name, "tokenizer_vocab": vocab, "rows": rows}
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
