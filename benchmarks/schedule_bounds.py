"""How fast could any continuous-batching schedule run the nano-vllm workload, with perfect
kernels? A step-by-step model over the ceilings a recorded `octavo bench throughput --json`
run measured, without a GPU.

Each step decodes one token of every running request and prefills prompt chunks up to the
token budget, like octavo's scheduler. Its time is what a serial engine with ideal kernels
would take:

    step = KV read by its decode rows / B  +  max(W / B, GEMM FLOPs / F)

with GEMM FLOPs 2 x P a decode row, 2 x (P - LM head) a prompt token, and 2 x LM head a
prompt's last (attention FLOPs and the prefill's KV writes left out). With every request
admitted at once it comes near `fcfs_serial_estimate` (octavo/entrypoints/bench_floor.py),
which runs all prompts before any decode. Admission is first come, first
served, or longest output first (which needs the output lengths up front, as only a
benchmark with ignore_eos knows them); `max_num_seqs` caps the running batch.

    PYTHONPATH=. python benchmarks/schedule_bounds.py qwen3-8b \
        docs/results/gpu/h200/session16/final/throughput_qwen3_8b.json
"""

from __future__ import annotations

import argparse
import json

from benchmarks.serial_bounds import recorded_work
from octavo.entrypoints.bench_floor import DeviceCeilings, SerialWork


def schedule_seconds(
    work: SerialWork, ceilings: DeviceCeilings, order: list[int], cap: int, budget: int
) -> tuple[float, int]:
    """Modelled seconds and steps of the workload under one admission order and cap."""
    prompts, outputs = work.prompt_lens, work.output_lens
    bandwidth, flops_per_s = ceilings.copy_bytes_per_s, ceilings.matmul_flops
    weight_bytes, kv_per_token = work.weight_bytes, work.kv_bytes_per_token
    params, head_params = work.num_params, work.head_params
    waiting, prefilling, decoding = list(order), {}, {}  # id -> prompt left / tokens out
    seconds, steps = 0.0, 0
    while waiting or prefilling or decoding:
        while waiting and len(prefilling) + len(decoding) < cap:
            i = waiting.pop(0)
            prefilling[i] = prompts[i]
        tokens = len(decoding)
        flops = 2 * params * tokens
        kv = kv_per_token * sum(prompts[i] + n for i, n in decoding.items())
        prefilled = []
        for i in list(prefilling):
            chunk = min(prefilling[i], budget - tokens)
            if chunk <= 0:
                break
            tokens += chunk
            flops += 2 * (params - head_params) * chunk
            prefilling[i] -= chunk
            if prefilling[i] == 0:
                prefilled.append(i)
                flops += 2 * head_params
        seconds += kv / bandwidth + max(weight_bytes / bandwidth, flops / flops_per_s)
        steps += 1
        for i in list(decoding):
            decoding[i] += 1
            if decoding[i] >= outputs[i]:
                del decoding[i]
        for i in prefilled:  # the prefill's last chunk samples the first output token
            del prefilling[i]
            if outputs[i] > 1:
                decoding[i] = 1
    return seconds, steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="a bundled config name, e.g. qwen3-8b")
    parser.add_argument("result", help="a throughput JSON with a 'floor' entry")
    parser.add_argument("--budget", type=int, default=16384, help="tokens a step")
    parser.add_argument("--caps", type=int, nargs="+", default=[256, 224, 192, 160, 128])
    args = parser.parse_args()
    with open(args.result) as f:
        result = json.load(f)
    floor = result["floor"]
    work, ceilings = recorded_work(args.model, result)
    ids = range(len(work.prompt_lens))
    orders = {
        "first come": list(ids),
        "longest output first": sorted(ids, key=lambda i: -work.output_lens[i]),
    }
    measured = result["results"][0]["seconds"]
    print(f"{args.model}, {args.result}: floor {floor['seconds']:.2f} s; octavo measured "
          f"{measured:.2f} s")  # fmt: skip
    print(f"{'max_num_seqs':>12} | " + " | ".join(f"{name:>28}" for name in orders))
    for cap in args.caps:
        cells = []
        for order in orders.values():
            seconds, steps = schedule_seconds(work, ceilings, order, cap, args.budget)
            cells.append(f"{seconds:6.2f} s, {floor['seconds'] / seconds:5.1%}, {steps:4} steps")
        print(f"{cap:>12} | " + " | ".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
