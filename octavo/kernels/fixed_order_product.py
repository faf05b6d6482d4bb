"""Deterministic mode's dense product: fixed_gemm's bits, at cuBLAS's speed where it has it.

fixed_gemm gives each output one float32 accumulator fed in k order, so a row's bits never
depend on the rows beside it. cuBLASLt's algorithms with K unsplit accumulate the same way:
on an H100 every one tried gave fixed_gemm's bits, to the last, at every row count, for
Qwen3-8B's projections (benchmarks/lt_invariance.py), and from about a thousand rows up they
run at cuBLAS's speed, where fixed_gemm takes up to 1.6x. So a product of LT_ROWS rows or more
runs on such an algorithm, chosen once per weight shape only after it gave fixed_gemm's bits on
a probe; smaller products, biased ones, and shapes where no algorithm does, run fixed_gemm.
OCTAVO_FIXED_GEMM_LT=0 keeps fixed_gemm everywhere.
"""

from __future__ import annotations

import os

import torch

from octavo.kernels import cublaslt
from octavo.kernels.fixed_gemm import fixed_gemm

LT_ROWS = 1024
ENABLED = os.environ.get("OCTAVO_FIXED_GEMM_LT", "1") != "0"
PROBE_ROWS = (LT_ROWS, LT_ROWS + 3, 2 * LT_ROWS)  # row counts a candidate must match at
CANDIDATES = 4  # cuBLASLt's first heuristic picks at most, in its order
MAX_GEMMS = 256  # cached descriptors (one per row count) before the cache starts over


class FixedOrderProduct:
    """`product(x, w, bias)` for model/layers.use_fixed_order_products."""

    def __init__(self, min_rows: int = LT_ROWS) -> None:
        self.min_rows = min_rows
        self.algos: dict[tuple, object | None] = {}  # (n, k, dtype, device) -> Algo or None
        self._gemms: dict[tuple, cublaslt.LtGemm | None] = {}  # (m, n, k, dtype) -> accepted

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if bias is None and ENABLED and x.is_cuda and x.dim() == 2 and x.dtype == w.dtype:
            m, k = x.shape
            if m >= self.min_rows and x.is_contiguous() and w.is_contiguous():
                y = self._lt(x, w, m, w.shape[0], k)
                if y is not None:
                    return y
        return fixed_gemm(x, w, bias)

    def _lt(self, x: torch.Tensor, w: torch.Tensor, m: int, n: int, k: int):
        """x @ w.T on the shape's chosen algorithm, or None where there is none for it."""
        if not (cublaslt.aligned(x) and cublaslt.aligned(w)) or x.dtype not in (
            torch.bfloat16,
            torch.float16,
        ):
            return None
        try:
            algo = self._algo(w)
        except (OSError, RuntimeError):  # no cuBLASLt here: fixed_gemm everywhere
            self.algos[(*w.shape, w.dtype, w.device)] = algo = None
        gemm = None if algo is None else self._gemm(m, n, k, x.dtype, algo)
        return None if gemm is None else gemm(x, w, algo)

    def _algo(self, w: torch.Tensor):
        # NOTE: the first product of a shape probes, so it must not be inside a CUDA graph's
        # capture: the runner's warm-ups and each capture's eager run come first.
        key = (*w.shape, w.dtype, w.device)
        if key not in self.algos:
            self.algos[key] = self._probe(w)
        return self.algos[key]

    def _gemm(self, m: int, n: int, k: int, dtype: torch.dtype, algo) -> cublaslt.LtGemm | None:
        key = (m, n, k, dtype)
        if key not in self._gemms:
            if len(self._gemms) >= MAX_GEMMS:
                self._gemms.clear()
            gemm = cublaslt.LtGemm(m, n, k, dtype)
            self._gemms[key] = gemm if gemm.accepts(algo) else None
        return self._gemms[key]

    @torch.inference_mode()
    def _probe(self, w: torch.Tensor):
        """cuBLASLt's first algorithm (K unsplit) that gives fixed_gemm's bits at every
        PROBE_ROWS row count on random rows; None if none does."""
        n, k = w.shape
        gen = torch.Generator(w.device).manual_seed(0)
        x = torch.randn(max(PROBE_ROWS), k, generator=gen, device=w.device).to(w.dtype)
        ref = fixed_gemm(x, w)
        big = cublaslt.LtGemm(8 * LT_ROWS, n, k, w.dtype)
        for algo in big.candidates(CANDIDATES, splits=(1,)):
            gemms = [cublaslt.LtGemm(m, n, k, w.dtype) for m in PROBE_ROWS]
            if all(g.accepts(algo) for g in gemms) and all(
                torch.equal(g(x[: g.m], w, algo), ref[: g.m]) for g in gemms
            ):
                return algo
        return None
