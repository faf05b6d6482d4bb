"""The torch attention backend against the loop-only float32 `reference_attention` and against
per-sequence causal attention: batched decode (length groups, the per-step plan shared by
all layers, the reused gather workspace) and the prefill loop (with and without a cached
prefix), on random inputs of mixed lengths, with and without grouped-query heads."""

from __future__ import annotations

import pytest
import torch

from octavo.attention.backend import build_metadata
from octavo.attention.torch_backend import (
    TorchAttentionBackend,
    _attend,
    gather_kv,
    reference_attention,
)

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


def test_prefill_writes_the_new_keys_and_values_into_their_slots():
    md, cache, (q, k, v) = _case([6, 3], [6, 9], heads=6, kv_heads=2)
    TorchAttentionBackend().forward(q, k, v, cache, md, 0.25)
    flat = cache.view(2, -1, 2, 16)
    torch.testing.assert_close(flat[0, md.slot_mapping], k)
    torch.testing.assert_close(flat[1, md.slot_mapping], v)
