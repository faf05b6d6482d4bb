"""Tensor parallelism's floor on N GPUs and the all-reduce's cost, measured in this run.

    python benchmarks/tp_bench.py --model qwen3-8b --tp 2 [--bench B.json ...]
        [--latency L.json ...] [--json out.json]

1. NCCL all-reduce over N GPUs (one process each): the bus bandwidth at 256 MiB, and one
   all-reduce of [B, hidden] bf16 for B = 1 and 256, replayed from a CUDA graph of 100 as
   the engine's graphs run them.
2. The nano-vllm workload's floor on N GPUs: the one-GPU floor (bench_floor over the whole
   model; ceilings measured here) over N, plus the all-reduce traffic over the bus bandwidth
   (every token crosses 2 x layers all-reduces of hidden x 2 bytes; each GPU moves
   2 (N - 1) / N of a message).
3. Each `octavo bench throughput --json` result given against that floor; for each
   benchmarks/latency.py JSON, the all-reduces' share of its decode step.
Run it while no engine holds the GPUs.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from octavo.checkpoint.hf_config import load_hf_config
from octavo.engine.builder import resolve_model
from octavo.entrypoints.bench_floor import measure_ceilings, meta_model, workload_floor
from octavo.entrypoints.bench_throughput import nanovllm_workload
from octavo.model.parallel import all_reduce, set_tp, use_symmetric_memory

BIG = 256 << 20
GRAPH_CALLS = 100


def _all_reduce_worker(rank: int, size: int, hidden: int, out_path: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method="tcp://127.0.0.1:29571", rank=rank, world_size=size,
        device_id=torch.device("cuda", rank),
    )  # fmt: skip
    big = torch.ones(BIG // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        dist.all_reduce(big)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        dist.all_reduce(big)
    end.record()
    torch.cuda.synchronize()
    big_s = start.elapsed_time(end) / 1e3 / 10
    result = {"bus_bytes_per_s": BIG * 2 * (size - 1) / size / big_s, "us": {}, "symm_us": {}}
    set_tp(rank, size, dist.group.WORLD)
    symm = use_symmetric_memory(torch.device("cuda", rank))
    if symm:  # the one-shot sum is the sum
        check = torch.full((3, hidden), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        assert all_reduce(check).eq(size * (size + 1) / 2).all().item()
    for rows in (1, 256):
        x = torch.ones(rows, hidden, dtype=torch.bfloat16, device="cuda")
        result["us"][rows] = _graph_us(lambda x=x: dist.all_reduce(x), start, end)
        if symm:
            result["symm_us"][rows] = _graph_us(lambda x=x: all_reduce(x), start, end)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    torch.cuda.synchronize()
    dist.barrier()
    os._exit(0)  # NOTE: tearing the group down after graph capture can wait forever


def _graph_us(op, start, end) -> float:
    """Microseconds of one `op`, replayed from a CUDA graph of GRAPH_CALLS of them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            op()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            op()
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / 5 / GRAPH_CALLS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--bench", nargs="*", default=[])
    parser.add_argument("--latency", nargs="*", default=[])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cfg = load_hf_config(resolve_model(args.model))
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    path = f"/tmp/tp_bench_allreduce_{args.tp}.json"
    ctx = mp.start_processes(
        _all_reduce_worker, args=(args.tp, hidden, path), nprocs=args.tp, join=False
    )
    ctx.join(timeout=120)
    for proc in ctx.processes:
        proc.kill()
    with open(path) as f:
        ar = json.load(f)
    ceilings = measure_ceilings(torch.bfloat16)
    w = nanovllm_workload()
    prompt_lens = [len(p) for p in w.prompts]
    one = workload_floor(
        meta_model(cfg, torch.bfloat16), cfg, torch.bfloat16, prompt_lens, w.max_tokens, ceilings
    )
    tokens = sum(prompt_lens) + sum(w.max_tokens)
    ar_bytes = tokens * 2 * layers * hidden * 2 * 2 * (args.tp - 1) / args.tp
    ar_s = ar_bytes / ar["bus_bytes_per_s"]
    floor_s = one.seconds / args.tp + ar_s
    # The same over N for the serial bounds (a step's KV reads, then its GEMMs; see bench_floor).
    serial_s, fcfs_s = one.serial_s / args.tp + ar_s, one.fcfs_serial_s / args.tp + ar_s
    report = {
        "model": args.model,
        "tp": args.tp,
        "device": torch.cuda.get_device_name(0),
        "copy_bytes_per_s": ceilings.copy_bytes_per_s,
        "matmul_flops": ceilings.matmul_flops,
        "allreduce_bus_bytes_per_s": ar["bus_bytes_per_s"],
        "allreduce_us": ar["us"],
        "floor_one_gpu_s": one.seconds,
        "floor_allreduce_s": ar_s,
        "floor_s": floor_s,
        "serial_floor_s": serial_s,
        "fcfs_estimate_s": fcfs_s,
        "output_tokens": sum(w.max_tokens),
        "results": [],
        "decode_steps": [],
    }
    print(
        f"{args.model} on {args.tp} x {report['device']}: all-reduce bus "
        f"{ar['bus_bytes_per_s'] / 1e9:.0f} GB/s, [1, {hidden}] {ar['us']['1']:.1f} us, "
        f"[256, {hidden}] {ar['us']['256']:.1f} us (symmetric memory, one shot: "
        f"{ar['symm_us'].get('1', 0):.1f} / {ar['symm_us'].get('256', 0):.1f} us); "
        f"nano-vllm floor {floor_s:.2f} s "
        f"({one.seconds:.2f} s / {args.tp} + all-reduce {ar_s:.2f} s); serial floor "
        f"{serial_s:.2f} s, FCFS estimate {fcfs_s:.2f} s"
    )
    for path in args.bench:
        with open(path) as f:
            first = json.load(f)["results"][0]
        seconds = first["seconds"]
        report["results"].append({
            "file": path, "seconds": seconds, "of_floor": floor_s / seconds,
            "of_serial_floor": serial_s / seconds, "of_fcfs_estimate": fcfs_s / seconds,
        })  # fmt: skip
        print(
            f"  {path}: {first['tok_per_s']:.0f} tok/s, {floor_s / seconds:.1%} of the floor, "
            f"{serial_s / seconds:.1%} of the serial floor, {fcfs_s / seconds:.1%} of the FCFS "
            "estimate"
        )
    for path in args.latency:
        with open(path) as f:
            lat = json.load(f)
        rows = "1" if lat["batch"] == 1 else "256"
        used = ar["symm_us"] or ar["us"]  # what the engine's all-reduces ran
        share = 2 * layers * used[rows] / 1e6 / lat["tpot_s"]
        report["decode_steps"].append(
            {"file": path, "batch": lat["batch"], "tpot_s": lat["tpot_s"], "allreduce_share": share}
        )
        print(
            f"  {path}: batch {lat['batch']}, step {lat['tpot_s'] * 1e3:.2f} ms, all-reduces "
            f"{share:.1%} of it (2 x {layers} x {used[rows]:.1f} us)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
