"""Do a decode step's small GEMMs get faster when their weights already sit in L2?

A Qwen3-0.6B decode step spends ~0.8-1.0 ms outside attention, in 112 cuBLAS GEMMs of
5.5-8 us each whose weights (1.9-12.6 MB) take 0.5-3 us to read at the copy rate
(docs/PERFORMANCE.md, sessions 5-15). Every GEMM of ours lost to cuBLAS at 32-256 rows. This
probe keeps cuBLAS and asks whether the time a GEMM waits on its first weight tiles from HBM
can be moved off the critical path: a second stream reads the next GEMM's weight into L2
while the current GEMM and the small kernels after it run.

Variants over the same random weights (`overlap_probe.Probe`), each in one CUDA graph:

    rest        everything but attention, weights cold (the engine today)
    hot         the same, every layer using layer 0's weights: an upper bound for prefetch
    pf-load     rest, the side stream loading weight g+1 (tl.load, .cg) when GEMM g starts
    pf-bulk     the same with Hopper's bulk L2 prefetch (cp.async.bulk.prefetch.L2)
    pf-bulk2    bulk prefetch two GEMMs ahead
    step, step-bulk   the whole layer with attention, without and with the bulk prefetch

    PYTHONPATH=. python benchmarks/l2_prefetch_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks.overlap_probe import EPS, Probe, probe_cases, time_graph
from octavo.entrypoints.bench_floor import measure_ceilings
from octavo.kernels.activation import silu_and_mul
from octavo.kernels.rms_norm import rms_norm

GEMMS = ("qkv", "o", "gu", "down")
BUILD_ERRORS = (RuntimeError, ValueError, triton.CompilationError)


@triton.jit
def _load_kernel(w_ptr, n, sink_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = (i * tl.num_programs(0) + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0, cache_modifier=".cg").to(tl.float32)
    tl.store(sink_ptr + pid, tl.sum(acc))


@triton.jit
def _bulk_kernel(w_ptr, n_bytes, sink_ptr, CHUNK: tl.constexpr, PER_PROG: tl.constexpr):
    pid = tl.program_id(0)
    offs = (pid * PER_PROG + tl.arange(0, PER_PROG)).to(tl.int64) * CHUNK
    size = tl.minimum(n_bytes - offs, CHUNK).to(tl.int32)
    r = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.u32 $0, 0; }",
        "=r,l,r",
        [w_ptr + offs, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    tl.store(sink_ptr + pid, tl.sum(r))


class PrefetchProbe(Probe):
    def __init__(self, model: str, batch: int, context: int, seed: int = 0) -> None:
        super().__init__(model, batch, context, seed)
        self.sink = torch.zeros(4096, device="cuda", dtype=torch.float32)
        self.mode: str | None = None  # None, "load", "bulk"
        self.lead = 1
        self.with_attn = False

    def prefetch(self, w: torch.Tensor) -> None:
        if self.mode == "load":
            n = w.numel()
            grid = 64
            iters = triton.cdiv(n, grid * 2048)
            _load_kernel[(grid,)](w, n, self.sink, BLOCK=2048, ITERS=iters, num_warps=8)
        elif self.mode == "bulk":
            b = w.view(torch.uint8).view(-1)
            chunk, per_prog = 16384, 32
            grid = triton.cdiv(b.numel(), chunk * per_prog)
            _bulk_kernel[(grid,)](b, b.numel(), self.sink, CHUNK=chunk, PER_PROG=per_prog,
                                  num_warps=1)  # fmt: skip

    def layer_pass(self) -> None:
        """All layers (attention too if `with_attn`), prefetching `lead` GEMMs ahead."""
        main, side = torch.cuda.current_stream(), self.side
        order = [(l, g) for l in range(self.s["layers"]) for g in GEMMS]
        index = {key: i for i, key in enumerate(order)}
        side.wait_stream(main)
        if self.mode:
            with torch.cuda.stream(side):
                for key in order[: self.lead]:
                    self.prefetch(self.layers[key[0]][key[1]])

        def gemm(l: int, g: str, x: torch.Tensor) -> torch.Tensor:
            nxt = index[(l, g)] + self.lead
            if self.mode and nxt < len(order):
                ev = torch.cuda.Event()
                ev.record(main)
                side.wait_event(ev)
                with torch.cuda.stream(side):
                    self.prefetch(self.layers[order[nxt][0]][order[nxt][1]])
            return F.linear(x, self.layers[l][g])

        x, res = self.x, self.x
        a = torch.zeros(self.batch, self.layers[0]["o"].shape[1], device="cuda", dtype=x.dtype)
        for l in range(self.s["layers"]):
            p = self.layers[l]
            h, res = rms_norm(x, p["ln1"], EPS, res)
            qkv = gemm(l, "qkv", h)
            if self.with_attn:
                a = self.attn(l, qkv, slice(None))
            h = gemm(l, "o", a)
            h, res = rms_norm(h, p["ln2"], EPS, res)
            x = gemm(l, "down", silu_and_mul(gemm(l, "gu", h)))
        main.wait_stream(side)


def measure(p: PrefetchProbe, replays: int) -> dict:
    row = {}
    for name, mode, lead, attn in (("rest", None, 1, False), ("pf-load", "load", 1, False),
                                   ("pf-bulk", "bulk", 1, False), ("pf-bulk2", "bulk", 2, False),
                                   ("step", None, 1, True), ("step-bulk", "bulk", 1, True)):  # fmt: skip
        p.mode, p.lead, p.with_attn = mode, lead, attn
        try:
            row[name] = time_graph(p.layer_pass, replays)
        except BUILD_ERRORS as e:  # a variant that does not build is reported, not fatal
            print(f"{name}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            row[name] = float("nan")
    # Upper bound: every layer reads layer 0's weights, which stay in L2.
    cold = p.layers
    p.layers = [cold[0]] * len(cold)
    p.mode, p.with_attn = None, False
    row["hot"] = time_graph(p.layer_pass, replays)
    p.layers = cold
    # The prefetch kernels alone, over every layer's weights, one stream.
    for mode in ("load", "bulk"):
        p.mode = mode
        try:
            row[f"{mode}-alone"] = time_graph(
                lambda: [p.prefetch(lay[g]) for lay in p.layers for g in GEMMS], replays
            )
        except BUILD_ERRORS as e:
            print(f"{mode}-alone: {type(e).__name__}: {str(e)[:400]}", flush=True)
            row[f"{mode}-alone"] = float("nan")
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args()
    rate = measure_ceilings().copy_bytes_per_s
    print(f"copy {rate / 1e12:.2f} TB/s")
    cases = [("qwen3-0.6b", b, 1024) for b in (1, 8, 32, 64, 128, 256)]
    cases += [("qwen3-8b", b, 1024) for b in (1, 64, 256)]
    rows = probe_cases(cases, lambda p: measure(p, args.replays), PrefetchProbe)
    cols = ("rest", "hot", "pf-load", "pf-bulk", "pf-bulk2", "step", "step-bulk",
            "load-alone", "bulk-alone")  # fmt: skip
    print(f"\n{'model':11} {'batch':>5} " + " ".join(f"{c:>10}" for c in cols) + "   ms per step")
    for r in rows:
        print(f"{r['model']:11} {r['batch']:5} " + " ".join(f"{r[c]:10.3f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bytes_per_s": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
