"""Programmatic dependent launch changes when a kernel may start, never what it computes: a
chain of our kernels behind cuBLAS GEMMs gives the same bits with PDL on and off, eagerly and
replayed from a CUDA graph (where PDL becomes programmatic graph edges)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from octavo.kernels import pdl
from octavo.kernels.activation import silu_and_mul
from octavo.kernels.rms_norm import rms_norm

pytestmark = pytest.mark.gpu


def _chain(x, residual, w_up, w_down, norm_weight):
    """GEMM -> RMSNorm with residual -> GEMM -> SiLU-and-mul -> GEMM -> RMSNorm, as in a layer."""
    h, residual = rms_norm(x @ w_down.T, norm_weight, 1e-6, residual)
    h = silu_and_mul(h @ w_up.T) @ w_down.T
    return rms_norm(h, norm_weight, 1e-6, residual)


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] < 9, reason="PDL needs Hopper or later")
def test_same_bits_with_and_without_pdl(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter, rows = 1024, 3072, 96

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    x, residual = randn(rows, inter), randn(rows, hidden)
    w_up, w_down, norm_weight = (
        randn(2 * inter, hidden) * 0.03,
        randn(hidden, inter) * 0.03,
        randn(hidden),
    )
    args = (x, residual, w_up, w_down, norm_weight)
    results = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        assert pdl.pdl_enabled(x.device) == on
        eager = _chain(*args)
        side = torch.cuda.Stream()  # warm up on a side stream first, as torch's docs advise
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _chain(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = _chain(*args)
        graph.replay()
        torch.cuda.synchronize()
        results[on] = [t.clone() for t in (*eager, *static)]
    for off, on in zip(results[False], results[True], strict=True):
        assert torch.equal(off, on)
