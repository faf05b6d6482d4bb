"""What detokenization costs the engine: the Python decode loop against `tokenizers`'
DecodeStream (octavo/engine/detokenizer.py), on the host alone and in a decode step.

    PYTHONPATH=. python benchmarks/detokenize_probe.py --tokenizer DIR [--engine]
        [--batches 16 64 256] [--json out.json]

`--tokenizer` is an HF tokenizer directory (the embedded SmolLM2's, saved with
`save_pretrained`).
- Host: 256 rows, each streaming real text (this repository's docs, encoded) one token a
  step; microseconds per row and step for each path.
- `--engine`: dummy Qwen3-0.6B weights with the tokenizer's vocabulary size, so that every
  sampled id (temperature 1) has text; 64-id prompts, 128 tokens each; ms per step with
  detokenization off, on the Python loop (the detokenizer before DecodeStream), and on the
  DecodeStream.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from octavo.engine import detokenizer
from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
PROMPT_LEN, MAX_TOKENS = 64, 128


def python_loop_only(run):
    """Runs `run()` with the Rust fast path off, as the detokenizer was before it."""
    saved = detokenizer.rust_backend
    detokenizer.rust_backend = lambda tokenizer: None
    try:
        return run()
    finally:
        detokenizer.rust_backend = saved


def host_us_per_row_step(tokenizer, rows: int = 256, steps: int = 200) -> float:
    """Microseconds a row spends a step in IncrementalDetokenizer.update, best of 3."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    starts = [rng.randrange(len(ids) - steps) for _ in range(rows)]
    params = SamplingParams(max_tokens=steps)
    best = float("inf")
    for _ in range(3):
        detoks = [IncrementalDetokenizer(tokenizer, [], params) for _ in range(rows)]
        start = time.perf_counter()
        for step in range(steps):
            for detok, first in zip(detoks, starts, strict=True):
                detok.update([ids[first + step]])
        best = min(best, time.perf_counter() - start)
    for detok, first in zip(detoks, starts, strict=True):  # either path: the one-shot text
        text = detok.get_next_output_text(finished=True, delta=False)
        assert text == tokenizer.decode(ids[first : first + steps], skip_special_tokens=True)
    return best / (rows * steps) * 1e6


def engine_ms_per_step(tokenizer_dir: str, batches: list[int]) -> list[dict]:
    from test_structured_gpu import make_model_dir

    from octavo import LLM

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    model_dir = make_model_dir(Path(tempfile.mkdtemp()), "qwen3-0.6b", vocab_size=vocab)
    llm = LLM(model_dir, tokenizer=tokenizer_dir, max_model_len=512, seed=0)
    rng = random.Random(0)
    rows = []
    for batch in batches:
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(PROMPT_LEN)]}
                   for _ in range(batch)]  # fmt: skip

        row = {
            "batch": batch,
            "off_ms": timed_ms_per_step(llm, prompts, detokenize=False),
            "python_ms": python_loop_only(
                lambda prompts=prompts: timed_ms_per_step(llm, prompts, detokenize=True)
            ),
            "stream_ms": timed_ms_per_step(llm, prompts, detokenize=True),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def timed_ms_per_step(llm, prompts: list[dict], detokenize: bool) -> float:
    """Milliseconds a decode step of generating MAX_TOKENS for every prompt (best of 2,
    after a warm-up)."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True,
                             detokenize=detokenize) for i in range(len(prompts))]  # fmt: skip
    llm.generate(prompts, params, use_tqdm=False)
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return best / MAX_TOKENS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="an HF tokenizer directory")
    parser.add_argument("--engine", action="store_true", help="also time engine steps")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    result = {
        "host_python_us": python_loop_only(lambda: host_us_per_row_step(tokenizer)),
        "host_stream_us": host_us_per_row_step(tokenizer),
    }
    print(json.dumps(result), flush=True)
    if args.engine:
        result["engine"] = engine_ms_per_step(args.tokenizer, args.batches)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n{device}, a tokenizer of {len(tokenizer)} tokens")
    print(f"host, us per row and step: Python loop {result['host_python_us']:.2f}, "
          f"DecodeStream {result['host_stream_us']:.2f}")  # fmt: skip
    if args.engine:
        print("batch  ms per step: off  Python loop  DecodeStream")
        for r in result["engine"]:
            print(f"{r['batch']:5d}  {r['off_ms']:16.2f}  {r['python_ms']:11.2f}  "
                  f"{r['stream_ms']:12.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
