"""Two half batches on two streams, with attention held to part of the GPU.

`overlap_probe.py` found that two half batches on two streams do not overlap: one stream costs
attention plus the rest, two streams a little more (docs/PERFORMANCE.md, session 6). The
decode-attention kernel launches one program per (KV head, sequence, split), thousands at
batch 256, so it takes every SM while it runs, and the other half's GEMMs wait for SMs to
come free. Here the attention kernel runs only on the first P SMs (`sm_limit`): programs that
land on other SMs exit at once, and those on the first P take tiles from a counter until none
are left. The other SMs stay free for the other stream, as NanoFlow partitions a GPU between
operations of different nano-batches. Attention is bound by memory, so if P SMs still keep
enough loads in flight, it should run at the same speed while the GEMMs, norms and SiLU of the
other half run beside it. (A first try capped the number of programs instead: one or two per
SM on every SM, which left no SM free and slowed attention by 15-60%.)

Variants (each one CUDA graph of every layer, as overlap_probe.py):

    serial         today's decode graph: the whole batch, one stream
    attn, rest     attention alone / everything else alone (full batch)
    attn@P         attention alone, on the first P SMs
    pingpong@P     halves on two streams, attention kernels in turns (A0 B0 A1 B1 ...)
    free@P         halves on two streams, nothing between them

    PYTHONPATH=. python benchmarks/sm_split_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.overlap_probe import Probe, probe_cases, time_graph
from octavo.entrypoints.bench_floor import measure_ceilings
from octavo.kernels.decode_attention import decode_attention_qkv, num_sms


class CappedProbe(Probe):
    """The probe's layers with the attention kernel limited to `sm_limit` programs."""

    sm_limit: int | None = None

    def attn(self, l: int, qkv, rows: slice):
        s, p = self.s, self.layers[l]
        out = decode_attention_qkv(
            qkv, self.kv[l], self.seq_lens[rows], self.block_tables[rows], self.slots[rows],
            self.cos_sin, s["head_dim"] ** -0.5, s["heads"], p["qn"], p["kn"], 1e-6,
            num_splits=self.num_splits, sm_limit=self.sm_limit,
        )  # fmt: skip
        return out.view(qkv.shape[0], -1)


def same_output(p: CappedProbe, cap: int) -> bool:
    """The capped kernel computes each tile as the full grid does: the same bits."""
    qkv = torch.randn(p.batch, p.layers[0]["qkv"].shape[0], device="cuda", dtype=torch.bfloat16)
    kv = p.kv[0].clone()
    p.sm_limit = None
    ref = p.attn(0, qkv, slice(None))
    p.kv[0].copy_(kv)
    p.sm_limit = cap
    got = p.attn(0, qkv, slice(None))
    p.kv[0].copy_(kv)
    p.sm_limit = None
    return torch.equal(ref, got)


def measure(p: CappedProbe, rate: float, caps: list[int], replays: int) -> dict:
    row = {
        "kv_floor_ms": p.kv_bytes / rate * 1e3,
        "serial": time_graph(lambda: p.forward(slice(None)), replays),
        "attn": time_graph(p.attn_only, replays),
        "rest": time_graph(p.rest_only, replays),
        "same_bits": all(same_output(p, c) for c in caps),
    }
    for cap in caps:
        p.sm_limit = cap
        row[f"attn@{cap}"] = time_graph(p.attn_only, replays)
        row[f"pingpong@{cap}"] = time_graph(lambda: p.two_streams(chained=True), replays)
        row[f"free@{cap}"] = time_graph(lambda: p.two_streams(chained=False), replays)
    p.sm_limit = None
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    rate = measure_ceilings().copy_bytes_per_s
    sms = num_sms(torch.device("cuda"))
    caps = [sms, sms * 7 // 8, sms * 3 // 4, sms * 5 // 8]
    print(f"copy {rate / 1e12:.2f} TB/s, {sms} SMs, caps {caps}")
    cases = [("qwen3-0.6b", b, 1024) for b in (256, 128, 64)] + [("qwen3-0.6b", 256, 512)]
    cases += [("qwen3-8b", 256, 1024)]
    rows = probe_cases(cases, lambda p: measure(p, rate, caps, args.replays), CappedProbe)
    print("\nms per step (each a CUDA graph of every layer)")
    for r in rows:
        print(f"{r['model']} batch {r['batch']} x {r['context']}: KV floor {r['kv_floor_ms']:.2f}"
              f", serial {r['serial']:.2f}, attn {r['attn']:.2f}, rest {r['rest']:.2f}, "
              f"same bits {r['same_bits']}")  # fmt: skip
        print(f"  {'P':>5} {'attn@P':>8} {'pingpong':>8} {'free':>8}")
        for cap in caps:
            print(f"  {cap:5} {r[f'attn@{cap}']:8.2f} {r[f'pingpong@{cap}']:8.2f} "
                  f"{r[f'free@{cap}']:8.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bytes_per_s": rate, "sms": sms, "caps": caps, "rows": rows}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
