"""Single-request latency on the GPU (BENCHMARKS.md section 2): one prompt of 512 random token
ids, 256 greedy output tokens, dummy weights; time to the first token (TTFT) and per output
token after it (TPOT), against the weight-read floor W / B per token (W: the bytes of every
weight a forward pass reads; B: the device's copy bandwidth, measured in the same process).

    python benchmarks/latency.py --model qwen3-8b [--enforce-eager] [--json out.json]
        [--profile] [--trace] [--tensor-parallel-size N] [--batch B]
        [--quantization Q] [--kv-cache-dtype fp8]

With N GPUs the floor is W / N / B (each reads its shard). With `--quantization`, W counts the
quantized weights as they are held (codes, scales and the weights left in 16 bits). `--batch B` runs B such requests
at once; TPOT is then the time of one decode step of the batch.

`--profile` then decodes once more under cProfile (where the host's time goes), `--trace`
under torch.profiler (the device's busy time and its idle gaps between kernels).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time

import torch

from octavo import LLM, RequestOutputKind, SamplingParams
from octavo.entrypoints.bench_floor import bytes_read_per_token, measure_ceilings, meta_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then decode once more under cProfile and print where the host's time goes",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="then decode once more under torch.profiler and print the device's idle gaps",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    llm = LLM(
        args.model,
        load_format="dummy",
        max_model_len=2048,
        max_num_seqs=max(8, args.batch),
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        deterministic=args.deterministic,
        **({} if args.kv_cache_dtype == "auto" else {"kv_cache_dtype": args.kv_cache_dtype}),
    )
    rng = random.Random(0)
    prompt = [rng.randint(0, 10000) for _ in range(args.prompt_len)]
    params = SamplingParams(
        temperature=0,
        max_tokens=args.output_len,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    # Warm up on other tokens of the same length: with the timed prompt itself, the prefix
    # cache would answer all but its last token and TTFT would not measure a prefill.
    warm = [rng.randint(10_001, 20_000) for _ in range(args.prompt_len)]
    llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)

    engine = llm.engine
    others = [[rng.randint(0, 10000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for other in others[1:]:
        add(engine, other, params)
    request_id = add(engine, prompt, params)
    finished, _ = step_until(engine, request_id, first_token=True)
    first = time.perf_counter()
    if not finished:
        step_until(engine, request_id)
    end = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    tpot = (end - first) / max(args.output_len - 1, 1)

    runner = engine.runner
    # One process holds the whole model at N=1; with N ranks, the floor counts bf16 weights.
    model = getattr(runner, "model", None) or meta_model(runner.hf_config, runner.dtype)
    weight_bytes = bytes_read_per_token(model)  # a mixture of experts: the k routed ones
    ceilings = measure_ceilings(runner.dtype)
    floor = weight_bytes / args.tensor_parallel_size / ceilings.copy_bytes_per_s
    report = {
        "model": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "batch": args.batch,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "ttft_s": first - start,
        "tpot_s": tpot,
        "weight_bytes": weight_bytes,
        "copy_bytes_per_s": ceilings.copy_bytes_per_s,
        "floor_s_per_token": floor,
        "tpot_over_floor": tpot / floor,
        "cuda_graphs": not args.enforce_eager,
    }
    print(
        f"{args.model}: TTFT {report['ttft_s'] * 1e3:.1f} ms, TPOT {tpot * 1e3:.2f} ms, "
        f"floor {floor * 1e3:.2f} ms/token (W {weight_bytes / 1e9:.2f} GB, "
        f"B {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s): {tpot / floor:.2f}x the floor"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.profile:
        profile_decode(
            engine, [rng.randint(20_001, 30_000) for _ in range(args.prompt_len)], params
        )
    if args.trace:
        trace = trace_decode(
            engine, [rng.randint(30_001, 40_000) for _ in range(args.prompt_len)], params
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**report, "trace": trace}, f, indent=2)


def add(engine, prompt: list[int], params: SamplingParams) -> str:
    request_id = f"latency-{time.monotonic_ns()}"
    engine.add_request(prompt, params, request_id)
    return request_id


def step_until(engine, request_id: str, first_token: bool = False) -> tuple[bool, int]:
    """Steps the engine until the request's output brings its first token (`first_token`) or
    says it finished; returns (finished, steps). The request must ask for DELTA outputs."""
    steps = 0
    while True:
        outputs = engine.step()
        steps += 1
        for out in outputs:
            if out.request_id == request_id and (
                out.finished or (first_token and out.outputs[0].token_ids)
            ):
                return out.finished, steps


def profile_decode(engine, prompt: list[int], params: SamplingParams) -> None:
    """The same single-request decode under cProfile (after the timed run, so it is not slowed)."""
    import cProfile
    import pstats

    request_id = add(engine, prompt, params)
    step_until(engine, request_id, first_token=True)  # the prefill, outside the profile
    workers = getattr(engine.runner, "profile", None)  # tensor-parallel workers profile too
    if workers:
        workers()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    _, steps = step_until(engine, request_id)
    profiler.disable()
    print(
        f"under cProfile: {steps} steps, {(time.perf_counter() - start) / steps * 1e3:.2f} ms a step"
    )
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    if workers:
        first = workers(f"/tmp/octavo_worker_{time.monotonic_ns()}")[0]
        print("tensor-parallel worker rank 0, the same steps:")
        pstats.Stats(first).sort_stats("tottime").print_stats(30)


def trace_decode(engine, prompt: list[int], params: SamplingParams) -> dict:
    """The same single-request decode under torch.profiler: per step, the wall time against
    the time the device was busy (the union of its kernels and copies), and where the device
    sat idle: each gap between two device operations, grouped by the operations around it.
    With tensor parallelism, rank 0's worker traces its own device."""
    from torch.profiler import ProfilerActivity, profile

    request_id = add(engine, prompt, params)
    finished, _ = step_until(engine, request_id, first_token=True)  # the prefill, outside
    if finished:
        raise SystemExit("--trace needs --output-len of 3 or more")
    workers = getattr(engine.runner, "profile", None)
    if workers:
        workers(trace=True)
        start = time.perf_counter()
        _, steps = step_until(engine, request_id)
        wall = time.perf_counter() - start
        with open(workers(f"/tmp/octavo_trace_{time.monotonic_ns()}", trace=True)[0]) as f:
            events = json.load(f)["traceEvents"]
        spans = sorted(
            (e["ts"], e["ts"] + e["dur"], e["name"])
            for e in events
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
        )
    else:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            _, steps = step_until(engine, request_id)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        spans = sorted(
            (e.time_range.start, e.time_range.end, e.name)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        )
    kernels: dict[str, float] = {}  # the device's time by operation (name's first 50 chars)
    for s, e, name in spans:
        kernels[name[:50]] = kernels.get(name[:50], 0.0) + (e - s)
    busy, gaps = 0.0, {}
    cur_start, cur_end, cur_name = spans[0]
    for s, e, name in spans[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            key = f"{cur_name[:45]} -> {name[:45]}"
            n, total = gaps.get(key, (0, 0.0))
            gaps[key] = (n + 1, total + (s - cur_end))
            cur_start = s
        if e >= cur_end:
            cur_end, cur_name = e, name
    busy += cur_end - cur_start
    span_us = spans[-1][1] - spans[0][0]
    out = {
        "steps": steps,
        "wall_ms_per_step": wall / steps * 1e3,
        "device_span_ms_per_step": span_us / steps / 1e3,
        "device_busy_ms_per_step": busy / steps / 1e3,
        "gaps": sorted(
            ({"between": k, "count": n, "us_per_step": t / steps} for k, (n, t) in gaps.items()),
            key=lambda g: -g["us_per_step"],
        )[:15],
        "kernels_us_per_step": dict(sorted(((k, t / steps) for k, t in kernels.items()),
                                           key=lambda kv: -kv[1])[:15]),
    }  # fmt: skip
    print(
        f"under torch.profiler: {steps} steps, wall {out['wall_ms_per_step']:.3f} ms a step; "
        f"device span {out['device_span_ms_per_step']:.3f}, busy "
        f"{out['device_busy_ms_per_step']:.3f} ms a step; idle gaps, us a step:"
    )
    for g in out["gaps"]:
        print(f"  {g['us_per_step']:8.1f}  x{g['count'] / steps:5.2f}  {g['between']}")
    print("device time by operation, us a step:")
    for name, us in out["kernels_us_per_step"].items():
        print(f"  {us:8.1f}  {name}")
    return out


if __name__ == "__main__":
    main()
