"""Where the nano-vllm workload's time goes on the GPU, step by step, against each step's floor.

With async scheduling a step's tokens reach the host once the device has finished it, so the
time between two such arrivals is the device time of a step (when the device is the
bottleneck) and the host's wait in between says whether it is (a wait near zero means the
host is the bottleneck). Steps are grouped: prefill (any step computing more tokens than
sequences) and decode steps by batch size. A decode step's floor reads its KV and every
weight once: (sum of context lengths x KV bytes per token + weight bytes) / copy bandwidth.

    PYTHONPATH=. python benchmarks/step_timeline.py [--model qwen3-0.6b] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from octavo import LLM, SamplingParams
from octavo.engine.engine import Engine
from octavo.entrypoints.bench_throughput import measured_floor, nanovllm_workload
from octavo.runner.model_runner import PendingOutput

BUCKETS = [(1, 16), (17, 64), (65, 128), (129, 192), (193, 256)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile-prefill", action="store_true")
    args = parser.parse_args()
    # nano-vllm's settings for its workload, as `octavo bench throughput --workload nanovllm`.
    llm = LLM(args.model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=16384)
    w = nanovllm_workload()
    fl, ceilings = measured_floor(llm, w)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in w.max_tokens]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)

    records: list[dict] = []
    waits: list[float] = []
    launches: dict[int, float] = {}  # id(scheduler output) -> host seconds in schedule + launch
    real_result, real_finish = PendingOutput.result, Engine._finish
    sched_type = type(llm.engine.scheduler)
    real_schedule, real_launch = sched_type.schedule, Engine._launch
    scheduled_at = [0.0]

    def schedule(self):
        scheduled_at[0] = time.perf_counter()
        return real_schedule(self)

    def launch(self, so):
        out = real_launch(self, so)
        launches[id(so)] = time.perf_counter() - scheduled_at[0]
        return out

    def result(self):
        start = time.perf_counter()
        out = real_result(self)
        waits.append(time.perf_counter() - start)
        return out

    def finish(self, so, pending):
        out = real_finish(self, so, pending)
        records.append({
            "done": time.perf_counter(),
            "wait": waits[-1],
            "host": launches.pop(id(so), 0.0),
            "seqs": len(so.scheduled),
            "tokens": so.num_batched_tokens,
            "context": sum(s.num_computed_tokens + s.num_new_tokens for s in so.scheduled),
        })
        return out

    PendingOutput.result, Engine._finish = result, finish
    sched_type.schedule, Engine._launch = schedule, launch
    compiled = triton_variants()
    gc_seconds = [0.0, 0.0]  # total, start of the collection in progress
    collections: list[dict] = []  # each: generation, ms, objects tracked (full ones), step
    tracked: list[int | None] = [None]

    def on_gc(phase, info):
        if phase == "start":
            # Objects the collector sees (not frozen), counted for full collections only;
            # the count itself walks them all, and its time lands in that step.
            tracked[0] = len(gc.get_objects()) if info["generation"] == 2 else None
            gc_seconds[1] = time.perf_counter()
            return
        ms = 1e3 * (time.perf_counter() - gc_seconds[1])
        gc_seconds[0] += ms / 1e3
        # NOTE: no gc.get_freeze_count() here: it walks every frozen object (500k once
        # LLM.generate freezes the heap), which cost ~5 s over a run's ~130 collections.
        collections.append({"generation": info["generation"], "ms": ms, "tracked": tracked[0],
                            "step": len(records)})

    gc.callbacks.append(on_gc)
    memory = torch.cuda.memory_stats()
    print(f"before the timed run: {len(gc.get_objects())} objects tracked by the collector, "
          f"{gc.get_freeze_count()} frozen")
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in w.prompts], params, use_tqdm=False)
    total = time.perf_counter() - start
    gc.callbacks.remove(on_gc)
    after = torch.cuda.memory_stats()
    allocator = {k: after.get(k, 0) - memory.get(k, 0)
                 for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")}
    print(f"Python GC during the timed run: {1e3 * gc_seconds[0]:.1f} ms; "
          f"CUDA caching allocator: {allocator}")
    for generation in range(3):
        ms = [c["ms"] for c in collections if c["generation"] == generation]
        print(f"  generation {generation}: {len(ms)} collections, {sum(ms):.1f} ms, "
              f"longest {max(ms, default=0):.1f} ms")
    for c in sorted(collections, key=lambda c: -c["ms"])[:3]:
        tracked_note = "" if c["tracked"] is None else f": {c['tracked']} objects tracked"
        print(f"  a {c['ms']:.1f} ms collection of generation {c['generation']} at step "
              f"{c['step']}{tracked_note}")
    compiled = {k: n - compiled.get(k, 0) for k, n in triton_variants().items()}
    PendingOutput.result, Engine._finish = real_result, real_finish
    sched_type.schedule, Engine._launch = real_schedule, real_launch
    new_variants = {k: n for k, n in compiled.items() if n}
    print(f"Triton kernel variants compiled during the timed run: {new_variants or 'none'}")

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
    print(f"{'steps':<14}{'n':>6}{'seconds':>9}{'ms/step':>9}{'floor ms':>10}{'of floor':>9}"
          f"{'host wait ms':>13}")
    summary = {}
    for name, rs in groups.items():
        if not rs:
            continue
        secs = sum(r["seconds"] for r in rs)
        floor = sum(r["floor"] for r in rs)
        wait = sum(r["wait"] for r in rs) / len(rs)
        summary[name] = {"steps": len(rs), "seconds": secs, "floor_s": floor, "mean_wait_s": wait}
        ratio = f"{floor / secs:.0%}" if name != "prefill" else "-"
        print(f"{name:<14}{len(rs):>6}{secs:>9.2f}{1e3 * secs / len(rs):>9.2f}"
              f"{1e3 * floor / len(rs):>10.2f}{ratio:>9}{1e3 * wait:>13.2f}")
    print("first steps: tokens, seqs, ms since the previous, host ms (schedule + launch), "
          "wait ms")
    for r in records[:12]:
        print(f"  {r['tokens']:>6} {r['seqs']:>4} {1e3 * r['seconds']:>8.2f} "
              f"{1e3 * r['host']:>8.2f} {1e3 * r['wait']:>8.2f}")
    if args.profile_prefill:
        profile_prefill(llm, w)
    if args.json:
        steps = [{k: r[k] for k in ("tokens", "seqs", "context", "seconds", "host", "wait")}
                 for r in records]
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "seconds": total, "groups": summary,
                       "new_triton_variants": new_variants, "gc_seconds": gc_seconds[0],
                       "gc_collections": collections,
                       "allocator": allocator, "steps": steps}, f, indent=1)


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


if __name__ == "__main__":
    main()
