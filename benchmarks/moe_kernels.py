"""The fused MoE layer (octavo/kernels/fused_moe.py: routing, alignment, both grouped GEMMs and
the sum over k) against its floor, at Qwen3-30B-A3B's shapes (128 experts, top 8, hidden 2048,
768 intermediate), one layer replayed as a CUDA graph:

    floor = max(bytes / copy rate, FLOPs / matmul rate)
    bytes = the weights of the experts the rows reach (their union) + x, h and y
    FLOPs = 2 M k 3 I hidden

The router picks from random logits (every expert equally likely, as dummy weights do).
Each M is also timed without PDL, and where the small path (no sort) runs, on the sorted
path (bf16 only). `--sweep` also times the rule's tiles with one field changed at a time (the small
path's down tiles from a short list), to check the rule.

    python benchmarks/moe_kernels.py [--rows 1 16 256 4096] [--sweep | --grid] [--fp8] [--kernels] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import astuple, replace

import torch
import torch.nn.functional as F

from octavo.entrypoints.bench_floor import measure_ceilings
from octavo.kernels import fused_moe, pdl

E, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def _graph_time(fn, repeats: int = 50) -> float:
    """Median seconds of one replay of `fn` captured as a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 10)
    return sorted(times)[len(times) // 2]


def _kernel_times(fn, repeats: int = 20) -> dict[str, float]:
    """Each kernel's mean device microseconds over `repeats` eager calls of `fn`."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            totals[e.key] = e.device_time_total / repeats
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _case(rows: int, ceilings, w13, w2, router, config=None, repeats: int = 50,
          scales=None, kernels: bool = False) -> dict:  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)

    def layer():
        ids, weights = fused_moe.route(F.linear(x, router), TOP_K, True)
        return fused_moe.fused_experts(x, w13, w2, ids, weights, config=config, scales=scales)

    seconds = _graph_time(layer, repeats)
    if kernels:
        for name, us in _kernel_times(layer).items():
            print(f"  rows {rows}: {us:8.1f} us  {name[:90]}")
    ids, _ = fused_moe.route(F.linear(x, router), TOP_K, True)
    reached = torch.unique(ids).numel()
    elem = 2
    weight_bytes = reached * 3 * INTER * HIDDEN * w13.element_size()
    act_bytes = (2 * rows * HIDDEN + 2 * rows * TOP_K * INTER + rows * TOP_K * HIDDEN) * elem
    flops = 2 * rows * TOP_K * 3 * INTER * HIDDEN
    floor = max((weight_bytes + act_bytes) / ceilings.copy_bytes_per_s,
                flops / ceilings.matmul_flops)  # fmt: skip
    return {
        "rows": rows, "experts_reached": reached, "us": seconds * 1e6, "floor_us": floor * 1e6,
        "over_floor": seconds / floor, "GB_per_s": (weight_bytes + act_bytes) / seconds / 1e9,
    }  # fmt: skip


def _neighbours(rule: fused_moe.TileConfig) -> list[fused_moe.TileConfig]:
    """The rule's configuration with one field changed at a time."""
    options = {
        "block_m": (16, 32, 64, 128),
        "block_n": (32, 64, 128, 256),
        "block_k": (64, 128, 256),
        "num_warps": (4, 8),
        "num_stages": (2, 3, 4, 5),
    }
    return [replace(rule, **{field: v}) for field, values in options.items() for v in values
            if v != getattr(rule, field)]  # fmt: skip


def _grid() -> list[fused_moe.TileConfig]:
    """Every combination of the tile sizes that suit decode's few rows an expert."""
    return [fused_moe.TileConfig(bm, bn, bk, warps, stages) for bm in (16, 32)
            for bn in (64, 128) for bk in (128, 256) for warps in (4, 8) for stages in (3, 4, 5)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 256, 4096])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--kernels", action="store_true", help="each kernel's time too")
    parser.add_argument("--grid", action="store_true", help="time _grid()'s tiles instead")
    parser.add_argument("--fp8", action="store_true", help="e4m3 experts, a scale per row")
    parser.add_argument("--json")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weights(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)

    w13, w2, router = weights(E, 2 * INTER, HIDDEN), weights(E, HIDDEN, INTER), weights(E, HIDDEN)
    scales = None
    if args.fp8:
        from octavo.quant.rounding import quantize_fp8

        q13, s13 = quantize_fp8(w13.flatten(0, 1))
        q2, s2 = quantize_fp8(w2.flatten(0, 1))
        w13, w2 = q13.view(w13.shape), q2.view(w2.shape)
        scales = (s13.view(E, -1), s2.view(E, -1))
    results, sweeps = [], []
    for rows in args.rows:
        results.append(_case(rows, ceilings, w13, w2, router, scales=scales,
                             kernels=args.kernels))  # fmt: skip
        results[-1]["no_pdl_us"] = float("nan")
        if scales is None and rows * TOP_K <= fused_moe.SMALL_MAX_PAIRS:  # small vs sorted
            small, fused_moe.SMALL_MAX_PAIRS = fused_moe.SMALL_MAX_PAIRS, 0
            results[-1]["sorted_path_us"] = _case(rows, ceilings, w13, w2, router)["us"]
            fused_moe.SMALL_MAX_PAIRS = small
        if scales is None:
            pdl.ENABLED = False
            results[-1]["no_pdl_us"] = _case(rows, ceilings, w13, w2, router)["us"]
            pdl.ENABLED = True
        if args.sweep and rows * TOP_K <= fused_moe.SMALL_MAX_PAIRS:
            rule = fused_moe.SMALL_DOWN_TILES
            for tiles in ((4, 256), (8, 128), (8, 256), (16, 128), (16, 256), (32, 64)):
                fused_moe.SMALL_DOWN_TILES = tiles
                r = _case(rows, ceilings, w13, w2, router, repeats=10, scales=scales)
                sweeps.append(r | {"small_down_tiles": list(tiles)})
                print(f"rows {rows}: small down tiles {tiles}: {r['us']:.1f} us", flush=True)
            fused_moe.SMALL_DOWN_TILES = rule
            continue
        if args.sweep or args.grid:
            rule = fused_moe.tile_config(rows * TOP_K, E)
            for cfg in _grid() if args.grid else _neighbours(rule):
                bm, bn, bk, warps, stages = astuple(cfg)
                try:
                    r = _case(rows, ceilings, w13, w2, router, cfg, repeats=10, scales=scales)
                except Exception as exc:  # out of shared memory, say
                    print(f"  {cfg}: {type(exc).__name__}")
                    continue
                sweeps.append(r | {"config": [bm, bn, bk, warps, stages]})
            best = sorted((s for s in sweeps if s["rows"] == rows), key=lambda s: s["us"])[:3]
            print(f"rows {rows}: rule {astuple(rule)} {results[-1]['us']:.1f} us, best "
                  + ", ".join(f"{b['config']} {b['us']:.1f} us" for b in best), flush=True)  # fmt: skip
    print(f"copy {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s, matmul "
          f"{ceilings.matmul_flops / 1e12:.0f} TFLOP/s, {torch.cuda.get_device_name()}")  # fmt: skip
    print(f"{'rows':>6} {'experts':>7} {'us':>9} {'floor us':>9} {'x floor':>8} {'GB/s':>7} "
          f"{'sorted us':>9} {'no PDL us':>9}")  # fmt: skip
    for r in results:
        print(f"{r['rows']:>6} {r['experts_reached']:>7} {r['us']:>9.1f} {r['floor_us']:>9.1f} "
              f"{r['over_floor']:>8.2f} {r['GB_per_s']:>7.0f} "
              f"{r.get('sorted_path_us', float('nan')):>9.1f} {r['no_pdl_us']:>9.1f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results,
                       "sweep": sweeps}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
