"""Would torch.compile make a decode step's work besides attention cheaper than ours?

Sessions 5-9 found that a Qwen3-0.6B decode step spends a fixed ~0.8-1.0 ms outside attention
(four cuBLAS GEMMs, two RMSNorms with the residual add and SiLU-and-mul per layer), and that
four GEMMs of our own in Triton lost to cuBLAS from 32 rows up (docs/PERFORMANCE.md). This
probe asks Inductor instead. One layer's work besides attention, written in plain torch ops,
is compiled once per batch size and run over every layer's weights:

    engine     the engine's kernels (overlap_probe.Probe.rest_only)
    inductor   torch.compile(mode="default"): Inductor fuses the norms, residual adds and
               SiLU-and-mul into its own Triton kernels; the GEMMs stay cuBLAS
    autotune   torch.compile(mode="max-autotune-no-cudagraphs"): each GEMM is also timed as
               Inductor's Triton templates (persistent and TMA ones on Hopper) and the fastest
               is kept, with the pointwise work fused into its epilogue where it can be

Each variant is one CUDA graph of all the layers; ms per step, mean of --replays.

    PYTHONPATH=. python benchmarks/compile_probe.py [--batches 64 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from overlap_probe import EPS, Probe, time_graph


def layer_rest(x, res, a, ln1, qkv, o, ln2, gu, down):
    """One layer besides attention, as the engine computes it: the input norm with the
    residual add and the qkv projection; then o, the post-attention norm with the residual
    add, gate/up, SiLU-and-mul and down. `a` stands for attention's output."""
    res = x + res
    h = _rms_norm(res, ln1)
    q = F.linear(h, qkv)
    res = F.linear(a, o) + res
    gate, up = F.linear(_rms_norm(res, ln2), gu).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down), res, q


def _rms_norm(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * weight


def run_layers(p: Probe, fn) -> None:
    x, res = p.x, p.x
    a = torch.zeros(p.batch, p.layers[0]["o"].shape[1], device="cuda", dtype=x.dtype)
    for w in p.layers:
        x, res, _ = fn(x, res, a, w["ln1"], w["qkv"], w["o"], w["ln2"], w["gu"], w["down"])


def measure(p: Probe, replays: int) -> dict:
    row = {"engine": time_graph(p.rest_only, replays)}
    row["eager_torch"] = time_graph(lambda: run_layers(p, layer_rest), replays)
    for name, mode in (("inductor", "default"), ("autotune", "max-autotune-no-cudagraphs")):
        torch._dynamo.reset()
        fn = torch.compile(layer_rest, mode=mode, dynamic=False, fullgraph=True)
        start = time.perf_counter()
        run_layers(p, fn)  # compiles (and autotunes) for this batch
        torch.cuda.synchronize()
        row[f"{name}_compile_s"] = time.perf_counter() - start
        row[name] = time_graph(lambda fn=fn: run_layers(p, fn), replays)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    rows = []
    for batch in args.batches:
        p = Probe(args.model, batch, 1024)
        rows.append({"model": args.model, "batch": batch, **measure(p, args.replays)})
        print(json.dumps(rows[-1]), flush=True)
        del p
        torch.cuda.empty_cache()
    print(f"\n{'model':11} {'batch':>5} {'engine':>7} {'torch':>7} {'inductor':>8} "
          f"{'autotune':>8}  ms per step, every layer besides attention")  # fmt: skip
    for r in rows:
        print(f"{r['model']:11} {r['batch']:5} {r['engine']:7.3f} {r['eager_torch']:7.3f} "
              f"{r['inductor']:8.3f} {r['autotune']:8.3f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
