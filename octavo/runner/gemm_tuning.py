"""Measured GEMM algorithms for the projections that CUDA graphs capture.

At decode row counts a projection is latency-bound, and cuBLAS's first heuristic pick (what
`F.linear` runs) is sometimes well off its best. At start-up, before graph capture,
`tune_linears` times `F.linear` against cuBLASLt's candidates (kernels/cublaslt.py) for each
distinct projection and row count; the winners run inside CUDA graphs, while eager steps keep
`F.linear` (a ctypes call would cost more host time than it saves).

Each candidate is timed as a CUDA graph over enough weights of the shape to overflow L2, as in
a decode step. The choices are kept in octavo's cache, one file per GPU model and library
versions, so only the first start-up on a machine pays. OCTAVO_LT_GEMMS=0 turns it all off.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from octavo.cache import cache_root
from octavo.kernels import cublaslt
from octavo.model.layers import Linear

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("OCTAVO_LT_GEMMS", "1") != "0"
MAX_ROWS = 64  # above this a projection's time grows with its rows; cuBLAS's pick holds
MARGIN = 0.03  # a candidate must beat F.linear by this fraction
# cuBLASLt's first 4 heuristic algorithms, each also with K split 2, 4 and 8: a wider sweep
# found no winner worth having outside these.
CANDIDATES = 4


def graph_us(fns: list[Callable[[], object]], replays: int = 3, rounds: int = 2) -> float:
    """Microseconds per call of `fns`, captured as one CUDA graph: the best of `rounds`
    means over `replays` replays. The first call is run once before, to load its kernel."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fns[0]()
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


class TuningCache:
    """{key: {"algo": hex or None (F.linear), "speedup": float}}, one JSON file.

    Args:
        path: the file; None keeps the choices in memory only.
    """

    def __init__(self, path: str | None) -> None:
        self.path, self.entries, self.changed = path, {}, False
        if path is not None and os.path.exists(path):
            try:
                with open(path) as f:
                    self.entries = dict(json.load(f))
            except (OSError, ValueError, TypeError) as e:  # a torn or foreign file: start over
                logger.info("ignoring the GEMM tuning cache %s: %r", path, e)

    @classmethod
    def for_this_gpu(cls) -> TuningCache:
        """The file for the current GPU model and the cuBLASLt and torch versions."""
        root = cache_root()
        if root is None:
            return cls(None)
        name = torch.cuda.get_device_name()
        key = (
            f"{name}|{torch.cuda.get_device_capability()}|{cublaslt.version()}|{torch.__version__}"
        )
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return cls(os.path.join(root, "gemm_tuning", f"{name.replace(' ', '_')}-{digest}.json"))

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict) -> None:
        self.entries[key] = entry
        self.changed = True

    def save(self) -> None:
        """Writes a new file and renames it into place (readers see all of it or none)."""
        if self.path is None or not self.changed:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, staging = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".saving-")
            with os.fdopen(fd, "w") as f:
                json.dump(self.entries, f, indent=0, sort_keys=True)
            os.replace(staging, self.path)
            self.changed = False
        except OSError as e:  # a read-only home, say: no cache, no harm
            logger.info("did not save the GEMM tuning cache %s: %r", self.path, e)


class TunedGemm:
    """A cuBLASLt GEMM and the algorithm chosen for it, called as fn(x, w): the product, or
    None (then the projection runs F.linear) for an input off the alignment the algorithm
    may rely on, or if cuBLASLt refuses the call."""

    def __init__(self, gemm: cublaslt.LtGemm, algo: cublaslt.Algo) -> None:
        self.gemm, self.algo = gemm, algo

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        if not (cublaslt.aligned(x) and cublaslt.aligned(w)):
            return None
        try:
            return self.gemm(x, w, self.algo)
        except RuntimeError as e:
            logger.warning("cuBLASLt failed at %s; F.linear instead: %s", self.shape, e)
            return None

    @property
    def shape(self) -> str:
        return f"{self.gemm.n}x{self.gemm.k} at {self.gemm.m} rows"

    def agrees(self, w: torch.Tensor) -> bool:
        """Runs once, eagerly, on a random input and compares with F.linear (so the first run
        of the algorithm is not inside a graph capture, and a stale choice shows)."""
        x = torch.randn(self.gemm.m, self.gemm.k, dtype=self.gemm.dtype, device=w.device)
        y = self(x, w)
        return y is not None and _same_product(y, F.linear(x, w))


def _tunable(module: Linear) -> bool:
    w = module.weight
    return (
        w is not None  # None: a quantized weight, which runs its own product
        and module.bias is None
        and w.is_cuda
        and w.dtype in cublaslt.SUPPORTED_DTYPES
        and w.dim() == 2
        and w.is_contiguous()
        and cublaslt.aligned(w)
    )


def _valid(entry: object) -> bool:
    """A cache entry as `_measure` writes it: {"algo": None or 64 bytes in hex, "speedup"}."""
    if not isinstance(entry, dict) or not isinstance(entry.get("speedup"), (int, float)):
        return False
    algo = entry.get("algo")
    if algo is None:
        return True
    size = 2 * ctypes.sizeof(cublaslt.Algo)
    return isinstance(algo, str) and len(algo) == size and all(c in _HEX for c in algo)


_HEX = frozenset("0123456789abcdef")


def _weights_for_timing(group: list[Linear], l2_bytes: int) -> list[torch.Tensor]:
    """Enough of the group's weights to exceed 1.5 times L2, cycling if it has too few."""
    w = group[0].weight
    needed = max(2, math.ceil(1.5 * l2_bytes / (w.numel() * w.element_size())))
    return [group[i % len(group)].weight for i in range(min(needed, 4 * len(group)))]


def _same_product(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """y is F.linear's `ref` up to accumulation order (relative error < 1e-2; NaN: never)."""
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def _algo(hex_bytes: str) -> cublaslt.Algo:
    return cublaslt.Algo.from_buffer_copy(bytes.fromhex(hex_bytes))


def _measure(gemm: cublaslt.LtGemm, weights: list[torch.Tensor]) -> dict:
    """Times F.linear and each candidate at gemm's shape; the cache entry for the winner."""
    x = torch.randn(gemm.m, gemm.k, dtype=gemm.dtype, device=weights[0].device)
    ref = F.linear(x, weights[0])
    torch_us = graph_us([lambda w=w: F.linear(x, w) for w in weights])
    algos, times = [], []
    for algo in gemm.candidates(CANDIDATES):
        if not _same_product(gemm(x, weights[0], algo), ref):
            continue
        algos.append(algo)
        times.append(graph_us([lambda w=w, a=algo: gemm(x, w, a) for w in weights]))
    best = choose(torch_us, times, MARGIN)
    if best is None:
        return {"algo": None, "speedup": 1.0}
    return {"algo": bytes(algos[best]).hex(), "speedup": round(torch_us / times[best], 3)}


@torch.inference_mode()
def tune_linears(model: torch.nn.Module, rows: list[int]) -> dict[str, float]:
    """Chooses each distinct projection's GEMM at each row count in `rows` up to MAX_ROWS,
    from the cache or by timing, and installs the winners (`Linear.tuned`).

    Returns:
        {"NxK/dtype/rows": speed-up over F.linear} for the projections that got one.
    """
    groups: dict[tuple, list[Linear]] = {}
    for module in model.modules():
        if isinstance(module, Linear) and _tunable(module):
            w = module.weight
            groups.setdefault((*w.shape, w.dtype), []).append(module)
    if not ENABLED or not groups:
        return {}
    try:
        cublaslt.library()
    except RuntimeError as e:  # ROCm, say: F.linear everywhere
        logger.info("no GEMM tuning: %s", e)
        return {}
    start, timed = time.perf_counter(), 0
    cache = TuningCache.for_this_gpu()
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    chosen: dict[str, float] = {}
    for (n, k, dtype), group in groups.items():
        tuned: dict[int, TunedGemm] = {}
        for m in sorted({r for r in rows if r <= MAX_ROWS}):
            key = f"{n}x{k}/{str(dtype).removeprefix('torch.')}/{m}"
            try:
                gemm = cublaslt.LtGemm(m, n, k, dtype)
                entry, fresh = cache.get(key), False
                for _ in range(2):  # the cache's entry, else (or if it fails) a measured one
                    if not _valid(entry):
                        entry, fresh = _measure(gemm, _weights_for_timing(group, l2_bytes)), True
                    if entry["algo"] is None:
                        break
                    winner = TunedGemm(gemm, _algo(entry["algo"]))
                    if gemm.accepts(winner.algo) and winner.agrees(group[0].weight):
                        tuned[m] = winner
                        chosen[key] = entry["speedup"]
                        break
                    if fresh:
                        raise RuntimeError("the chosen algorithm does not give the product")
                    entry = None  # a stale cache entry: measure
            except Exception as e:  # noqa: BLE001 - a failed cuBLASLt call: F.linear here
                logger.warning("GEMM tuning of %s failed, F.linear stays: %r", key, e)
                continue
            if fresh:
                cache.put(key, entry)
                timed += 1
        for module in group:
            module.tuned = tuned
    cache.save()
    logger.info(
        "GEMM tuning: %d shapes timed in %.1f s; cuBLASLt replaces F.linear in graphs for %s",
        timed, time.perf_counter() - start,
        ", ".join(f"{key} ({speedup:.2f}x)" for key, speedup in chosen.items()) or "none",
    )  # fmt: skip
    return chosen
