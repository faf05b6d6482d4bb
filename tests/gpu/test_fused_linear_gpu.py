"""fused_linear (octavo/kernels/fused_linear.py) against the float32 torch reference on fresh
random inputs: each folding alone and together, row counts across tile edges, and a chain of
the four calls of a decoder layer that gives the same bits with PDL off, on and early."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from octavo.kernels import pdl
from octavo.kernels.fused_linear import fused_linear, fused_linear_reference

pytestmark = pytest.mark.gpu
EPS = 1e-6


def _randn(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


def _inputs(rows: int, n: int, k: int, gated: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = _randn(g, rows, k, scale=3.0)  # an unnormalized residual stream
    weight = _randn(g, (2 if gated else 1) * n, k, scale=k**-0.5)
    norm = (torch.rand(k, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    residual = _randn(g, rows, n)
    return x, weight, norm, residual


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within bf16 rounding of the output, relative to its scale."""
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 100])
@pytest.mark.parametrize(
    "norm,gated,residual",
    [(False, False, False), (True, False, False), (True, True, False), (False, False, True),
     (True, True, True)],
)  # fmt: skip
@pytest.mark.parametrize("n,k", [(64, 128), (1024, 1024), (4096, 768)])
def test_matches_the_reference(rows, norm, gated, residual, n, k):
    x, weight, norm_w, res = _inputs(rows, n, k, gated)
    kwargs = {
        "norm_weight": norm_w if norm else None,
        "eps": EPS,
        "gated": gated,
        "residual": res if residual else None,
    }
    out = fused_linear(x, weight, **kwargs)
    assert out.shape == (rows, n) and out.dtype == x.dtype
    _close(out, fused_linear_reference(x.float(), weight.float(), **{
        **kwargs,
        "norm_weight": norm_w.float() if norm else None,
        "residual": res.float() if residual else None,
    }))  # fmt: skip


def test_strided_rows_and_a_strided_residual():
    x, weight, norm_w, res = _inputs(8, 256, 512, False)
    wide = torch.zeros(8, 1024, dtype=x.dtype, device="cuda")
    wide[:, 100:612] = x
    res_wide = torch.zeros(8, 300, dtype=x.dtype, device="cuda")
    res_wide[:, 20:276] = res
    out = fused_linear(wide[:, 100:612], weight, norm_weight=norm_w, residual=res_wide[:, 20:276])
    _close(out, fused_linear_reference(x, weight, norm_weight=norm_w, residual=res))


def test_zero_rows():
    x, weight, _, _ = _inputs(1, 64, 128, False)
    assert fused_linear(x[:0], weight).shape == (0, 64)


@pytest.mark.parametrize(
    "shape_x,shape_w,why",
    [((4, 128), (64, 256), "weight"), ((4, 128), (40, 128), "N % 32"), ((4, 100), (64, 100), "K")],
)  # fmt: skip
def test_bad_shapes_raise_value_error(shape_x, shape_w, why):
    x = torch.zeros(*shape_x, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(*shape_w, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="fused_linear"):
        fused_linear(x, w)


def _layer(h, w_qkv, w_o, w_gu, w_down, ln1, ln2):
    """A decoder layer's four calls, attention replaced by a slice of qkv."""
    qkv = fused_linear(h, w_qkv, norm_weight=ln1, eps=EPS)
    h = fused_linear(qkv[:, : w_o.shape[1]], w_o, residual=h)
    act = fused_linear(h, w_gu, norm_weight=ln2, eps=EPS, gated=True)
    return fused_linear(act, w_down, residual=h)


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] < 9, reason="PDL needs Hopper or later")
def test_a_layer_chain_gives_the_same_bits_with_pdl_off_on_and_early(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(3)
    hidden, inter, rows = 1024, 3072, 8
    weights = (
        _randn(g, 2048, hidden, scale=0.03),  # qkv
        _randn(g, hidden, 1024, scale=0.03),  # o
        _randn(g, 2 * inter, hidden, scale=0.03),  # gate | up
        _randn(g, hidden, inter, scale=0.03),  # down
        _randn(g, hidden),
        _randn(g, hidden),
    )
    h0 = _randn(g, rows, hidden)

    def run(h):
        for _ in range(4):
            h = _layer(h, *weights)
        return h

    results = {}
    for on, early in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(pdl, "ENABLED", on)
        monkeypatch.setattr(pdl, "EARLY", early)
        eager = run(h0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(h0)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = run(h0)
        graph.replay()
        torch.cuda.synchronize()
        results[on, early] = (eager.clone(), static.clone())
    for setting in ((True, False), (True, True)):
        for off, on in zip(results[False, False], results[setting], strict=True):
            assert torch.equal(off, on)
