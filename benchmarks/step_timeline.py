"""Engine steps on the GPU, timed one by one: where a run's time goes, device or host.

    python benchmarks/step_timeline.py [--model qwen3-0.6b] [--json out.json] [--profile-prefill]
    python benchmarks/step_timeline.py --host [--tokenizer PATH] [--batches 16 64 256]
        [--structured integer|string] [--breakdown] [--json out.json]

Default: the nano-vllm workload, against each step's floor. It runs through `LLM.generate` as
`octavo bench throughput --workload nanovllm` runs it, with each `engine.step()` call timed.
With async scheduling a call launches one step and then waits for the previous step's
tokens, so the time between two calls' ends is the device time of a step (when the device
is the bottleneck), and the host's wait inside a call (its time in
`torch.cuda.Event.synchronize`) says whether it is: a wait near zero means the host is the
bottleneck. Steps are grouped: prefill (any step computing more tokens than sequences) and
decode steps by batch size. A decode step's floor reads its KV and every weight once: (sum
of context lengths x KV bytes per token + weight bytes) / copy bandwidth. Also printed:
Python's garbage collections, the CUDA caching allocator's retries and Triton compiles during
the timed run (each would stall the steps it lands in).

`--host`: short-context decode, where the host's Python work per row, not the device, bounds
the step: the median ms per decode step of the whole batch, and the host's own share of it
(the step less its waits for the device). Dummy Qwen3-0.6B weights with a real tokenizer's
vocabulary (`--tokenizer`: an HF tokenizer directory or a GGUF file; default the embedded
SmolLM2's, 49,152 tokens), 64-id prompts, 128 tokens each at temperature 1 (no seed;
`--seeded`: a seed for each request), two ways:
- `plain`: `LLM.generate` without detokenization (outputs made once, at the end);
- `stream`: `Engine.add_request` with DELTA outputs and detokenization, as a server streams.
`--structured integer|string` gives every request a JSON schema (an array of at least 500
such items, so that nothing ends early; inside a string nearly every token is allowed, the
costlier mask). `--breakdown` also prints the host ms a step spent in each of the engine
functions listed in BREAKDOWN (those this tree has; a missing one is skipped), from the last
run of each mode. The functions nest. The timing uses only the public `LLM` and `Engine`
API, so two source trees compare by running it once with each on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import gc
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
from octavo.entrypoints.bench_throughput import measured_floor, nanovllm_workload
from octavo.sampling_params import RequestOutputKind
from octavo.tokenizer.tokenizer import load_tokenizer

BUCKETS = [(1, 16), (17, 64), (65, 128), (129, 192), (193, 256)]


def describe(so) -> dict:
    """A scheduled step's shape: sequences, tokens computed, positions attended.
    NOTE: the one place that reads the scheduler's output (octavo/core)."""
    return {
        "seqs": len(so.scheduled),
        "tokens": so.num_batched_tokens,
        "context": sum(s.num_computed_tokens + s.num_new_tokens for s in so.scheduled),
    }


class StepRecorder:
    """Times every `engine.step()` call of an engine and records, for each launched step,
    when its tokens reached the host, the host's wait for them and the host time of the call
    that launched it (less its waits). Undo with `close()`."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.records: list[dict] = []
        self._in_flight: dict | None = None
        self._scheduled: list = []
        self._wait = 0.0
        real_step, real_schedule = engine.step, engine.scheduler.schedule
        real_sync = torch.cuda.Event.synchronize
        self._undo = (real_step, real_schedule, real_sync)
        recorder = self

        def schedule():
            so = real_schedule()
            recorder._scheduled.append(so)
            return so

        def synchronize(event):
            start = time.perf_counter()
            real_sync(event)
            recorder._wait += time.perf_counter() - start

        def step():
            recorder._wait, recorder._scheduled = 0.0, []
            start = time.perf_counter()
            outputs = real_step()
            recorder._after_step(start, time.perf_counter())
            return outputs

        engine.step, engine.scheduler.schedule = step, schedule
        torch.cuda.Event.synchronize = synchronize

    def _after_step(self, start: float, end: float) -> None:
        launched = [describe(so) for so in self._scheduled if not so.is_empty]
        for info in launched:
            info["host"] = end - start - self._wait
        if self.engine.async_scheduling:
            # The step in flight before this call finished in it; this call's step is in flight.
            finished, self._in_flight = self._in_flight, (launched[-1] if launched else None)
            finished = [finished] if finished is not None else []
        else:
            finished = launched
        for info in finished:
            self.records.append({**info, "done": end, "wait": self._wait})

    def close(self) -> None:
        real_step, real_schedule, real_sync = self._undo
        self.engine.step, self.engine.scheduler.schedule = real_step, real_schedule
        torch.cuda.Event.synchronize = real_sync


class GcWatch:
    """Python's garbage collections while active: generation, ms, objects tracked (full
    collections only) and the step they landed in."""

    def __init__(self, records: list) -> None:
        self.records = records
        self.collections: list[dict] = []
        self.seconds = 0.0
        self._start = 0.0
        self._tracked: int | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            # Objects the collector sees (not frozen), counted for full collections only;
            # the count itself walks them all, and its time lands in that step.
            self._tracked = len(gc.get_objects()) if info["generation"] == 2 else None
            self._start = time.perf_counter()
            return
        ms = 1e3 * (time.perf_counter() - self._start)
        self.seconds += ms / 1e3
        # NOTE: no gc.get_freeze_count() here: it walks every frozen object (500k once
        # LLM.generate freezes the heap), which cost ~5 s over a run's ~130 collections.
        self.collections.append(
            {
                "generation": info["generation"],
                "ms": ms,
                "tracked": self._tracked,
                "step": len(self.records),
            }
        )

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def report(self) -> None:
        print(f"Python GC during the timed run: {1e3 * self.seconds:.1f} ms")
        for generation in range(3):
            ms = [c["ms"] for c in self.collections if c["generation"] == generation]
            print(
                f"  generation {generation}: {len(ms)} collections, {sum(ms):.1f} ms, "
                f"longest {max(ms, default=0):.1f} ms"
            )
        for c in sorted(self.collections, key=lambda c: -c["ms"])[:3]:
            tracked = "" if c["tracked"] is None else f": {c['tracked']} objects tracked"
            print(
                f"  a {c['ms']:.1f} ms collection of generation {c['generation']} at step "
                f"{c['step']}{tracked}"
            )


ALLOCATOR_STATS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def run_workload(args) -> None:
    # nano-vllm's settings for its workload, as `octavo bench throughput --workload nanovllm`.
    llm = LLM(args.model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=16384)
    w = nanovllm_workload()
    fl, ceilings = measured_floor(llm, w)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in w.max_tokens]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)

    compiled = triton_variants()
    memory = torch.cuda.memory_stats()
    print(
        f"before the timed run: {len(gc.get_objects())} objects tracked by the collector, "
        f"{gc.get_freeze_count()} frozen"
    )
    recorder = StepRecorder(llm.engine)
    gc_watch = GcWatch(recorder.records)
    start = time.perf_counter()
    try:
        llm.generate([{"prompt_token_ids": p} for p in w.prompts], params, use_tqdm=False)
    finally:
        total = time.perf_counter() - start
        gc_watch.close()
        recorder.close()
    after = torch.cuda.memory_stats()
    allocator = {k: after.get(k, 0) - memory.get(k, 0) for k in ALLOCATOR_STATS}
    new_variants = {k: n - compiled.get(k, 0) for k, n in triton_variants().items()}
    new_variants = {k: n for k, n in new_variants.items() if n}
    gc_watch.report()
    print(f"CUDA caching allocator: {allocator}")
    print(f"Triton kernel variants compiled during the timed run: {new_variants or 'none'}")

    records = recorder.records
    previous = start
    for r in records:
        r["seconds"], previous = r["done"] - previous, r["done"]
        r["floor"] = (r["context"] * fl.kv_bytes_per_token + fl.weight_bytes) / (
            ceilings.copy_bytes_per_s
        )
    groups = {"prefill": [r for r in records if r["tokens"] > r["seqs"]]}
    decode = [r for r in records if r["tokens"] == r["seqs"]]
    for lo, hi in BUCKETS:
        groups[f"decode {lo}-{hi}"] = [r for r in decode if lo <= r["seqs"] <= hi]
    print(f"{args.model}: {total:.2f} s, {len(records)} steps, workload floor {fl.seconds:.2f} s")
    print(
        f"{'steps':<14}{'n':>6}{'seconds':>9}{'ms/step':>9}{'floor ms':>10}{'of floor':>9}"
        f"{'host wait ms':>13}"
    )
    summary = {}
    for name, rs in groups.items():
        if not rs:
            continue
        secs = sum(r["seconds"] for r in rs)
        floor = sum(r["floor"] for r in rs)
        wait = sum(r["wait"] for r in rs) / len(rs)
        summary[name] = {"steps": len(rs), "seconds": secs, "floor_s": floor, "mean_wait_s": wait}
        ratio = f"{floor / secs:.0%}" if name != "prefill" else "-"
        print(
            f"{name:<14}{len(rs):>6}{secs:>9.2f}{1e3 * secs / len(rs):>9.2f}"
            f"{1e3 * floor / len(rs):>10.2f}{ratio:>9}{1e3 * wait:>13.2f}"
        )
    print("first steps: tokens, seqs, ms since the previous, host ms of its call, wait ms")
    for r in records[:12]:
        print(
            f"  {r['tokens']:>6} {r['seqs']:>4} {1e3 * r['seconds']:>8.2f} "
            f"{1e3 * r['host']:>8.2f} {1e3 * r['wait']:>8.2f}"
        )
    if args.profile_prefill:
        profile_prefill(llm, w)
    if args.json:
        keys = ("tokens", "seqs", "context", "seconds", "host", "wait")
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "seconds": total,
                    "groups": summary,
                    "new_triton_variants": new_variants,
                    "gc_seconds": gc_watch.seconds,
                    "gc_collections": gc_watch.collections,
                    "allocator": allocator,
                    "steps": [{k: r[k] for k in keys} for r in records],
                },
                f,
                indent=1,
            )


def triton_variants() -> dict[str, int]:
    """Compiled variants of each of octavo's Triton kernels, by kernel name."""
    import triton

    from octavo import kernels

    counts = {}
    for module in kernels.__dict__.values():
        for name, fn in getattr(module, "__dict__", {}).items():
            if isinstance(fn, triton.runtime.jit.JITFunction):
                caches = getattr(fn, "device_caches", {})
                counts[name] = sum(len(c[0]) for c in caches.values() if isinstance(c, tuple))
    return counts


def profile_prefill(llm: LLM, w) -> None:
    """The workload's prompts with one output token each (prefill steps only), under cProfile:
    where the host's time goes in a prefill step."""
    import cProfile
    import pstats

    def fresh(shift: int) -> list[dict]:  # the workload's lengths, tokens no cache holds
        return [{"prompt_token_ids": [10_000 + shift + t for t in p]} for p in w.prompts]

    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1) for _ in w.prompts]
    torch.cuda.set_sync_debug_mode("warn")  # names any call that waits for the device
    llm.generate(fresh(1), params, use_tqdm=False)
    torch.cuda.set_sync_debug_mode(0)
    steps = llm.get_stats()["num_steps"]
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    llm.generate(fresh(2), params, use_tqdm=False)
    profile.disable()
    seconds = time.perf_counter() - start
    steps = llm.get_stats()["num_steps"] - steps
    print(f"prefill only, under cProfile: {seconds:.3f} s, {steps} steps")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


# --- --host: short-context decode ----------------------------------------------------------

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


def run_host(args) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--model", default="qwen3-0.6b", help="the workload's model")
    parser.add_argument("--profile-prefill", action="store_true")
    parser.add_argument("--host", action="store_true", help="short-context decode's host share")
    parser.add_argument(
        "--tokenizer",
        help="--host: an HF tokenizer directory or a GGUF file (default: the embedded model's)",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--seeded", action="store_true", help="--host: a seed for each request")
    parser.add_argument("--structured", choices=["integer", "string"])
    parser.add_argument("--breakdown", action="store_true", help="host ms in engine functions")
    args = parser.parse_args()
    (run_host if args.host else run_workload)(args)


if __name__ == "__main__":
    main()
