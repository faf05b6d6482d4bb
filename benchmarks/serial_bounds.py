"""The serial floor and the FCFS serial estimate (octavo/entrypoints/bench_floor.py) of the
nano-vllm workload, from the ceilings a recorded `octavo bench throughput --json` run measured,
without a GPU: for bounds of runs made before the bench printed them, or on other machines.

    PYTHONPATH=. python benchmarks/serial_bounds.py qwen3-8b docs/results/gpu/h200/throughput_qwen3_8b.json
"""

from __future__ import annotations

import argparse
import json

from octavo.engine.builder import resolve_model
from octavo.entrypoints.bench_floor import (
    DeviceCeilings,
    SerialWork,
    fcfs_serial_estimate,
    serial_floor,
)
from octavo.entrypoints.bench_throughput import nanovllm_workload
from octavo.model.hf_config import load_hf_config


def recorded_work(model: str, result: dict) -> tuple[SerialWork, DeviceCeilings]:
    """The nano-vllm workload's SerialWork for `model` and the ceilings that a recorded
    `octavo bench throughput --json` result measured."""
    floor = result["floor"]
    cfg = load_hf_config(resolve_model(model))
    w = nanovllm_workload()
    work = SerialWork(
        prompt_lens=[len(p) for p in w.prompts],
        output_lens=w.max_tokens,
        weight_bytes=floor["weight_bytes"],
        num_params=floor["weight_bytes"] // 2,  # bf16
        head_params=cfg.vocab_size * cfg.hidden_size,
        kv_bytes_per_token=floor["kv_bytes_per_token"],
    )
    return work, DeviceCeilings(floor["copy_bytes_per_s"], floor["matmul_flops"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="a bundled config name, e.g. qwen3-8b")
    parser.add_argument("result", help="a throughput JSON with a 'floor' entry")
    args = parser.parse_args()
    with open(args.result) as f:
        result = json.load(f)
    floor, seconds = result["floor"], result["results"][0]["seconds"]
    work, ceilings = recorded_work(args.model, result)
    serial, fcfs = serial_floor(work, ceilings), fcfs_serial_estimate(work, ceilings)
    print(
        f"{args.model}: floor {floor['seconds']:.2f} s, serial floor {serial:.2f} s "
        f"(at it, {floor['seconds'] / serial:.1%} of the floor), FCFS serial estimate "
        f"{fcfs:.2f} s ({floor['seconds'] / fcfs:.1%}); octavo {seconds:.2f} s: "
        f"{floor['seconds'] / seconds:.1%} of the floor, {serial / seconds:.1%} of the serial "
        f"floor, {fcfs / seconds:.1%} of the FCFS estimate"
    )


if __name__ == "__main__":
    main()
