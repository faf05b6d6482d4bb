"""Deterministic mode's dense product: fixed_gemm's bits, at cuBLAS's speed where it has it.

fixed_gemm gives each output one float32 accumulator fed in k order, so a row's bits never
depend on the rows beside it. cuBLASLt's algorithms with K unsplit accumulate the same way:
on an H100 every one tried gave fixed_gemm's bits, to the last, at every row count, for
Qwen3-8B's projections (benchmarks/lt_invariance.py), where fixed_gemm takes up to 1.6x
cuBLAS's time. So products run on such an algorithm wherever a probe found one:

- LT_ROWS rows or more: one algorithm per weight shape, cuBLASLt's pick for 8k rows, probed
  at a few row counts (any row count then gets a descriptor of its own, no probe);
- SMALL_ROWS up to LT_ROWS: per row count, the first of cuBLASLt's picks for that count that
  gives fixed_gemm's bits there (decode steps' products; at 128-1,023 rows such picks run at
  cuBLAS's speed, where fixed_gemm takes up to 1.6x: `lt_invariance.py --small`).

Fewer rows, biased products, a count first seen inside a CUDA graph's capture (a probe runs
work of its own), and shapes where no algorithm matches run fixed_gemm: the same bits either
way. OCTAVO_FIXED_GEMM_LT=0 keeps fixed_gemm everywhere.
"""

from __future__ import annotations

import os

import torch

from octavo.kernels import cublaslt
from octavo.kernels.fixed_gemm import fixed_gemm

LT_ROWS = 1024
SMALL_ROWS = 32  # below it, fixed_gemm is as fast, and few of cuBLASLt's picks match
ENABLED = os.environ.get("OCTAVO_FIXED_GEMM_LT", "1") != "0"
PROBE_ROWS = (LT_ROWS, LT_ROWS + 3, 2 * LT_ROWS)  # row counts a candidate must match at
CANDIDATES = 4  # cuBLASLt's first heuristic picks at most, in its order
SMALL_CANDIDATES = 8  # the same for a row count below LT_ROWS (fewer of them match there)
MAX_GEMMS = 256  # cached descriptors (one per row count) before the cache starts over


class FixedOrderProduct:
    """`product(x, w, bias)` for model/layers.use_fixed_order_products."""

    def __init__(self, min_rows: int = SMALL_ROWS) -> None:
        self.min_rows = min_rows
        self.algos: dict[tuple, object | None] = {}  # (n, k, dtype, device) -> Algo or None
        self._gemms: dict[tuple, cublaslt.LtGemm | None] = {}  # (m, n, k, dtype) -> accepted
        # (m, n, k, dtype, device) -> (gemm, algo) or None, for m below LT_ROWS: a few
        # thousand entries at most, kept for good
        self.small: dict[tuple, tuple | None] = {}

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
        if m < LT_ROWS:
            return self._small(x, w, m, n, k)
        try:
            algo = self._algo(w)
        except (OSError, RuntimeError):  # no cuBLASLt here: fixed_gemm everywhere
            self.algos[(*w.shape, w.dtype, w.device)] = algo = None
        gemm = None if algo is None else self._gemm(m, n, k, x.dtype, algo)
        return None if gemm is None else gemm(x, w, algo)

    def _small(self, x: torch.Tensor, w: torch.Tensor, m: int, n: int, k: int):
        key = (m, n, k, w.dtype, w.device)
        if key not in self.small:
            if torch.cuda.is_current_stream_capturing():
                return None  # no probe inside a capture: fixed_gemm, the same bits
            try:
                self.small[key] = self._probe_rows(w, m)
            except (OSError, RuntimeError):
                self.small[key] = None
        found = self.small[key]
        return None if found is None else found[0](x, w, found[1])

    @torch.inference_mode()
    def _probe_rows(self, w: torch.Tensor, m: int) -> tuple | None:
        """(gemm, algo): the first of cuBLASLt's picks for m rows (K unsplit) that gives
        fixed_gemm's bits on random rows; None if none does."""
        n, k = w.shape
        gen = torch.Generator(w.device).manual_seed(m)
        x = torch.randn(m, k, generator=gen, device=w.device).to(w.dtype)
        ref = fixed_gemm(x, w)
        gemm = cublaslt.LtGemm(m, n, k, w.dtype)
        for algo in gemm.candidates(SMALL_CANDIDATES, splits=(1,)):
            if torch.equal(gemm(x, w, algo), ref):
                return gemm, algo
        return None

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
