"""Is a decode layer's rest cheaper as one persistent kernel? (benchmarks/layer_kernel.py)

For each model and batch, three graphs of all the layers' work besides attention (o_proj
through the next layer's qkv), over the same random weights:

    engine   the engine's kernels: cuBLAS GEMMs, RMSNorm with the residual, SiLU-and-mul
             (`overlap_probe.Probe.rest_only`)
    fused    one persistent launch per layer, each tile configuration of a small sweep
    split    the best configuration's four phases as four launches (no grid barrier)

and a check of one layer against the engine's kernels and a float32 reference: the
largest error over the largest |reference| of the layer's two outputs (the residual and
the next qkv), and the barrier counter after the launch.

    PYTHONPATH=. python benchmarks/layer_kernel_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.fused_linear import fused_linear_reference
from benchmarks.layer_kernel import LayerRest
from benchmarks.overlap_probe import EPS, Probe, time_graph
from octavo.kernels.activation import silu_and_mul
from octavo.kernels.rms_norm import rms_norm

CASES = [("qwen3-0.6b", b) for b in (1, 8, 32, 64, 128, 256)] + [("qwen3-8b", 1), ("qwen3-8b", 64)]


def configs(m: int, model: str) -> list[dict]:
    bm = min(max(16, 1 << (m - 1).bit_length()), 64)
    small = dict(BN_O=32, BN_GU=64, BN_D=32, BN_QKV=64)
    wide = dict(BN_O=64, BN_GU=128, BN_D=64, BN_QKV=128)
    out = [
        dict(BM=bm, **small, BK=128, num_warps=4, num_stages=3),
        dict(BM=bm, **small, BK=64, num_warps=4, num_stages=4),
        dict(BM=bm, **wide, BK=64, num_warps=8, num_stages=3),
    ]
    if model == "qwen3-0.6b" and m <= 64:
        out.append(dict(BM=bm, BN_O=16, BN_GU=32, BN_D=16, BN_QKV=32, BK=128, num_warps=4,
                        num_stages=4))  # fmt: skip
        # more weight bytes in flight per SM (the weight-bound case): 4 stages of 16 x 256
        out.append(dict(BM=bm, BN_O=16, BN_GU=32, BN_D=16, BN_QKV=32, BK=256, num_warps=4,
                        num_stages=4))  # fmt: skip
    if m >= 128:
        out.append(dict(BM=128, **small, BK=64, num_warps=8, num_stages=3))
        out.append(dict(BM=128, **wide, BK=64, num_warps=8, num_stages=3))
    return out


class Fused:
    def __init__(self, p: Probe) -> None:
        s, m = p.s, p.batch
        self.p = p
        dev, dt = "cuda", torch.bfloat16
        self.q_size = s["heads"] * s["head_dim"]
        self.qkv_size = p.layers[0]["qkv"].shape[0]
        self.rest = LayerRest(s["hidden"], self.q_size, s["inter"], self.qkv_size, m, dev, dt,
                              s["layers"])  # fmt: skip
        g = torch.Generator(device=dev).manual_seed(1)
        self.a = torch.randn(m, self.q_size, generator=g, device=dev).to(dt)
        self.res0 = torch.randn(m, s["hidden"], generator=g, device=dev).to(dt)
        self.res = self.res0.clone()
        self.qkv = torch.empty(m, self.qkv_size, device=dev, dtype=dt)

    def layer(self, l: int, cfg: dict, split: bool, res, r2, qkv) -> None:
        p, L = self.p.layers, len(self.p.layers)
        nxt = p[(l + 1) % L]
        self.rest(l, self.a, res, p[l]["o"], p[l]["ln2"], p[l]["gu"], p[l]["down"], nxt["ln1"],
                  nxt["qkv"], r2, qkv, EPS, cfg, split=split)  # fmt: skip

    def step(self, cfg: dict, split: bool) -> None:
        self.rest.sync.zero_()
        for l in range(len(self.p.layers)):
            self.layer(l, cfg, split, self.res, self.res, self.qkv)  # residual updated in place

    def check(self, cfg: dict) -> dict:
        """One layer (0, then 1's qkv) against the engine's kernels and float32."""
        p0, p1 = self.p.layers[0], self.p.layers[1]
        r2 = torch.empty_like(self.res0)
        qkv = torch.empty_like(self.qkv)
        self.rest.sync.zero_()
        self.layer(0, cfg, False, self.res0, r2, qkv)
        torch.cuda.synchronize()
        barrier = int(self.rest.sync[0])
        # the engine's kernels
        h, r1 = rms_norm(F.linear(self.a, p0["o"]), p0["ln2"], EPS, self.res0)
        d = F.linear(silu_and_mul(F.linear(h, p0["gu"])), p0["down"])
        h2, e_r2 = rms_norm(d, p1["ln1"], EPS, r1)
        e_qkv = F.linear(h2, p1["qkv"])

        # float32 throughout (the reference keeps its input's dtype)
        r1f = fused_linear_reference(self.a.float(), p0["o"], residual=self.res0)
        act = fused_linear_reference(r1f, p0["gu"], norm_weight=p0["ln2"], eps=EPS, gated=True)
        r2f = fused_linear_reference(act, p0["down"], residual=r1f)
        qkvf = fused_linear_reference(r2f, p1["qkv"], norm_weight=p1["ln1"], eps=EPS)

        def err(x, ref):
            return float((x.float() - ref).abs().max() / ref.abs().max())

        return {
            "barrier_count": barrier,
            "fused_vs_f32": [err(r2, r2f), err(qkv, qkvf)],
            "engine_vs_f32": [err(e_r2, r2f), err(e_qkv, qkvf)],
            "fused_vs_engine": [err(r2, e_r2.float()), err(qkv, e_qkv.float())],
        }


def measure(model: str, batch: int, replays: int) -> dict:
    p = Probe(model, batch, 16)
    row: dict = {"model": model, "batch": batch, "engine_ms": time_graph(p.rest_only, replays)}
    f = Fused(p)
    row["nprog"] = f.rest.nprog
    sweep = []
    for cfg in configs(batch, model):
        try:
            ms = time_graph(lambda cfg=cfg: f.step(cfg, False), replays)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            sweep.append({"cfg": cfg, "error": repr(e)[:200]})
            continue
        sweep.append({"cfg": cfg, "ms": ms})
    row["sweep"] = sweep
    ok = [s for s in sweep if "ms" in s]
    if ok:
        best = min(ok, key=lambda s: s["ms"])
        row["fused_ms"], row["best_cfg"] = best["ms"], best["cfg"]
        row["split_ms"] = time_graph(lambda: f.step(best["cfg"], True), replays)
        # no rows: every phase has no tiles, so what is left is 1 launch + 3 barriers a layer
        # (fused) against 4 launches (split)
        a, f.a = f.a, f.a[:0]  # the launches take their row count from `a`
        row["empty_fused_ms"] = time_graph(lambda: f.step(best["cfg"], False), replays)
        row["empty_split_ms"] = time_graph(lambda: f.step(best["cfg"], True), replays)
        f.a = a
        row["check"] = f.check(best["cfg"])
    row["engine_again_ms"] = time_graph(p.rest_only, replays)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--only", help="model name to keep")
    ap.add_argument("--smoke", action="store_true", help="one checked launch, then exit")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.smoke:  # a barrier that never opens hangs the process: try it under a timeout first
        f = Fused(Probe("qwen3-0.6b", 8, 16))
        print("smoke:", json.dumps(f.check(configs(8, "qwen3-0.6b")[0])), flush=True)
        return
    rows = []
    for model, batch in CASES:
        if args.only and model != args.only:
            continue
        rows.append(measure(model, batch, args.replays))
        print(json.dumps(rows[-1]), flush=True)
    print("\nms per step, all layers' work besides attention (engine twice: before, after)")
    print(f"{'model':11} {'batch':>5} | {'engine':>13} | {'fused':>7} {'split':>7} | "
          f"{'empty fused':>11} {'split':>6} | check")  # fmt: skip
    for r in rows:
        c = r.get("check", {})
        print(f"{r['model']:11} {r['batch']:5} | {r['engine_ms']:6.3f} {r['engine_again_ms']:6.3f} | "
              f"{r.get('fused_ms', float('nan')):7.3f} {r.get('split_ms', float('nan')):7.3f} | "
              f"{r.get('empty_fused_ms', float('nan')):11.3f} {r.get('empty_split_ms', float('nan')):6.3f} | "
              f"barrier {c.get('barrier_count')} vs f32 {c.get('fused_vs_f32')} "
              f"engine vs f32 {c.get('engine_vs_f32')}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
