"""What the host pays the first time a GEMM shape is launched, against a repeat.

    PYTHONPATH=. python benchmarks/gemm_first_call_probe.py [--model qwen3-0.6b] [--warm-up]

For each row count M: the host time of launching F.linear on each of a layer's four weight
shapes (qkv, o, gate_up, down) the first time that M is seen, then a second time, each from an
empty device queue. A prefill step's row count is its token count, so a step with a token
count the process has not run before pays the first-time cost once per weight shape.
Then 40 row counts drawn at random. With --warm-up the engine's start-up warm-up
(`warm_up_linears`, up to 16,384 rows) runs first: how many first launches still stall?
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
import torch.nn.functional as F

from octavo.engine.builder import resolve_model
from octavo.model.hf_config import get_head_dim, load_hf_config
from octavo.model.layers import Linear
from octavo.runner.model_runner import warm_up_linears

ROWS = [16384, 12823, 12864, 12800, 9001, 3001, 777, 64, 100]


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out, in) of a decoder layer's four projections."""
    head_dim = get_head_dim(cfg)
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def host_ms(a: torch.Tensor, w: torch.Tensor) -> float:
    """Host milliseconds to launch a @ w.T, from an empty device queue."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    F.linear(a, w)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--json", default=None)
    parser.add_argument("--warm-up", action="store_true")
    args = parser.parse_args()
    cfg = load_hf_config(resolve_model(args.model))
    weights = {
        name: torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * 0.02
        for name, (out, inp) in shapes(cfg).items()
    }
    x = torch.randn(max(ROWS), max(w.shape[1] for w in weights.values()), device="cuda",
                    dtype=torch.bfloat16)  # fmt: skip
    F.linear(x[:8, : cfg.hidden_size], weights["qkv"])  # cuBLAS handle and workspace
    counts = list(ROWS)
    warm_up_s = None
    if args.warm_up:
        layer = torch.nn.ModuleList()
        for w in weights.values():
            layer.append(Linear(w.shape[1], w.shape[0]))
            layer[-1].weight = torch.nn.Parameter(w, requires_grad=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        launched = warm_up_linears(layer, max(ROWS))
        torch.cuda.synchronize()
        warm_up_s = time.perf_counter() - start
        print(f"warm-up: {launched} GEMMs in {warm_up_s:.2f} s")
    rng = random.Random(0)
    counts += [rng.randint(1, max(ROWS)) for _ in range(40)]
    rows = []
    print("rows     " + "  ".join(f"{n:>15}" for n in weights) + "   (ms: first / second)")
    for m in counts:
        cells = {}
        for name, w in weights.items():
            a = x.view(-1)[: m * w.shape[1]].view(m, w.shape[1])  # contiguous, as activations
            cells[name] = (host_ms(a, w), host_ms(a, w))
        rows.append({"rows": m, **{k: list(v) for k, v in cells.items()}})
        print(f"{m:6d}   " + "  ".join(f"{a:6.2f} / {b:6.2f}" for a, b in cells.values()))
    firsts = [c[0] for r in rows for c in list(r.values())[1:]]
    stalls = sum(t > 1.0 for t in firsts)
    print(f"first launches over 1 ms: {stalls} of {len(firsts)}, {sum(firsts):.1f} ms in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "warm_up_s": warm_up_s, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
