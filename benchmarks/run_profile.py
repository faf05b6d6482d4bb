"""Where the device time of the whole nano-vllm run goes: every kernel of the timed run, by the
step that launched it (prefill or decode, and the decode batch) and by what it is (attention,
the rest of the layers, the LM head and sampler).

It answers one question: how close could the run come to its floor if all of a decode step's
work besides attention (GEMMs, norms, activations, LM head, sampler) took only its own floor,
max(weight bytes / B, 2 x params x batch / F), and nothing else changed (of a mixture of
experts' experts, the bytes count those the batch reaches, bench_floor's step_weight_bytes,
and the parameters the k a token multiplies by)? That is the most any faster GEMM, fusion
or megakernel outside attention could give. Two more lines add decode attention at its KV read
(KV bytes / B), then the prefill steps at their GEMMs' FLOPs / F: the run of a serial engine
whose every kernel ran at its floor, its host gaps kept.

Each `engine.step()` call runs inside a profiler annotation, and the shape of the step it
schedules (and launches) is kept. A kernel belongs to the step whose annotation holds the
runtime call that launched it (graph replays included), found through CUPTI's correlation
ids. The run is timed once without the profiler, then once under it with other prompt tokens
of the same lengths (so the prefix cache holds none of them), in the same process.

    python benchmarks/run_profile.py [--model qwen3-0.6b] [--json out.json]
        [--decode-config block_n=64,num_stages=3] [--unfused-decode] [--deterministic]
        [--quantization fp8]

`--decode-config` overrides the decode attention kernel's tile; `--unfused-decode` makes
decode steps store K/V with a kernel of their own instead of inside the attention kernel.
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from collections import defaultdict

import torch
from step_timeline import describe
from torch.profiler import ProfilerActivity, profile, record_function

from octavo import LLM, SamplingParams
from octavo.entrypoints.bench_floor import serial_work
from octavo.entrypoints.bench_throughput import measured_floor, nanovllm_workload

BUCKETS = [(1, 16), (17, 64), (65, 128), (129, 192), (193, 256)]
CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def kernel_class(name: str) -> str:
    if "_decode" in name or "_prefill_kernel" in name or "_combine_splits" in name:
        return "attention"
    return "rest"


def annotate_steps(engine):
    """Runs each `engine.step()` call inside a profiler annotation `octavo_step:<i>` and keeps
    the shape of the step scheduled in call i (None if it scheduled nothing): with or without
    async scheduling, the kernels a call launches are those of the step it schedules.
    Returns (shapes, undo)."""
    shapes: list[dict | None] = []
    real_step, real_schedule = engine.step, engine.scheduler.schedule

    def schedule():
        so = real_schedule()
        shapes[-1] = None if so.is_empty else describe(so)
        return so

    def step():
        shapes.append(None)
        with record_function(f"octavo_step:{len(shapes) - 1}"):
            return real_step()

    def undo():
        engine.step, engine.scheduler.schedule = real_step, real_schedule

    engine.step, engine.scheduler.schedule = step, schedule
    return shapes, undo


def step_annotations(events) -> list:
    """The host's annotations of the steps (not their copies on the device's timeline)."""
    return [e for e in events if e.device_type() == CPU and e.name().startswith("octavo_step:")]


def step_key(shape: dict) -> tuple[str, int]:
    """(prefill or decode, batch) of a step's shape from `describe`."""
    return ("decode" if shape["tokens"] == shape["seqs"] else "prefill"), shape["seqs"]


def attribute(events, shapes: list[dict | None]) -> tuple[dict, dict, dict]:
    """(device us per (step kind, batch, class), device us found in no step, per class,
    device us of decode steps per kernel name)."""
    steps = sorted((e.start_ns(), e.end_ns(), e.name()) for e in step_annotations(events))
    starts = [s[0] for s in steps]
    launch_at = {}  # correlation id -> host ns of the runtime or driver call
    for e in events:
        # cudaLaunchKernel, cudaGraphLaunch, cudaMemcpyAsync, Triton's cuLaunchKernelEx ...
        if e.device_type() == CPU and e.name().startswith("cu"):
            launch_at[e.correlation_id()] = e.start_ns()
    totals: dict[tuple[str, int, str], float] = defaultdict(float)
    lost: dict[str, float] = defaultdict(float)  # device us outside any step, by class
    by_name: dict[str, float] = defaultdict(float)
    for e in events:
        if e.device_type() != CUDA or e.name().startswith("octavo_step:"):
            continue  # the annotation's copy on the device's timeline is no work
        at = launch_at.get(e.correlation_id()) or launch_at.get(e.linked_correlation_id())
        i = bisect.bisect_right(starts, at) - 1 if at is not None else -1
        shape = shapes[int(steps[i][2].split(":")[1])] if i >= 0 and at <= steps[i][1] else None
        if shape is None:
            lost[kernel_class(e.name())] += e.duration_ns() / 1e3
            continue
        totals[(*step_key(shape), kernel_class(e.name()))] += e.duration_ns() / 1e3
        if step_key(shape)[0] == "decode":
            by_name[e.name()] += e.duration_ns() / 1e3
    return totals, lost, by_name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--decode-config",
        default=None,
        help="the decode kernel's knobs, e.g. block_n=64,num_stages=3",
    )
    parser.add_argument(
        "--unfused-decode",
        action="store_true",
        help="decode steps store K/V in a kernel of their own, not in the attention kernel",
    )
    parser.add_argument("--deterministic", action="store_true", help="LLM(deterministic=True)")
    parser.add_argument("--quantization", default="none", help="LLM(quantization=...)")
    args = parser.parse_args()
    if args.unfused_decode:
        from octavo.attention.triton_backend import TritonAttentionBackend

        TritonAttentionBackend.decodes_from_qkv = False
    if args.decode_config:  # before the engine captures its graphs
        from octavo.kernels import decode_attention

        knobs = dict(kv.split("=") for kv in args.decode_config.split(","))
        default = decode_attention.default_decode_config
        decode_attention.default_decode_config = lambda d: (
            default(d) | {k: int(v) for k, v in knobs.items()}
        )
    # nano-vllm's settings for its workload, as `octavo bench throughput --workload nanovllm`.
    llm = LLM(args.model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=16384,
              deterministic=args.deterministic, quantization=args.quantization)  # fmt: skip
    runner = llm.engine.runner
    w = nanovllm_workload()
    fl, ceil = measured_floor(llm, w)
    prompts = [{"prompt_token_ids": p} for p in w.prompts]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in w.max_tokens]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    plain_s = time.perf_counter() - start

    # The same lengths in other tokens, so that the prefix cache holds none of them.
    fresh = [{"prompt_token_ids": [t + 10_001 for t in p]} for p in w.prompts]
    shapes, undo = annotate_steps(llm.engine)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            llm.generate(fresh, params, use_tqdm=False)
            profiled_s = time.perf_counter() - start
    finally:
        undo()
    totals, lost, by_name = attribute(prof.profiler.kineto_results.events(), shapes)

    bandwidth, flops = ceil.copy_bytes_per_s, ceil.matmul_flops
    work = serial_work(runner.model, runner.hf_config, runner.kv_cache_dtype,
                       [len(p) for p in w.prompts], w.max_tokens)  # fmt: skip

    def rest_floor_us(batch: int) -> float:  # the weights a step of `batch` tokens reaches
        return 1e6 * work.gemm_seconds(batch, ceil)

    steps: dict[tuple[str, int], int] = defaultdict(int)
    contexts: dict[tuple[str, int], int] = defaultdict(int)  # positions attended, summed
    for shape in shapes:
        if shape is not None:
            steps[step_key(shape)] += 1
            contexts[step_key(shape)] += shape["context"]
    # Each step the run scheduled at its own floor: the weights its tokens reach or its
    # FLOPs, then its KV reads. Against the workload floor it prices the schedule (how many
    # steps, at which batches, as the KV cache's size allows); against the run, the kernels.
    schedule_s = sum(
        rest_floor_us(shape["tokens"]) / 1e6 + shape["context"] * fl.kv_bytes_per_token / bandwidth
        for shape in shapes if shape is not None
    )  # fmt: skip
    rows = []
    groups = [("prefill", lambda k, b: k == "prefill")] + [
        (f"decode {lo}-{hi}", lambda k, b, lo=lo, hi=hi: k == "decode" and lo <= b <= hi)
        for lo, hi in BUCKETS
    ]
    for name, inside in groups:
        n = sum(c for (k, b), c in steps.items() if inside(k, b))
        attn = sum(us for (k, b, c), us in totals.items() if inside(k, b) and c == "attention")
        rest = sum(us for (k, b, c), us in totals.items() if inside(k, b) and c == "rest")
        floor = sum(c * rest_floor_us(b) for (k, b), c in steps.items() if inside(k, b))
        kv = sum(c for (k, b), c in contexts.items() if inside(k, b)) * fl.kv_bytes_per_token
        rows.append(
            {
                "steps": name,
                "n": n,
                "attention_s": attn / 1e6,
                "rest_s": rest / 1e6,
                "rest_floor_s": floor / 1e6 if name != "prefill" else None,
                "kv_read_s": kv / bandwidth if name != "prefill" else None,
            }
        )
    busy = sum(r["attention_s"] + r["rest_s"] for r in rows)
    decode_rest = sum(r["rest_s"] for r in rows if r["rest_floor_s"] is not None)
    decode_floor = sum(r["rest_floor_s"] for r in rows if r["rest_floor_s"] is not None)
    bound = plain_s - decode_rest + decode_floor
    decode_attn = sum(r["attention_s"] for r in rows if r["rest_floor_s"] is not None)
    both = bound - decode_attn + fl.kv_read_bytes / bandwidth  # attention at its KV read too
    # and the prefill steps at their GEMMs' FLOPs (prompts use the LM head at their last token)
    prefill_flops = work.prefill_flops()
    prefill_s = rows[0]["attention_s"] + rows[0]["rest_s"]
    every = both - prefill_s + prefill_flops / flops

    print(
        f"{args.model}: copy {bandwidth / 1e12:.2f} TB/s, matmul {flops / 1e12:.0f} TFLOP/s; "
        f"workload floor {fl.seconds:.2f} s"
    )
    kv, sched = llm.engine.kv, llm.engine.scheduler
    print(f"KV cache: {kv.pool.num_total_blocks * kv.block_size} tokens; "
          f"{sched.num_preemptions} preemptions over both runs")  # fmt: skip
    print(
        f"timed run {plain_s:.2f} s ({fl.seconds / plain_s:.1%} of the floor); under the "
        f"profiler {profiled_s:.2f} s, device busy {busy:.2f} s in steps; outside any step: "
        f"{ {c: round(us / 1e6, 3) for c, us in lost.items()} } s"
    )
    print(
        f"the profiled run's {sum(steps.values())} steps, each at its own floor: {schedule_s:.2f} s "
        f"(the workload floor is {fl.seconds / schedule_s:.1%} of it, the profiled run "
        f"{schedule_s / profiled_s:.1%})"
    )
    print(
        f"{'steps':<15}{'n':>6}{'attention s':>13}{'KV read s':>11}{'rest s':>9}"
        f"{'rest floor s':>14}"
    )
    for r in rows:
        floor = "-" if r["rest_floor_s"] is None else f"{r['rest_floor_s']:.3f}"
        kv = "-" if r["kv_read_s"] is None else f"{r['kv_read_s']:.3f}"
        print(
            f"{r['steps']:<15}{r['n']:>6}{r['attention_s']:>13.3f}{kv:>11}{r['rest_s']:>9.3f}"
            f"{floor:>14}"
        )
    print(f"decode steps' rest: {decode_rest:.3f} s against a floor of {decode_floor:.3f} s")
    print(
        f"the timed run with every decode step's rest at its floor: {bound:.2f} s, "
        f"{fl.seconds / bound:.1%} of the floor"
    )
    print(
        f"and decode attention at its KV read too ({decode_attn:.3f} s -> "
        f"{fl.kv_read_bytes / bandwidth:.3f} s): {both:.2f} s, {fl.seconds / both:.1%} of the floor"
    )
    print(
        f"and the prefill steps at their GEMM FLOPs too ({prefill_s:.3f} s -> "
        f"{prefill_flops / flops:.3f} s): {every:.2f} s, {fl.seconds / every:.1%} of the floor"
    )
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    print("decode steps' kernels, the most device time first:")
    for name, us in top:
        print(f"{us / 1e6:9.3f} s  {name[:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "copy_bytes_per_s": bandwidth,
                    "matmul_flops": flops,
                    "floor_s": fl.seconds,
                    "plain_s": plain_s,
                    "profiled_s": profiled_s,
                    "device_busy_s": busy,
                    "outside_steps_us": lost,
                    "groups": rows,
                    "schedule_floor_s": schedule_s,
                    "bound_s": bound,
                    "bound_with_attention_s": both,
                    "bound_with_prefill_s": every,
                    "decode_kernels_us": dict(top),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
