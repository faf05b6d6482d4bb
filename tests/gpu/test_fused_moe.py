"""The fused MoE kernels (octavo/kernels/fused_moe.py) against torch references on fresh random
inputs: routing against softmax + topk, the alignment by its invariants (each pair once, in
its expert's blocks, padding elsewhere), and the whole layer against a per-token float32
sum over its experts: M = 1, 3, 17, 256, 4096 rows, top-8 of 128 experts, experts that
receive no token, this rank's share of the experts, and inside a CUDA graph. With
OCTAVO_TRITON_INTERPRET=1 a small subset runs on the CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_env import DEVICE, INTERPRET, require_kernels

require_kernels()

from octavo.kernels import fused_moe

pytestmark = pytest.mark.gpu


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return {"rtol": tol, "atol": tol}


def _reference(x, w13, w2, ids, weights, first=0):
    """Each token's sum over its k experts, in float32 (an expert's tokens at a time)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    x, w13, w2 = x.float().cpu(), w13.float().cpu(), w2.float().cpu()
    ids, weights = ids.long().cpu() - first, weights.float().cpu()
    for local in range(w13.shape[0]):
        tokens, slots = (ids == local).nonzero(as_tuple=True)
        h = x[tokens] @ w13[local].T
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[local].T
        out.index_add_(0, tokens, weights[tokens, slots, None] * y)
    return out


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (5, 128, 8), (37, 60, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_softmax_topk(tokens, experts, top_k, renormalize):
    logits = torch.randn(tokens, experts, generator=_gen(tokens + experts)).to(DEVICE)
    counts = torch.zeros(experts, dtype=torch.int64, device=DEVICE)
    real = torch.tensor([tokens - 1], dtype=torch.int32, device=DEVICE)
    ids, weights = fused_moe.route(logits, top_k, renormalize, counts, real)
    ref_w, ref_ids = torch.topk(F.softmax(logits.float(), -1), top_k, -1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights.cpu(), ref_w.cpu(), rtol=1e-5, atol=1e-6)
    # Counted: every token but the last (a graph's padding row, say).
    expected = torch.bincount(ref_ids[: tokens - 1].flatten().cpu(), minlength=experts)
    assert torch.equal(counts.cpu(), expected)


def _check_alignment(ids, num_local, block_m, first, sorted_ids, block_expert, total):
    flat = ids.flatten().cpu() - first
    num_pairs = flat.numel()
    total = int(total.item())
    assert total % block_m == 0
    sorted_ids, block_expert = sorted_ids.cpu()[:total], block_expert.cpu()[: total // block_m]
    ours = ((flat >= 0) & (flat < num_local)).nonzero().flatten()
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == ours.tolist()  # each of this rank's pairs exactly once
    assert bool((sorted_ids[sorted_ids >= num_pairs] == num_pairs).all())
    slot_expert = block_expert.repeat_interleave(block_m)
    is_real = sorted_ids < num_pairs
    assert torch.equal(flat[sorted_ids[is_real].long()], slot_expert[is_real].long())
    assert bool((block_expert[1:] >= block_expert[:-1]).all())  # runs in expert order
    counts = torch.bincount(flat[ours], minlength=num_local)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())


@pytest.mark.parametrize("pairs_path", ["kernel", "torch"])
@pytest.mark.parametrize(
    "tokens,experts,top_k,block_m,first,num_local",
    [(1, 8, 2, 16, 0, 8), (3, 128, 8, 16, 0, 128), (40, 16, 4, 32, 4, 8), (17, 64, 6, 64, 0, 64)],
)
def test_align_invariants(pairs_path, tokens, experts, top_k, block_m, first, num_local,
                          monkeypatch):  # fmt: skip
    if pairs_path == "torch":
        monkeypatch.setattr(fused_moe, "ALIGN_KERNEL_MAX_PAIRS", 0)
    gen = _gen(tokens * experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.to(torch.int32).to(DEVICE)
    out = fused_moe.align(ids, num_local, block_m, first)
    _check_alignment(ids, num_local, block_m, first, *out)


def _layer_inputs(tokens, experts, top_k, hidden, inter, dtype, seed, skewed=False):
    gen = _gen(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    if skewed:  # half the experts never chosen
        logits[:, experts // 2 :] -= 100
    weights, ids = torch.topk(F.softmax(logits, -1), top_k, -1)
    return [t.to(DEVICE) for t in (x, w13, w2, ids.to(torch.int32), weights)]


CASES = [(1, 8, 2, 64, 32), (3, 128, 8, 32, 16), (17, 16, 4, 64, 48), (2, 8, 2, 256, 128)]
if not INTERPRET:
    CASES += [(256, 128, 8, 2048, 768), (4096, 128, 8, 512, 256), (16, 128, 8, 2048, 768)]


@pytest.fixture(params=["small", "sorted"])
def path(request, monkeypatch):
    """Both paths of fused_experts on every case: the small one (no sort) and the sorted."""
    monkeypatch.setattr(fused_moe, "SMALL_MAX_PAIRS", 1 << 30 if request.param == "small" else 0)
    return request.param


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("skewed", [False, True])
def test_fused_experts_match_reference(tokens, experts, top_k, hidden, inter, dtype, skewed,
                                       path):  # fmt: skip
    if INTERPRET and dtype == torch.bfloat16 and tokens > 3:
        pytest.skip("the interpreter's bfloat16 dot is slow")
    if path == "small" and tokens > 256:
        pytest.skip("the small path is for a few rows")
    x, w13, w2, ids, weights = _layer_inputs(
        tokens, experts, top_k, hidden, inter, dtype, seed=tokens * 31 + hidden, skewed=skewed
    )
    out = fused_moe.fused_experts(x, w13, w2, ids, weights)
    ref = _reference(x, w13, w2, ids, weights)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), ref, **_tolerance(dtype))


def _to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert's rows rounded to e4m3 with a float32 scale per row: (codes, scales, the
    weights they stand for)."""
    from octavo.quant.rounding import quantize_fp8

    pairs = [quantize_fp8(w[e].float().cpu()) for e in range(w.shape[0])]
    codes = torch.stack([q for q, _ in pairs])
    scales = torch.stack([s for _, s in pairs])
    return codes.to(DEVICE), scales.to(DEVICE), (codes.float() * scales[..., None]).to(DEVICE)


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_experts_match_their_dequantized_weights(tokens, experts, top_k, hidden, inter, dtype,
                                                      path):  # fmt: skip
    """e4m3 experts with a scale per row (quantization="fp8"): the layer over the weights
    the codes stand for, activations in x's dtype."""
    if INTERPRET and (dtype == torch.bfloat16 and tokens > 3 or tokens > 17):
        pytest.skip("the interpreter's bfloat16 dot is slow")
    if path == "small" and tokens > 256:
        pytest.skip("the small path is for a few rows")
    x, w13, w2, ids, weights = _layer_inputs(
        tokens, experts, top_k, hidden, inter, dtype, seed=tokens * 7 + hidden
    )
    (c13, s13, d13), (c2, s2, d2) = _to_fp8(w13), _to_fp8(w2)
    out = fused_moe.fused_experts(x, c13, c2, ids, weights, scales=(s13, s2))
    ref = _reference(x, d13, d2, ids, weights)
    torch.testing.assert_close(out.float().cpu(), ref, **_tolerance(dtype))


@pytest.mark.parametrize("first,num_local", [(0, 4), (4, 4), (2, 3)])
def test_fused_experts_of_one_rank(first, num_local, path):
    """Expert parallelism: a rank with experts first .. first + num_local - 1 gives their
    share alone."""
    x, w13, w2, ids, weights = _layer_inputs(7, 8, 3, 32, 16, torch.float32, seed=first)
    mine = slice(first, first + num_local)
    out = fused_moe.fused_experts(x, w13[mine], w2[mine], ids, weights, first, num_experts=8)
    ref = _reference(x, w13[mine], w2[mine], ids, weights, first)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs")
@pytest.mark.parametrize("tokens", [1, 16])
def test_fused_layer_in_a_cuda_graph(tokens):
    """Routing, alignment and both GEMMs captured once, replayed over new inputs."""
    x, w13, w2, _, _ = _layer_inputs(tokens, 128, 8, 256, 128, torch.bfloat16, seed=tokens)
    router = torch.randn(128, 256, device=DEVICE, dtype=torch.bfloat16)
    counts = torch.zeros(128, dtype=torch.int64, device=DEVICE)
    real = torch.tensor([tokens], dtype=torch.int32, device=DEVICE)

    def layer(inp):
        ids, weights = fused_moe.route(F.linear(inp, router), 8, True, counts, real)
        return fused_moe.fused_experts(inp, w13, w2, ids, weights)

    static = x.clone()
    layer(static)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    for seed in range(3):
        fresh = torch.randn(static.shape, generator=_gen(seed)).to(static)
        static.copy_(fresh)
        counts.zero_()
        graph.replay()
        assert int(counts.sum()) == tokens * 8
        torch.testing.assert_close(out, layer(fresh), rtol=0, atol=0)
