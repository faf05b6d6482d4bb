"""Measured GEMM algorithms for the projections that CUDA graphs capture.

At the row counts of decode steps a projection is latency-bound, and cuBLAS's first heuristic
pick (what `F.linear` runs) is sometimes well off the best it has. At start-up, before graph
capture, `tune_linears` times `F.linear` against cuBLASLt's candidates for each distinct
projection and row count, and hands each winner to the projections of that shape: their
`forward` runs it while a CUDA graph captures (kernels/cublaslt.py). Eager steps keep
`F.linear`, where a ctypes call would cost more host time than it saves.

Timing is a CUDA graph of the candidate over several weights of the shape, more bytes than L2
holds, as in a decode step whose attention streams the KV cache between the projections.
Environment: OCTAVO_LT_GEMMS=0 turns the tuning off.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from octavo.kernels import cublaslt
from octavo.model.layers import Linear

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("OCTAVO_LT_GEMMS", "1") != "0"
MAX_ROWS = 64  # above this a projection's time grows with its rows; cuBLAS's pick holds
MARGIN = 0.03  # a candidate must beat F.linear by this fraction
CANDIDATES = 8  # heuristic algorithms asked for, each also tried with K split 2, 4 and 8


def graph_us(fns: list[Callable[[], object]], replays: int = 3, rounds: int = 3) -> float:
    """Microseconds per call of `fns`, captured as one CUDA graph: the best of `rounds`
    means over `replays` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:  # warm up outside the capture: kernels load, the allocator settles
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(rounds):
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, begin.elapsed_time(end) * 1e3 / replays / len(fns))
    return best


def choose(torch_us: float, candidate_us: list[float], margin: float = MARGIN) -> int | None:
    """Index of the fastest candidate if it beats `torch_us` by more than `margin`, else None."""
    if not candidate_us:
        return None
    best = min(range(len(candidate_us)), key=candidate_us.__getitem__)
    return best if candidate_us[best] < torch_us * (1 - margin) else None


def _weights_for_timing(group: list[Linear], l2_bytes: int) -> list[torch.Tensor]:
    """Enough of the group's weights to exceed twice L2, cycling if it has too few."""
    w = group[0].weight
    needed = max(2, math.ceil(2 * l2_bytes / (w.numel() * w.element_size())))
    return [group[i % len(group)].weight for i in range(min(needed, 4 * len(group)))]


def _tunable(module: Linear) -> bool:
    w = module.weight
    return (
        module.bias is None
        and w.is_cuda
        and w.dtype in cublaslt.SUPPORTED_DTYPES
        and w.dim() == 2
        and w.is_contiguous()
    )


class TunedGemm:
    """A cuBLASLt GEMM and the algorithm chosen for it: called as fn(x, w)."""

    def __init__(self, gemm: cublaslt.LtGemm, algo: cublaslt.Algo) -> None:
        self.gemm, self.algo = gemm, algo

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, w, self.algo)


@torch.inference_mode()
def tune_linears(model: torch.nn.Module, rows: list[int]) -> dict[tuple, dict[int, float]]:
    """Times each distinct projection of `model` at each row count in `rows` (up to
    MAX_ROWS) and installs the winners on the projections (`Linear.tuned`).

    Returns:
        {(N, K, dtype name): {rows: speed-up over F.linear}} for the choices made.
    """
    groups: dict[tuple, list[Linear]] = {}
    for module in model.modules():
        if isinstance(module, Linear) and _tunable(module):
            w = module.weight
            groups.setdefault((*w.shape, w.dtype), []).append(module)
    if not ENABLED or not groups:
        return {}
    start = time.perf_counter()
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    chosen: dict[tuple, dict[int, float]] = {}
    for (n, k, dtype), group in groups.items():
        weights = _weights_for_timing(group, l2_bytes)
        tuned: dict[int, TunedGemm] = {}
        for m in (r for r in rows if r <= MAX_ROWS):
            x = torch.randn(m, k, dtype=dtype, device=weights[0].device)
            ref = F.linear(x, weights[0]).float()
            torch_us = graph_us([lambda w=w: F.linear(x, w) for w in weights])  # noqa: B023
            gemm = cublaslt.LtGemm(m, n, k, dtype)
            algos, times = [], []
            for algo in gemm.candidates(CANDIDATES):
                err = ((gemm(x, weights[0], algo).float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:  # a wrong or NaN result: never
                    continue
                algos.append(algo)
                times.append(graph_us([lambda w=w, a=algo: gemm(x, w, a) for w in weights]))  # noqa: B023
            best = choose(torch_us, times, MARGIN)
            if best is not None:
                tuned[m] = TunedGemm(gemm, algos[best])
                name = str(dtype).removeprefix("torch.")
                chosen.setdefault((n, k, name), {})[m] = torch_us / times[best]
        for module in group:
            module.tuned = tuned
    logger.info(
        "GEMM tuning took %.1f s; cuBLASLt replaces F.linear in graphs for %s",
        time.perf_counter() - start,
        "; ".join(
            f"{n}x{k} at rows {', '.join(f'{m} ({s:.2f}x)' for m, s in by_rows.items())}"
            for (n, k, _), by_rows in chosen.items()
        ) or "no projection",
    )  # fmt: skip
    return chosen
