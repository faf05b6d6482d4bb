"""Short-context decode steps on the GPU, where the host's Python work per row, not the
device, bounds the step: median ms per decode step of the whole batch, and the host's own
share of it.

    python benchmarks/decode_host.py [--tokenizer PATH] [--batches 16 64 256]
        [--structured integer|string] [--breakdown] [--json out.json]

Dummy Qwen3-0.6B weights with a real tokenizer's vocabulary (`--tokenizer`: an HF tokenizer
directory or a GGUF file; default the embedded SmolLM2's, 49,152 tokens), 64-id prompts, 128
tokens each at temperature 1 (no seed; `--seeded`: a seed for each request), two ways:
- `plain`: `LLM.generate` without detokenization (outputs made once, at the end);
- `stream`: `Engine.add_request` with DELTA outputs and detokenization, as a server streams.

Each also reports the median step less its waits for the device (the time the engine spends
in `torch.cuda.Event.synchronize`): the host's own work. A step whose host work is shorter
than its device work waits; one whose host work is longer is bound by the host.

`--structured integer|string` gives every request a JSON schema (an array of at least 500
such items, so that nothing ends early; inside a string nearly every token is allowed, the
costlier mask). `--breakdown` also prints the host ms a step spent in each of the engine
functions listed in BREAKDOWN (those this tree has; a missing one is skipped), from the last
run of each mode. The functions nest.

To compare two source trees, run it once with each on PYTHONPATH: the timing itself uses only
the public `LLM` and `Engine` API.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Self

import torch

import octavo
from octavo import LLM, SamplingParams
from octavo.engine.builder import resolve_model
from octavo.model.tokenizer import load_tokenizer
from octavo.sampling_params import RequestOutputKind

PROMPT_LEN, MAX_TOKENS = 64, 128

# "module:attribute path": what --breakdown times (a missing one is skipped)
BREAKDOWN = [
    "octavo.core.scheduler:Scheduler.schedule",
    "octavo.runner.model_runner:ModelRunner.execute_async",
    "octavo.core.scheduler:Scheduler.update",
    "octavo.engine.structured_output:Grammar.accept",
    "octavo.core.scheduler:accept_tokens",
    "octavo.runner.sampler:SamplingMetadata.build",
    "octavo.runner.sampler:GrammarMasks.bans",
    "octavo.runner.sampler:fill_bitmasks",
    "octavo.runner.sampler:Sampler.__call__",
    "octavo.engine.output_processor:OutputProcessor.process_token",
    "octavo.engine.output_processor:OutputProcessor.make_output",
]


class Timers:
    """Wraps the BREAKDOWN functions that exist with timers: seconds spent in each."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._undo: list = []

    def __enter__(self) -> Self:
        import importlib

        for name in BREAKDOWN:
            module_name, path = name.split(":")
            *owners, attr = path.split(".")
            owner = importlib.import_module(module_name)
            try:
                for part in owners:
                    owner = getattr(owner, part)
                raw = vars(owner)[attr] if isinstance(owner, type) else getattr(owner, attr)
            except (AttributeError, KeyError):
                continue
            self.seconds[path] = 0.0
            setattr(owner, attr, self._wrap(path, raw))
            self._undo.append((owner, attr, raw))
        return self

    def _wrap(self, path: str, raw):
        kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
        func = raw.__func__ if kind is not None else raw
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                seconds[path] += time.perf_counter() - start

        return kind(timed) if kind is not None else timed

    def __exit__(self, *exc) -> None:
        for owner, attr, raw in reversed(self._undo):
            setattr(owner, attr, raw)


def make_llm(tokenizer: str) -> LLM:
    vocab = len(load_tokenizer(tokenizer))
    config = json.loads((Path(resolve_model("qwen3-0.6b")) / "config.json").read_text())
    config["vocab_size"] = vocab
    model_dir = tempfile.mkdtemp()
    (Path(model_dir) / "config.json").write_text(json.dumps(config))
    return LLM(model_dir, load_format="dummy", tokenizer=tokenizer, max_model_len=512)


def step_times(
    llm: LLM,
    prompts: list[list[int]],
    stream: bool,
    max_tokens: int,
    seeded: bool = False,
    structured: str | None = None,
) -> tuple[list[float], list[float]]:
    """Seconds of each engine step while generating `max_tokens` for every prompt, and of
    each step less its waits for the device (CUDA events): the host's own work."""
    engine = llm.engine
    times: list[float] = []
    host_times: list[float] = []
    waits = [0.0]
    real_step = engine.step
    real_sync = torch.cuda.Event.synchronize

    def timed():
        waits[0] = 0.0
        start = time.perf_counter()
        outputs = real_step()
        times.append(time.perf_counter() - start)
        host_times.append(times[-1] - waits[0])
        return outputs

    def timed_sync(event):
        start = time.perf_counter()
        real_sync(event)
        waits[0] += time.perf_counter() - start

    engine.step = timed
    torch.cuda.Event.synchronize = timed_sync
    try:
        params = [
            SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                           detokenize=stream, seed=i if seeded else None,
                           structured_outputs=_spec(structured))
            for i in range(len(prompts))
        ]  # fmt: skip
        if stream:
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
                p.output_kind = RequestOutputKind.DELTA
                engine.add_request(ids, p, f"probe-{time.monotonic_ns()}-{i}")
            while engine.has_unfinished_requests():
                engine.step()
        else:
            llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    finally:
        engine.step = real_step
        torch.cuda.Event.synchronize = real_sync
    return times, host_times


def _spec(kind: str | None):
    if kind is None:
        return None
    from octavo import StructuredOutputsParams

    return StructuredOutputsParams(json={"type": "array", "items": {"type": kind}, "minItems": 500})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="an HF tokenizer directory or a GGUF file (default: the embedded model's)",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--seeded", action="store_true", help="a seed for each request")
    parser.add_argument("--structured", choices=["integer", "string"])
    parser.add_argument("--breakdown", action="store_true", help="host ms in engine functions")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    llm = make_llm(args.tokenizer or resolve_model(None))
    vocab = llm.engine.vocab_size
    rng = random.Random(0)
    rows = []
    for batch in args.batches:
        prompts = [[rng.randrange(vocab) for _ in range(PROMPT_LEN)] for _ in range(batch)]
        row = {"batch": batch}
        for mode in ("plain", "stream"):
            stream = mode == "stream"
            run = (llm, prompts, stream, args.max_tokens, args.seeded, args.structured)
            step_times(*run)  # warm-up
            # the median step of a run is a decode step of the whole batch; best run of N
            runs = [step_times(*run) for _ in range(args.repeats)]
            row[f"{mode}_ms"] = min(1e3 * statistics.median(t) for t, _ in runs)
            row[f"{mode}_host_ms"] = min(1e3 * statistics.median(h) for _, h in runs)
            if args.breakdown:
                with Timers() as timers:
                    steps = len(step_times(*run)[0])
                row[f"{mode}_breakdown_ms"] = {
                    name: round(1e3 * seconds / steps, 3)
                    for name, seconds in timers.seconds.items()
                }
        rows.append(row)
        print(json.dumps(row), flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n{device}, octavo from {Path(octavo.__file__).parent}")
    print("batch  median decode step ms: plain (host)  stream (host)")
    for r in rows:
        print(f"{r['batch']:5d}  {r['plain_ms']:27.2f} ({r['plain_host_ms']:.2f})  "
              f"{r['stream_ms']:6.2f} ({r['stream_host_ms']:.2f})")  # fmt: skip
    if args.breakdown:
        print("host ms a step (mean over the run) in: plain / stream")
        for r in rows:
            for name, ms in r["plain_breakdown_ms"].items():
                print(
                    f"{r['batch']:5d}  {name:40s} {ms:7.3f} / {r['stream_breakdown_ms'][name]:7.3f}"
                )
    if args.json:
        Path(args.json).write_text(json.dumps({"octavo": octavo.__file__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
