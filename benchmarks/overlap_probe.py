"""Can a decode step hide its GEMMs behind attention? Two micro-batches on two streams.

A decode step of Qwen3-0.6B at batch 256 spends ~1 ms per step in latency-bound GEMMs,
norms and SiLU, besides ~7.6 ms of memory-bound attention (docs/PERFORMANCE.md). Split the
batch into halves A and B, each on its own stream, and chain the attention kernels
A0 -> B0 -> A1 -> B1 -> ... with events: while one half's attention streams the KV cache, the
other half runs its projections. The attention kernels still run one at a time, so the step
should approach the attention time alone, if the GEMMs' programs find room on the SMs.

The layers are the engine's kernels (RMSNorm with the residual, the qkv GEMM, the fused
decode-attention kernel, o_proj, gate/up, SiLU-and-mul, down) over random weights, one set per
layer, each variant captured in one CUDA graph:

    serial    the whole batch on one stream (today's decode graph)
    pingpong  halves on two streams, attentions chained as above
    free      halves on two streams, no events between them
    attn      the attention kernels alone (full batch): the target
    rest      everything but attention (full batch)

    PYTHONPATH=. python benchmarks/overlap_probe.py [--json out.json]

The committed H200 output (docs/results/gpu/h200/session6/) took its KV floor from a 1 GiB
copy of the probe's own; the probe has used the bench's ceiling since.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from octavo.entrypoints.bench_floor import measure_ceilings
from octavo.kernels.activation import silu_and_mul
from octavo.kernels.decode_attention import decode_attention_qkv
from octavo.kernels.rms_norm import rms_norm

SHAPES = {
    "qwen3-0.6b": {
        "hidden": 1024,
        "heads": 16,
        "kv_heads": 8,
        "head_dim": 128,
        "inter": 3072,
        "layers": 28,
    },
    "qwen3-8b": {
        "hidden": 4096,
        "heads": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "inter": 12288,
        "layers": 36,
    },
}
BLOCK_SIZE = 16
EPS = 1e-6


class Probe:
    """Random weights and a paged KV cache for `batch` sequences of mean length `context`."""

    def __init__(self, model: str, batch: int, context: int, seed: int = 0) -> None:
        s = SHAPES[model]
        self.s, self.batch, self.context = s, batch, context
        g = torch.Generator(device="cuda").manual_seed(seed)
        dev, dt = "cuda", torch.bfloat16
        qkv_out = (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]

        def w(*shape):
            return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * 0.02).to(dt)

        self.layers = [
            {
                "ln1": torch.ones(s["hidden"], device=dev, dtype=dt),
                "ln2": torch.ones(s["hidden"], device=dev, dtype=dt),
                "qn": torch.ones(s["head_dim"], device=dev, dtype=dt),
                "kn": torch.ones(s["head_dim"], device=dev, dtype=dt),
                "qkv": w(qkv_out, s["hidden"]),
                "o": w(s["hidden"], s["heads"] * s["head_dim"]),
                "gu": w(2 * s["inter"], s["hidden"]),
                "down": w(s["hidden"], s["inter"]),
            }
            for _ in range(s["layers"])
        ]
        lens = torch.randint(context // 2, context * 3 // 2 + 1, (batch,), generator=g, device=dev)
        width = (int(lens.max()) + BLOCK_SIZE - 1) // BLOCK_SIZE
        num_blocks = batch * width + 1
        self.kv = [
            torch.randn(2, num_blocks, BLOCK_SIZE, s["kv_heads"], s["head_dim"], generator=g,
                        device=dev, dtype=dt)
            for _ in range(s["layers"])
        ]  # fmt: skip
        self.seq_lens = lens.to(torch.int32)
        perm = torch.randperm(batch * width, generator=g, device=dev).to(torch.int32) + 1
        self.set_block_tables(perm.view(batch, width).contiguous())
        # The engine's decode steps pass the sequences longest first (decode_attention.py);
        # False launches them in row order. Orders by (first row, end row), made outside graphs.
        self.ordered = True
        self._orders: dict[tuple, torch.Tensor] = {}
        self.cos_sin = torch.rand(4 * context, s["head_dim"], generator=g, device=dev)
        self.x = w(batch, s["hidden"])
        self.kv_bytes = int(lens.sum()) * s["kv_heads"] * s["head_dim"] * 2 * 2 * s["layers"]
        self.side = torch.cuda.Stream()
        self.num_splits: int | None = None  # None: the kernel's own choice
        self.norms = True  # False: skip the RMSNorm kernels (what removing them would save)

    def set_block_tables(self, block_tables: torch.Tensor) -> None:
        """[batch, width] int32 block ids of each sequence; the new token's slots follow."""
        self.block_tables = block_tables
        last = (self.seq_lens - 1).long()
        self.slots = block_tables.long().gather(1, (last // BLOCK_SIZE)[:, None])[:, 0]
        self.slots = self.slots * BLOCK_SIZE + last % BLOCK_SIZE

    def pre(self, l: int, x, res):
        p = self.layers[l]
        h, res = rms_norm(x, p["ln1"], EPS, res) if self.norms else (x, res)
        return F.linear(h, p["qkv"]), res

    def attn(self, l: int, qkv, rows: slice):
        s, p = self.s, self.layers[l]
        out = decode_attention_qkv(
            qkv, self.kv[l], self.seq_lens[rows], self.block_tables[rows], self.slots[rows],
            self.cos_sin, s["head_dim"] ** -0.5, s["heads"], p["qn"], p["kn"], EPS,
            order=self.order(rows), num_splits=self.num_splits,
        )  # fmt: skip
        return out.view(qkv.shape[0], -1)

    def order(self, rows: slice) -> torch.Tensor | None:
        """The rows' sequences by context length, longest first (None when not `ordered`)."""
        if not self.ordered:
            return None
        key = (rows.start, rows.stop)
        if key not in self._orders:
            lens = self.seq_lens[rows]
            self._orders[key] = torch.argsort(lens, descending=True, stable=True).to(torch.int32)
        return self._orders[key]

    def post(self, l: int, a, res):
        p = self.layers[l]
        h = F.linear(a, p["o"])
        h, res = rms_norm(h, p["ln2"], EPS, res) if self.norms else (h, res)
        return F.linear(silu_and_mul(F.linear(h, p["gu"])), p["down"]), res

    def forward(self, rows: slice) -> torch.Tensor:
        x, res = self.x[rows], self.x[rows]
        for l in range(self.s["layers"]):
            qkv, res = self.pre(l, x, res)
            x, res = self.post(l, self.attn(l, qkv, rows), res)
        return x

    def attn_only(self) -> None:
        qkv = torch.zeros(self.batch, self.layers[0]["qkv"].shape[0], device="cuda",
                          dtype=torch.bfloat16)  # fmt: skip
        for l in range(self.s["layers"]):
            self.attn(l, qkv, slice(None))

    def rest_only(self) -> None:
        x, res = self.x, self.x
        a = torch.zeros(self.batch, self.layers[0]["o"].shape[1], device="cuda", dtype=x.dtype)
        for l in range(self.s["layers"]):
            _, res = self.pre(l, x, res)
            x, res = self.post(l, a, res)

    def two_streams(self, chained: bool) -> None:
        """Halves A and B on the current stream and a side stream; with `chained`, each
        attention waits for the other half's previous one."""
        half = self.batch // 2
        halves = (slice(0, half), slice(half, self.batch))
        main = torch.cuda.current_stream()
        side = self.side
        side.wait_stream(main)
        streams = (main, side)
        state = [[self.x[r], self.x[r]] for r in halves]
        last_attn: torch.cuda.Event | None = None
        for l in range(self.s["layers"]):
            for i in (0, 1):
                with torch.cuda.stream(streams[i]):
                    qkv, state[i][1] = self.pre(l, state[i][0], state[i][1])
                    if chained and last_attn is not None:
                        streams[i].wait_event(last_attn)
                    a = self.attn(l, qkv, halves[i])
                    if chained:
                        last_attn = torch.cuda.Event()
                        last_attn.record(streams[i])
                    state[i][0], state[i][1] = self.post(l, a, state[i][1])
        main.wait_stream(side)


def time_graph(fn, replays: int) -> float:
    """Captures fn in a CUDA graph; mean ms per replay."""
    fn()  # compile, settle the allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def probe_cases(cases, measure, probe_class: type[Probe] = Probe) -> list[dict]:
    """For each (model, batch, context), a fresh probe and its row: the case plus
    measure(probe), printed as JSON as it comes. Returns the rows."""
    torch.set_grad_enabled(False)
    rows = []
    for model, batch, context in cases:
        p = probe_class(model, batch, context)
        rows.append({"model": model, "batch": batch, "context": context, **measure(p)})
        print(json.dumps(rows[-1]), flush=True)
        del p
        torch.cuda.empty_cache()
    return rows


def measure(p: Probe, rate: float, replays: int) -> dict:
    return {
        "kv_floor_ms": p.kv_bytes / rate * 1e3,
        "serial": time_graph(lambda: p.forward(slice(None)), replays),
        "pingpong": time_graph(lambda: p.two_streams(chained=True), replays),
        "free": time_graph(lambda: p.two_streams(chained=False), replays),
        "attn": time_graph(p.attn_only, replays),
        "rest": time_graph(p.rest_only, replays),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    rate = measure_ceilings().copy_bytes_per_s  # the bench's ceiling (best of 1-4 GiB)
    print(f"copy {rate / 1e12:.2f} TB/s")
    cases = [("qwen3-0.6b", b, c) for b in (256, 128, 64) for c in (1024, 512)]
    cases += [("qwen3-8b", 256, 1024), ("qwen3-8b", 128, 1024)]
    rows = probe_cases(cases, lambda p: measure(p, rate, args.replays))
    print(f"\n{'model':11} {'batch':>5} {'ctx':>5} {'KV floor':>8} {'serial':>7} {'pingpong':>8} "
          f"{'free':>7} {'attn':>7} {'rest':>7}   ms per step")  # fmt: skip
    for r in rows:
        print(f"{r['model']:11} {r['batch']:5} {r['context']:5} {r['kv_floor_ms']:8.2f} "
              f"{r['serial']:7.2f} {r['pingpong']:8.2f} {r['free']:7.2f} {r['attn']:7.2f} "
              f"{r['rest']:7.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bytes_per_s": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
