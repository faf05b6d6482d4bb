"""Can stream priorities let a decode step's GEMMs run beside attention?

Sessions 6 and 8 split a decode batch into halves A and B and let one half's GEMMs run while
the other half's attention streamed the KV cache. Nothing overlapped: the halves in turns
took attention plus twice the GEMM time (docs/PERFORMANCE.md). One reading: the attention
grid holds every SM, and the block scheduler hands a freed SM to attention's next program
before the other stream's GEMM. CUDA dispatches the programs of a higher-priority stream
first. PyTorch instantiates its graphs with cudaGraphInstantiateFlagUseNodePriority since
pull request 167346 (November 2025). That a captured kernel keeps its stream's priority is
inferred, not checked: `prio` differs from `prio-flat`, whose graph is the same but for the
priorities (docs/PERFORMANCE.md, session 18).

Here every attention kernel runs on one low-priority stream, in the order A0 B0 A1 B1 ...
Each half's other kernels run on a high-priority stream of their own, with events between
them. Variants, each one CUDA graph over `overlap_probe.Probe`'s layers:

    serial      the whole batch on one stream (the engine today)
    pingpong    `Probe.two_streams(chained=True)`: the same halves, without priorities
    prio        attention on the low-priority stream, the rest high (above)
    prio-flat   the same streams and events, all at the same priority (the control)
    attn, rest  attention alone and everything else alone, whole batch

    PYTHONPATH=. python benchmarks/priority_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.overlap_probe import Probe, probe_cases, time_graph
from octavo.entrypoints.bench_floor import measure_ceilings


class PriorityProbe(Probe):
    def __init__(self, model: str, batch: int, context: int, seed: int = 0) -> None:
        super().__init__(model, batch, context, seed)
        low, high = torch.cuda.Stream.priority_range()  # (0, -5): lower numbers go first
        self.streams = {
            True: ([torch.cuda.Stream(priority=high) for _ in range(2)],
                   torch.cuda.Stream(priority=low)),
            False: ([torch.cuda.Stream(priority=low) for _ in range(2)],
                    torch.cuda.Stream(priority=low)),
        }  # fmt: skip

    def halves_by_priority(self, prioritized: bool) -> None:
        rest, attn_stream = self.streams[prioritized]
        half = self.batch // 2
        halves = (slice(0, half), slice(half, self.batch))
        main = torch.cuda.current_stream()
        for s in (*rest, attn_stream):
            s.wait_stream(main)
        state = [[self.x[r], self.x[r]] for r in halves]
        for l in range(self.s["layers"]):
            for i in (0, 1):
                with torch.cuda.stream(rest[i]):
                    qkv, state[i][1] = self.pre(l, state[i][0], state[i][1])
                attn_stream.wait_stream(rest[i])
                with torch.cuda.stream(attn_stream):
                    a = self.attn(l, qkv, halves[i])
                rest[i].wait_stream(attn_stream)
                with torch.cuda.stream(rest[i]):
                    state[i][0], state[i][1] = self.post(l, a, state[i][1])
        for s in (*rest, attn_stream):
            main.wait_stream(s)


def measure(p: PriorityProbe, rate: float, replays: int) -> dict:
    return {
        "kv_floor_ms": p.kv_bytes / rate * 1e3,
        "serial": time_graph(lambda: p.forward(slice(None)), replays),
        "pingpong": time_graph(lambda: p.two_streams(chained=True), replays),
        "prio": time_graph(lambda: p.halves_by_priority(True), replays),
        "prio-flat": time_graph(lambda: p.halves_by_priority(False), replays),
        "attn": time_graph(p.attn_only, replays),
        "rest": time_graph(p.rest_only, replays),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    rate = measure_ceilings().copy_bytes_per_s
    print(f"copy {rate / 1e12:.2f} TB/s; stream priorities {torch.cuda.Stream.priority_range()}")
    cases = [("qwen3-0.6b", b, c) for b, c in ((256, 1024), (128, 1024), (64, 1024), (256, 512))]
    cases += [("qwen3-8b", 256, 1024), ("qwen3-8b", 128, 1024)]
    rows = probe_cases(cases, lambda p: measure(p, rate, args.replays), PriorityProbe)
    cols = ("kv_floor_ms", "serial", "pingpong", "prio", "prio-flat", "attn", "rest")
    print(f"\n{'model':11} {'batch':>5} {'ctx':>5} " + " ".join(f"{c:>11}" for c in cols))
    for r in rows:
        print(f"{r['model']:11} {r['batch']:5} {r['context']:5} "
              + " ".join(f"{r[c]:11.3f}" for c in cols))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bytes_per_s": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
