"""Decode layers at small batches with `fused_linear` (four kernels around attention) against
the engine's layers (RMSNorm, cuBLAS GEMMs, SiLU-and-mul: seven), inside CUDA graphs.

At batch 1-64 a decode step's projections are bound by their weight reads and by the fixed
cost of each launch; `benchmarks/fused_linear.py` folds the norms, SiLU-and-mul and the
residual adds into the projections, and loads its first weight slice before waiting on the
previous kernel (PDL). Four parts:

    check   each fused call on random inputs against the float32 torch reference, next to
            the unfused bf16 kernels' error against the same reference
    gemm    one projection over every layer's weight in a graph: cuBLAS against the fused
            kernel (plain, no folding) over a sweep of tiles; us per call and % of the
            weight-read floor
    layers  a step's layers (and the rest without attention) with the engine's kernels, and
            with fused_linear: norms folded in, or the RMSNorm kernels kept before it
    calls   each of a layer's four calls, plain and with its folding, over all layers'
            weights; and the four in a row per layer, plain and folded

    PYTHONPATH=. python benchmarks/fused_linear_probe.py [--json out.json] [--skip-gemm]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton

from benchmarks.fused_linear import (
    default_fused_linear_config,
    fused_linear,
    fused_linear_reference,
)
from benchmarks.overlap_probe import EPS, Probe, probe_cases, time_graph
from octavo.entrypoints.bench_floor import measure_ceilings
from octavo.kernels.activation import silu_and_mul
from octavo.kernels.rms_norm import rms_norm

LAYER_CASES = [("qwen3-8b", 1, 768), ("qwen3-8b", 4, 1024), ("qwen3-8b", 16, 1024),
               ("qwen3-0.6b", 1, 1024), ("qwen3-0.6b", 8, 1024), ("qwen3-0.6b", 16, 1024),
               ("qwen3-0.6b", 32, 1024), ("qwen3-0.6b", 64, 1024)]  # fmt: skip
GEMM_ROWS = (1, 8, 16, 32, 64)
CONFIGS = [
    {"block_n": n, "block_k": k, "num_warps": 4, "num_stages": s}
    for n, k, s in itertools.product((16, 32, 64), (128, 256), (3, 4))
]


class FusedProbe(Probe):
    """The Probe's layers on the residual stream with fused_linear: four calls a layer with
    the norms folded (`fold_norms`), or the RMSNorm kernels kept and only SiLU-and-mul and
    the residual adds folded (six kernels a layer against the engine's seven)."""

    fold_norms = True

    def norm_then(self, h, weight, ln, gated: bool = False):
        if self.fold_norms:
            return fused_linear(h, weight, norm_weight=ln, eps=EPS, gated=gated)
        return fused_linear(rms_norm(h, ln, EPS), weight, gated=gated)

    def fused_layer(self, l: int, h, attend: bool):
        p = self.layers[l]
        qkv = self.norm_then(h, p["qkv"], p["ln1"])
        a = self.attn(l, qkv, slice(None)) if attend else self.zeros_attn
        h = fused_linear(a, p["o"], residual=h)
        act = self.norm_then(h, p["gu"], p["ln2"], gated=True)
        return fused_linear(act, p["down"], residual=h)

    def fused_forward(self) -> None:
        h = self.x
        for l in range(self.s["layers"]):
            h = self.fused_layer(l, h, attend=True)

    def fused_rest(self) -> None:
        h = self.x
        for l in range(self.s["layers"]):
            h = self.fused_layer(l, h, attend=False)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def check(p: FusedProbe) -> dict:
    """Layer 0's four calls against the float32 reference; the unfused kernels alongside."""
    q = p.layers[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(p.batch, p.s["hidden"], generator=g, device="cuda").to(torch.bfloat16)
    a = torch.randn(p.batch, q["o"].shape[1], generator=g, device="cuda").to(torch.bfloat16)
    act = torch.randn(p.batch, p.s["inter"], generator=g, device="cuda").to(torch.bfloat16)
    ln = (torch.rand(p.s["hidden"], generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    row = {}
    ref = fused_linear_reference(h, q["qkv"], norm_weight=ln, eps=EPS)
    row["qkv_fused"] = rel(fused_linear(h, q["qkv"], norm_weight=ln, eps=EPS), ref)
    row["qkv_unfused"] = rel(F.linear(rms_norm(h, ln, EPS), q["qkv"]), ref)
    ref = fused_linear_reference(a, q["o"], residual=h)
    row["o_fused"] = rel(fused_linear(a, q["o"], residual=h), ref)
    row["o_unfused"] = rel(F.linear(a, q["o"]) + h, ref)
    ref = fused_linear_reference(h, q["gu"], norm_weight=ln, eps=EPS, gated=True)
    row["gu_fused"] = rel(fused_linear(h, q["gu"], norm_weight=ln, eps=EPS, gated=True), ref)
    row["gu_unfused"] = rel(silu_and_mul(F.linear(rms_norm(h, ln, EPS), q["gu"])), ref)
    ref = fused_linear_reference(act, q["down"], residual=h)
    row["down_fused"] = rel(fused_linear(act, q["down"], residual=h), ref)
    row["down_unfused"] = rel(F.linear(act, q["down"]) + h, ref)
    return row


def measure_layers(p: FusedProbe, replays: int) -> dict:
    p.zeros_attn = torch.zeros(p.batch, p.layers[0]["o"].shape[1], device="cuda",
                               dtype=torch.bfloat16)  # fmt: skip
    row = check(p)
    row["step"] = time_graph(lambda: p.forward(slice(None)), replays)
    row["rest"] = time_graph(p.rest_only, replays)
    for fold in (True, False):
        p.fold_norms = fold
        tag = "folded" if fold else "normed"
        row[f"{tag}_step"] = time_graph(p.fused_forward, replays)
        row[f"{tag}_rest"] = time_graph(p.fused_rest, replays)
    return row


def calls(replays: int) -> list[dict]:
    """Each of a layer's four calls over all layers' weights, plain and with its folding,
    and the four in a row per layer (plain and folded): us per layer."""
    torch.set_grad_enabled(False)
    rows = []
    for model, m in (("qwen3-8b", 1), ("qwen3-0.6b", 8)):
        rows.append({"model": model, "rows": m, **_calls_case(Probe(model, m, 256), replays)})
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def _calls_case(p: Probe, replays: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(2)
    m, s, dt = p.batch, p.s, torch.bfloat16
    h = torch.randn(m, s["hidden"], generator=g, device="cuda").to(dt)
    a = torch.randn(m, p.layers[0]["o"].shape[1], generator=g, device="cuda").to(dt)
    act = torch.randn(m, s["inter"], generator=g, device="cuda").to(dt)
    variants = {
        "qkv": (lambda q: fused_linear(h, q["qkv"]),
                lambda q: fused_linear(h, q["qkv"], norm_weight=q["ln1"], eps=EPS)),
        "o": (lambda q: fused_linear(a, q["o"]),
              lambda q: fused_linear(a, q["o"], residual=h)),
        "gu": (lambda q: fused_linear(h, q["gu"]),
               lambda q: fused_linear(h, q["gu"], norm_weight=q["ln2"], eps=EPS, gated=True)),
        "down": (lambda q: fused_linear(act, q["down"]),
                 lambda q: fused_linear(act, q["down"], residual=h)),
    }  # fmt: skip

    def per_layer_us(fns) -> float:
        def run():
            for q in p.layers:
                for fn in fns:
                    fn(q)

        return time_graph(run, replays) * 1e3 / len(p.layers)

    row = {}
    for i, tag in enumerate(("plain", "folded")):
        for name, pair in variants.items():
            row[f"{name}_{tag}"] = per_layer_us([pair[i]])
        row[f"chain_{tag}"] = per_layer_us([pair[i] for pair in variants.values()])
    return row


def gemm_sweep(rate: float, replays: int) -> list[dict]:
    """Each projection of each model, over all its layers' weights in one graph."""
    torch.set_grad_enabled(False)
    rows = []
    for model in ("qwen3-0.6b", "qwen3-8b"):
        p = Probe(model, 1, 256)
        for name in ("qkv", "o", "gu", "down"):
            weights = [layer[name] for layer in p.layers]
            n, k = weights[0].shape
            floor_us = n * k * 2 / rate * 1e6
            for m in GEMM_ROWS:
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)

                def run(cfg=None, weights=weights, x=x):
                    for w in weights:
                        if cfg is None:
                            F.linear(x, w)
                        else:
                            fused_linear(x, w, config=cfg)

                row = {"model": model, "proj": name, "rows": m, "floor_us": floor_us}
                row["cublas_us"] = time_graph(run, replays) * 1e3 / len(weights)
                best = None
                for cfg in CONFIGS:
                    cfg = {**cfg, "block_m": max(16, m)}
                    try:
                        us = time_graph(lambda cfg=cfg: run(cfg), replays) * 1e3 / len(weights)
                    except triton.runtime.errors.OutOfResources:
                        continue  # too many stages of this tile for shared memory
                    if best is None or us < best[0]:
                        best = (us, cfg)
                default = default_fused_linear_config(m, n, k, gated=False)
                row["default_us"] = (
                    time_graph(lambda cfg=default: run(cfg), replays) * 1e3 / len(weights)
                )
                row["best_us"], row["best_cfg"] = best
                rows.append(row)
                print(json.dumps(row), flush=True)
        del p
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--skip-gemm", action="store_true")
    args = ap.parse_args()
    rate = measure_ceilings().copy_bytes_per_s
    print(f"copy {rate / 1e12:.2f} TB/s", flush=True)
    layers = probe_cases(LAYER_CASES, lambda p: measure_layers(p, args.replays), FusedProbe)
    per_call = calls(args.replays)
    gemms = [] if args.skip_gemm else gemm_sweep(rate, args.replays)
    if gemms:
        print(f"\n{'model':11} {'proj':>5} {'rows':>4} {'floor':>6} {'cuBLAS':>7} "
              f"{'fused':>7} {'best':>7}  best tile   (us per call)")  # fmt: skip
        for r in gemms:
            c = r["best_cfg"]
            print(f"{r['model']:11} {r['proj']:>5} {r['rows']:4} {r['floor_us']:6.1f} "
                  f"{r['cublas_us']:7.1f} {r['default_us']:7.1f} {r['best_us']:7.1f}  "
                  f"n{c['block_n']} k{c['block_k']} s{c['num_stages']}")  # fmt: skip
    print("\nmax error / max |ref| against float32 torch (fused, unfused bf16 kernels)")
    for r in layers:
        print(f"{r['model']:11} {r['batch']:4}  " + "  ".join(
            f"{k}: {r[f'{k}_fused']:.1e} {r[f'{k}_unfused']:.1e}" for k in ("qkv", "o", "gu", "down")
        ))  # fmt: skip
    names = ("qkv", "o", "gu", "down", "chain")
    print(f"\n{'model':11} {'rows':>4} | " + " | ".join(f"{n:>13}" for n in names)
          + "   us per layer: plain, folded")  # fmt: skip
    for r in per_call:
        cells = " | ".join(f"{r[f'{n}_plain']:6.1f} {r[f'{n}_folded']:6.1f}" for n in names)
        print(f"{r['model']:11} {r['rows']:4} | {cells}")
    print(f"\n{'model':11} {'batch':>5} | {'step':>7} {'folded':>7} {'normed':>7} | "
          f"{'rest':>7} {'folded':>7} {'normed':>7}   ms per step: engine kernels; fused_linear "
          "with the norms folded; with the RMSNorm kernels kept")  # fmt: skip
    for r in layers:
        print(f"{r['model']:11} {r['batch']:5} | {r['step']:7.3f} {r['folded_step']:7.3f} "
              f"{r['normed_step']:7.3f} | {r['rest']:7.3f} {r['folded_rest']:7.3f} "
              f"{r['normed_rest']:7.3f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bytes_per_s": rate, "layers": layers, "calls": per_call,
                       "gemms": gemms}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
