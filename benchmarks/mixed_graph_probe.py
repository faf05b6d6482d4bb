"""What CUDA graphs for prefill and mixed steps buy: TTFT of one prompt, and online serving.

    PYTHONPATH=. python benchmarks/mixed_graph_probe.py --model qwen3-0.6b [--json out.json]

Each setting builds its own engine (dummy weights, 2,048 tokens a step), in a process of its
own, and runs both parts:
- `graphs`: the default, steps of up to 512 tokens replayed as CUDA graphs;
- `eager`: cuda_graph_max_tokens=0, i.e. decode graphs only, as before.

TTFT: one prompt of L fresh random tokens at a time on an idle engine, from add_request to the
first token on the host; the median of --reps. Its floor is the larger of the prefill's
FLOPs (2 x non-embedding parameters x L) over the matmul rate and the weight bytes over the
copy bandwidth, both measured in this process. The peer is HF transformers on the same
config: one forward over the prompt and an argmax, timed the same way.

Serving: requests arrive as a Poisson process (seeded) at each --rate, prompts of 64-512
fresh random tokens, --output-len greedy tokens each (ignore_eos), driven in process through
Engine.add_request / step (no HTTP). Per request: TTFT from its arrival time, TPOT, and every
inter-token gap (ITL), as vLLM's `bench serve` defines them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from octavo import LLM, SamplingParams
from octavo.entrypoints.bench_floor import measure_ceilings, weights_read_per_step

SETTINGS = {"graphs": 512, "eager": 0}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ttft_once(engine, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    request = engine.add_request(prompt, params)
    while not request.output_token_ids:
        engine.step()
    first = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return first


def measure_ttft(engine, lengths: list[int], reps: int, rng: random.Random) -> dict[int, float]:
    """Median TTFT (s) per prompt length; one unmeasured prompt of each length first."""
    result = {}
    for length in lengths:
        ttft_once(engine, [rng.randint(0, 10000) for _ in range(length)])
        times = [
            ttft_once(engine, [rng.randint(0, 10000) for _ in range(length)]) for _ in range(reps)
        ]
        result[length] = statistics.median(times)
    return result


def serve(
    engine, rate: float, num_requests: int, output_len: int, seed: int,
    prompt_lens: tuple[int, int] = (64, 512),
) -> dict:  # fmt: skip
    """Poisson arrivals at `rate` req/s through the engine, prompts of `prompt_lens` random
    tokens; vLLM's serving metrics."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
    top = min(10000, engine.vocab_size - 1)  # ids below 10,000, as on the GPU; a tiny model's
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(*prompt_lens))] for _ in arrivals]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    live: dict[str, tuple[object, float, list[float]]] = {}  # id -> (request, arrival, times)
    done: list[tuple[float, list[float]]] = []
    start = time.perf_counter()
    sent = 0
    while sent < num_requests or live:
        now = time.perf_counter() - start
        while sent < num_requests and arrivals[sent] <= now:
            request = engine.add_request(prompts[sent], params)
            live[request.request_id] = (request, arrivals[sent], [])
            sent += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[sent] - now))
            continue
        engine.step()
        now = time.perf_counter() - start
        for request_id, (request, arrival, times) in list(live.items()):
            times += [now] * (len(request.output_token_ids) - len(times))
            if request.is_finished:
                done.append((arrival, times))
                del live[request_id]
    elapsed = time.perf_counter() - start
    ttft = [times[0] - arrival for arrival, times in done]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for _, times in done if len(times) > 1]
    itl = [b - a for _, times in done for a, b in itertools.pairwise(times) if b > a]
    metrics = {"rate": rate, "requests": len(done), "seconds": elapsed}
    metrics["output_tok_s"] = sum(len(times) for _, times in done) / elapsed
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        metrics[f"{name}_mean_ms"] = 1e3 * statistics.mean(values)
        metrics[f"{name}_median_ms"] = 1e3 * statistics.median(values)
        metrics[f"{name}_p99_ms"] = 1e3 * percentile(values, 0.99)
    return metrics


def hf_ttft(model_name: str, lengths: list[int], reps: int) -> dict[int, float]:
    """HF transformers, the same config with random bf16 weights: a forward over the prompt
    and the argmax of its last logits, to the host; the median of `reps` per length."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from octavo.engine.builder import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(model_name))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    result = {}
    with torch.inference_mode():
        for length in lengths:
            times = []
            for _ in range(reps + 1):
                ids = torch.randint(0, 10000, (1, length))
                torch.cuda.synchronize()
                start = time.perf_counter()
                logits = model(ids.cuda(), logits_to_keep=1).logits
                logits[0, -1].argmax().item()
                times.append(time.perf_counter() - start)
            result[length] = statistics.median(times[1:])
    del model
    torch.cuda.empty_cache()
    return result


def run_setting(args: argparse.Namespace) -> dict:
    """One part in this process: the HF peer's TTFT, or one engine setting's TTFT and
    serving (with the floor, measured beside it)."""
    if args.setting == "hf":
        report = {"ttft_s": hf_ttft(args.model, args.lengths, args.reps)}
        free, total = torch.cuda.mem_get_info()
        report["gpu_bytes_in_use_after"] = total - free
        return report
    start = time.perf_counter()
    llm = LLM(
        args.model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=2048,
        cuda_graph_max_tokens=SETTINGS[args.setting],
    )  # fmt: skip
    engine = llm.engine
    report = {"startup_s": time.perf_counter() - start}
    report["ttft_s"] = measure_ttft(engine, args.lengths, args.reps, random.Random(1))
    report["serving"] = [
        serve(engine, rate, args.num_requests, args.output_len, seed=2) for rate in args.rates
    ]
    model = engine.runner.model
    weights = weights_read_per_step(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    params = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    ceilings = measure_ceilings(engine.runner.dtype)
    report["ceilings"] = vars(ceilings)
    report["floor_s"] = {
        n: max(2 * params * n / ceilings.matmul_flops, weight_bytes / ceilings.copy_bytes_per_s)
        for n in args.lengths
    }
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 128, 256, 512, 2048])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rates", type=float, nargs="+", default=[8.0, 32.0])
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--setting", default=None, choices=[*SETTINGS, "hf"], help="one part")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.setting is not None:
        with open(args.json, "w") as f:
            json.dump(run_setting(args), f, indent=2, default=str)
        return

    # Each part in a process of its own, so that none inherits another's GPU memory.
    report: dict = {"model": args.model}
    for setting in (*SETTINGS, "hf"):
        with tempfile.NamedTemporaryFile(suffix=".json") as part:
            argv = [a for a in sys.argv[1:]]
            if "--json" in argv:
                del argv[argv.index("--json") : argv.index("--json") + 2]
            argv += ["--setting", setting, "--json", part.name]
            subprocess.run([sys.executable, __file__, *argv], check=True)
            with open(part.name) as f:
                report[setting] = json.load(f)
    floor = {int(n): v for n, v in report["graphs"]["floor_s"].items()}
    ttft = {
        name: {int(n): v for n, v in report[name]["ttft_s"].items()} for name in (*SETTINGS, "hf")
    }
    print(
        f"{args.model}: TTFT median ms (start-up s: "
        + ", ".join(f"{n} {report[n]['startup_s']:.1f}" for n in SETTINGS)
        + f"; HF left {report['hf']['gpu_bytes_in_use_after'] / 2**30:.1f} GiB in use)"
    )
    print(f"{'tokens':>7}{'floor':>8}{'graphs':>8}{'eager':>8}{'HF':>8}{'graphs/floor':>14}")
    for n in args.lengths:
        row = [floor[n], ttft["graphs"][n], ttft["eager"][n], ttft["hf"][n]]
        print(f"{n:>7}" + "".join(f"{1e3 * v:>8.2f}" for v in row) + f"{row[1] / row[0]:>14.1f}")
    print(
        f"{'serving':<9}{'rate':>6}{'tok/s':>8}{'TTFT mean':>10}{'p99':>8}"
        f"{'TPOT mean':>10}{'ITL mean':>9}{'p99':>8}  (ms)"
    )
    for name in SETTINGS:
        for m in report[name]["serving"]:
            print(
                f"{name:<9}{m['rate']:>6.0f}{m['output_tok_s']:>8.0f}{m['ttft_mean_ms']:>10.2f}"
                f"{m['ttft_p99_ms']:>8.2f}{m['tpot_mean_ms']:>10.2f}{m['itl_mean_ms']:>9.2f}"
                f"{m['itl_p99_ms']:>8.2f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)


if __name__ == "__main__":
    main()
