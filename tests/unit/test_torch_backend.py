"""The torch attention backend against the loop-only float32 `reference_attention` and against
per-sequence causal attention: batched decode (length groups, the per-step plan shared by
all layers, the reused gather workspace) and the prefill loop (with and without a cached
prefix), on random inputs of mixed lengths, with and without grouped-query heads; and the
`Attention` layer's path from the qkv projection (split, q/k norm, rotary) into it."""

from __future__ import annotations

import pytest
import torch
from attention_reference import reference_attention

from octavo.attention.backend import AttentionSpec, build_metadata
from octavo.attention.layer import Attention, bind_kv_caches
from octavo.attention.torch_backend import (
    TorchAttentionBackend,
    _attend,
    gather_kv,
)
from octavo.model.layers import RMSNorm
from octavo.model.rotary import RotaryEmbedding

BLOCK_SIZE = 4


def _case(query_lens, seq_lens, heads, kv_heads, dim=16, seed=0):
    """Metadata over shuffled physical blocks, a random cache, and random q/k/v."""
    torch.manual_seed(seed)
    pages = [-(-n // BLOCK_SIZE) for n in seq_lens]
    perm = torch.randperm(sum(pages) + 3).tolist()  # shuffled, with unused blocks
    tables = [perm[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(pages))]
    md = build_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
    cache = torch.randn(2, sum(pages) + 3, BLOCK_SIZE, kv_heads, dim)
    t = sum(query_lens)
    qkv = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
    return md, cache, qkv


DECODE_LENS = [[5], [1, 40], [3, 70, 17, 33, 1, 64, 9], list(range(1, 40)), [16, 16, 32, 4]]


@pytest.mark.parametrize("seq_lens", DECODE_LENS)
def test_decode_matches_per_sequence_attention(seq_lens):
    md, cache, (q, k, v) = _case([1] * len(seq_lens), seq_lens, heads=6, kv_heads=2)
    out = TorchAttentionBackend().forward(q, k, v, cache, md, scale=0.3)
    for i, n in enumerate(seq_lens):
        keys, values = gather_kv(cache, md.block_tables[i], n)
        ref = _attend(q[i : i + 1], keys, values, 0.3)
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("seq_lens", DECODE_LENS)
def test_decode_matches_reference(seq_lens, heads, kv_heads):
    md, cache, (q, k, v) = _case([1] * len(seq_lens), seq_lens, heads, kv_heads)
    ref = reference_attention(q, k, v, cache.clone(), md, 0.25)
    out = TorchAttentionBackend().forward(q, k, v, cache, md, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("error")  # index_select(out=) warns when it must resize
def test_decode_plan_is_per_step_and_workspace_is_reused_across_layers_and_steps():
    """Layers of one step share the metadata (one plan); the next step, with new lengths and
    a larger batch, must not reuse the old plan, and the grown workspace must not leak
    values from the step before."""
    backend = TorchAttentionBackend()
    for step, seq_lens in enumerate([[3, 9, 2], [4, 10, 3, 30, 17, 1], [5, 11]]):
        md, cache, _ = _case([1] * len(seq_lens), seq_lens, heads=6, kv_heads=2, seed=step)
        for layer in range(3):  # each layer: its own cache and q/k/v, the same metadata
            layer_cache = cache * (layer + 1)
            q, k, v = (torch.randn(len(seq_lens), h, 16) for h in (6, 2, 2))
            ref = reference_attention(q, k, v, layer_cache.clone(), md, 0.25)
            out = backend.forward(q, k, v, layer_cache, md, 0.25)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        ([7], [7]),  # one prompt, nothing cached
        ([5, 12, 1, 30], [5, 12, 1, 30]),  # a prefill batch of mixed lengths
        ([3, 8, 1], [11, 8, 20]),  # a prefix hit, a fresh prompt, a decode token
        ([0, 6], [9, 6]),  # a sequence with no new tokens this step
        ([4, 4], [4, 13]),  # a chunk of a prompt after cached chunks
    ],
)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
def test_prefill_matches_reference(query_lens, seq_lens, heads, kv_heads):
    md, cache, (q, k, v) = _case(query_lens, seq_lens, heads, kv_heads)
    ref = reference_attention(q, k, v, cache.clone(), md, 0.25)
    out = TorchAttentionBackend().forward(q, k, v, cache, md, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 0.7])
@pytest.mark.parametrize("dim", [16, 8])  # the C kernel; SDPA (head_dim not in 16s)
@pytest.mark.parametrize("window", [1, 6, 25, None])
@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [([1] * 7, [3, 70, 17, 33, 1, 64, 9]), ([3, 8, 1, 30], [11, 8, 20, 30]), ([4, 4], [4, 13])],
)
def test_sliding_window_and_softcap_match_reference(query_lens, seq_lens, window, dim, softcap):
    """Each query attends to its last `window` positions only, its scores soft-capped
    where asked: decode batches, prefills and chunks behind a cached prefix."""
    md, cache, (q, k, v) = _case(query_lens, seq_lens, 6, 2, dim)
    ref = reference_attention(q, k, v, cache.clone(), md, 0.25, window=window, softcap=softcap)
    plain = reference_attention(q, k, v, cache.clone(), md, 0.25)
    out = TorchAttentionBackend().forward(q, k, v, cache, md, 0.25, window=window,
                                          softcap=softcap)  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if softcap is not None or window is not None and window < max(seq_lens):
        assert not torch.allclose(ref, plain)  # the window or the cap mattered


def test_prefill_writes_the_new_keys_and_values_into_their_slots():
    md, cache, (q, k, v) = _case([6, 3], [6, 9], heads=6, kv_heads=2)
    TorchAttentionBackend().forward(q, k, v, cache, md, 0.25)
    flat = cache.view(2, -1, 2, 16)
    torch.testing.assert_close(flat[0, md.slot_mapping], k)
    torch.testing.assert_close(flat[1, md.slot_mapping], v)


# ---------------------------------------------------------------- from the qkv projection


def _rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, heads, D] normalized over D, written out rather than through RMSNorm."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1], [5, 17, 2]), ([3, 8, 1], [11, 8, 20])])
@torch.no_grad()
def test_attention_layer_splits_normalizes_rotates_then_attends(qk_norm, query_lens, seq_lens):
    """Attention(qkv, positions, md) equals the reference on q/k/v split out of qkv, each
    q/k head RMS-normalized (Qwen3) and rotated at its position; the cache gets the rotated
    k and the untouched v."""
    heads, kv_heads, dim, eps = 6, 2, 16, 1e-6
    md, cache, _ = _case(query_lens, seq_lens, heads, kv_heads, dim)
    rope = RotaryEmbedding(dim, 64, 10000.0)
    norms = (RMSNorm(dim, eps), RMSNorm(dim, eps)) if qk_norm else (None, None)
    for norm in norms:
        if norm is not None:
            norm.weight.data.normal_(1, 0.3)
    layer = Attention(heads, kv_heads, dim, 0.25, rope, *norms)
    bind_kv_caches(layer, [cache], TorchAttentionBackend())
    t = md.num_tokens
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim)
    positions = torch.tensor(
        [s - q + j for q, s in zip(query_lens, seq_lens, strict=True) for j in range(q)]
    )

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    q, k, v = q.reshape(t, heads, dim), k.reshape(t, kv_heads, dim), v.reshape(t, kv_heads, dim)
    if qk_norm:
        q = _rms_norm_heads(q, norms[0].weight.detach(), eps)
        k = _rms_norm_heads(k, norms[1].weight.detach(), eps)
    q, k = rope(positions, q.reshape(t, -1), k.reshape(t, -1))
    q, k = q.view(t, heads, dim), k.view(t, kv_heads, dim)
    want_cache = cache.clone()
    ref = reference_attention(q, k, v, want_cache, md, 0.25)

    out = layer(qkv, positions, md)
    assert out.shape == (t, heads * dim)
    torch.testing.assert_close(out.view(t, heads, dim), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, want_cache, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_attention_layer_holds_its_rope_and_norms_by_reference():
    """The layer registers none of the modules it is given (the model owns them and their
    checkpoint names), and attends with their current weights."""
    rope, q_norm, k_norm = RotaryEmbedding(16, 64, 10000.0), RMSNorm(16), RMSNorm(16)
    layer = Attention(4, 2, 16, 0.25, rope, q_norm, k_norm)
    assert list(layer.named_parameters()) == [] and list(layer.named_buffers()) == []
    assert list(layer.children()) == []
    assert layer.spec.q_norm is q_norm and layer.spec.rotary_emb is rope
    md, cache, _ = _case([2], [2], 4, 2)
    bind_kv_caches(layer, [cache], TorchAttentionBackend())
    qkv, positions = torch.randn(2, 8 * 16), torch.arange(2)
    before = layer(qkv, positions, md)
    q_norm.weight.data.mul_(2)
    assert not torch.allclose(layer(qkv, positions, md), before)


def test_spec_takes_both_norms_or_neither():
    rope = RotaryEmbedding(16, 64, 10000.0)
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        AttentionSpec(4, 2, 16, 0.25, rope, q_norm=RMSNorm(16))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        AttentionSpec(6, 4, 16, 0.25, rope)


def test_attention_layer_without_a_bound_cache_raises():
    layer = Attention(4, 2, 16, 0.25, RotaryEmbedding(16, 64, 10000.0))
    md, _, _ = _case([1], [1], 4, 2)
    with pytest.raises(RuntimeError, match="before the model runner bound a KV cache"):
        layer(torch.randn(1, 8 * 16), torch.zeros(1, dtype=torch.int64), md)


@torch.no_grad()
def test_rotary_tables_are_built_once_a_step_and_never_reused_by_the_next():
    """Layers of one step share the rotary tables of its positions; a step with new metadata
    and new positions gets its own (each layer's output equals a fresh backend's)."""
    rope = RotaryEmbedding(16, 64, 10000.0)
    layers = [Attention(6, 2, 16, 0.25, rope) for _ in range(2)]
    backend = TorchAttentionBackend()
    for step, seq_lens in enumerate([[5, 9], [6, 10], [3]]):
        md, cache, _ = _case([1] * len(seq_lens), seq_lens, heads=6, kv_heads=2, seed=step)
        positions = torch.tensor([n - 1 for n in seq_lens])
        for layer in layers:
            fresh_layer, fresh_cache = Attention(6, 2, 16, 0.25, rope), cache.clone()
            bind_kv_caches(fresh_layer, [fresh_cache], TorchAttentionBackend())
            bind_kv_caches(layer, [cache], backend)
            qkv = torch.randn(len(seq_lens), 10 * 16)
            assert torch.equal(layer(qkv, positions, md), fresh_layer(qkv, positions, md))
            assert torch.equal(cache, fresh_cache)


def test_rotary_embedding_is_hf_apply_rotary_pos_emb_bit_for_bit():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 512, 10000.0)
    positions = torch.randint(0, 512, (7,))
    q, k = torch.randn(7, 9 * 64), torch.randn(7, 3 * 64)
    cos, sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    heads_first = lambda x: x.view(7, -1, 64).transpose(0, 1)[None]
    want_q, want_k = apply_rotary_pos_emb(heads_first(q), heads_first(k), cos, sin)
    got_q, got_k = rope(positions, q, k)
    assert torch.equal(heads_first(got_q), want_q) and torch.equal(heads_first(got_k), want_k)


@torch.no_grad()
def test_rotary_tables_follow_the_positions_even_under_the_same_metadata():
    rope = RotaryEmbedding(16, 64, 10000.0)
    layer, fresh = Attention(6, 2, 16, 0.25, rope), Attention(6, 2, 16, 0.25, rope)
    md, cache, _ = _case([1, 1], [5, 9], heads=6, kv_heads=2)
    bind_kv_caches(layer, [cache.clone()], TorchAttentionBackend())
    qkv = torch.randn(2, 10 * 16)
    layer(qkv, torch.tensor([4, 8]), md)
    bind_kv_caches(fresh, [cache.clone()], TorchAttentionBackend())
    other = torch.tensor([3, 7])
    assert torch.equal(layer(qkv, other, md), fresh(qkv, other, md))
