"""One prefill step and one decode step on the GPU: device time kernel by kernel, and the host's
launch time against the device's run time.

The host launch time is measured with the device held busy by a sleep kernel queued first, so
the device never waits for the host; the device time is then the time between two events
around the step's work. Kernel times come from torch.profiler over a few steps (the kernels of
a CUDA-graph replay are listed one by one too).

    PYTHONPATH=. python benchmarks/step_profile.py [--model qwen3-0.6b] [--batch 256]
        [--context 1024] [--prefill-tokens 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from octavo import LLM, SamplingParams
from octavo.entrypoints.bench_floor import measure_ceilings, workload_floor


def read_bandwidth() -> float:
    """Bytes per second of a read-only pass (a sum over 2 GiB of bf16), median of 10."""
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(11):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.sum(dtype=torch.float32)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / sorted(times[1:])[5]


def timed_launch(engine, so) -> tuple[float, float]:
    """(host seconds to launch the step, device seconds to run it) and finishes the step."""
    torch.cuda.synchronize()
    torch.cuda._sleep(300_000_000)  # ~150 ms: the host launches while the device sleeps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    pending = engine.runner.execute_async(so)
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    engine._finish(so, pending)
    return host, start.elapsed_time(end) / 1e3


def kernel_table(prof, steps: int, top: int = 25) -> list[dict]:
    rows = []
    for evt in prof.key_averages():
        us = evt.self_device_time_total
        if us <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        rows.append({"kernel": evt.key[:90], "calls_per_step": evt.count / steps,
                     "us_per_step": us / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    print(f"  {'kernel':<90}{'calls':>7}{'us/step':>10}{'share':>7}")
    for r in rows[:top]:
        print(f"  {r['kernel']:<90}{r['calls_per_step']:>7.1f}{r['us_per_step']:>10.1f}"
              f"{r['us_per_step'] / total:>7.1%}")
    print(f"  {'all kernels':<90}{'':>7}{total:>10.1f}")
    return rows


def profiled_steps(engine, steps: int):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            so = engine.scheduler.schedule()
            engine._finish(so, engine.runner.execute_async(so))
        torch.cuda.synchronize()
    return prof


def add(engine, rng: random.Random, n: int, length: int, max_tokens: int) -> None:
    vocab = min(engine.vocab_size, 10000)
    for _ in range(n):
        ids = [rng.randrange(vocab) for _ in range(length)]
        engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.6,
                                               ignore_eos=True))


def drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=4096,
              max_num_batched_tokens=args.prefill_tokens)
    engine, runner = llm.engine, llm.engine.runner
    engine.async_scheduling = False
    rng = random.Random(0)
    report: dict = {"model": args.model}

    ceilings = measure_ceilings(runner.dtype)
    read_bw = read_bandwidth()
    print(f"copy {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s, read-only sum "
          f"{read_bw / 1e12:.2f} TB/s, matmul {ceilings.matmul_flops / 1e12:.0f} TFLOP/s")
    report["copy_bytes_per_s"], report["read_bytes_per_s"] = ceilings.copy_bytes_per_s, read_bw

    # ---- prefill: chunks of prefill_tokens over 1024-token prompts ----
    per = 1024
    n = args.prefill_tokens // per
    add(engine, rng, n, per, 1)  # warm-up
    drain(engine)
    prefill = []
    for _ in range(3):
        add(engine, rng, n, per, 1)
        so = engine.scheduler.schedule()
        prefill.append(timed_launch(engine, so))
        drain(engine)
    host = sorted(p[0] for p in prefill)[1]
    dev = sorted(p[1] for p in prefill)[1]
    flops = 2 * sum(p.numel() for p in runner.model.parameters()) * args.prefill_tokens
    print(f"\nprefill step, {args.prefill_tokens} tokens: host launch {host * 1e3:.1f} ms, "
          f"device {dev * 1e3:.1f} ms ({flops / dev / 1e12:.0f} TFLOP/s incl. embedding)")
    add(engine, rng, n, per, 1)
    report["prefill"] = {"host_s": host, "device_s": dev,
                         "kernels": kernel_table(profiled_steps(engine, 1), 1)}
    drain(engine)

    # ---- decode at batch x context ----
    add(engine, rng, args.batch, args.context, 64)
    while True:
        so = engine.scheduler.schedule()
        all_decode = so.num_batched_tokens == len(so.scheduled)
        if all_decode:
            break
        engine._finish(so, runner.execute_async(so))
    engine._finish(so, runner.execute_async(so))
    fl = workload_floor(runner.model, runner.hf_config, runner.dtype, [args.context], [1],
                        ceilings)
    step_floor = (args.batch * (args.context + 4) * fl.kv_bytes_per_token + fl.weight_bytes) / (
        ceilings.copy_bytes_per_s
    )
    for mode in ("graph", "eager"):
        graphs = runner.graph_runner
        if mode == "eager":
            runner.graph_runner = None
        timings = []
        for _ in range(5):
            so = engine.scheduler.schedule()
            timings.append(timed_launch(engine, so))
        host = sorted(t[0] for t in timings)[2]
        dev = sorted(t[1] for t in timings)[2]
        print(f"\ndecode step ({mode}), batch {args.batch} x context ~{args.context}: host launch "
              f"{host * 1e3:.2f} ms, device {dev * 1e3:.2f} ms, floor {step_floor * 1e3:.2f} ms "
              f"({step_floor / dev:.0%})")
        report[f"decode_{mode}"] = {"host_s": host, "device_s": dev, "floor_s": step_floor,
                                   "kernels": kernel_table(profiled_steps(engine, 4), 4)}
        runner.graph_runner = graphs
    drain(engine)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
