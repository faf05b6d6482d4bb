"""The torch attention backend's batched decode (sequences grouped by length) against plain
causal attention over each sequence's own gathered context."""

from __future__ import annotations

import pytest
import torch

from octavo.attention.backend import build_metadata
from octavo.attention.torch_backend import TorchAttentionBackend, _attend, gather_kv


@pytest.mark.parametrize("seq_lens", [[5], [1, 40], [3, 70, 17, 33, 1, 64, 9], list(range(1, 40))])
def test_decode_matches_per_sequence_attention(seq_lens):
    torch.manual_seed(len(seq_lens))
    heads, kv_heads, dim, block_size = 6, 2, 16, 4
    pages = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(pages)).tolist()  # shuffled physical blocks
    tables = [perm[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(pages))]
    md = build_metadata([1] * len(seq_lens), seq_lens, tables, block_size)
    cache = torch.randn(2, sum(pages), block_size, kv_heads, dim)
    q = torch.randn(len(seq_lens), heads, dim)
    k = torch.randn(len(seq_lens), kv_heads, dim)
    v = torch.randn(len(seq_lens), kv_heads, dim)
    out = TorchAttentionBackend().forward(q, k, v, cache, md, scale=0.3)
    for i, n in enumerate(seq_lens):
        keys, values = gather_kv(cache, md.block_tables[i], n)
        ref = _attend(q[i : i + 1], keys, values, 0.3)
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)
