"""Test helper: attention over the paged KV cache computed the slowest, plainest way (float32,
a loop over sequences, GQA by repeating the KV heads): the oracle the torch backend's decode
path and the Triton kernels are tested against."""

from __future__ import annotations

import torch

from octavo.attention.backend import AttentionMetadata
from octavo.attention.torch_backend import from_kv_cache, gather_kv, write_kv_cache


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Float32, loop-only reference (the oracle the kernels and the decode path are tested
    against). Same contract as AttentionBackend.forward."""
    write_kv_cache(k, v, kv_cache, md.slot_mapping[: md.num_tokens], k_scale, v_scale)
    out = torch.empty(q.shape[0], q.shape[1], q.shape[2], dtype=torch.float32, device=q.device)
    starts = md.query_start_loc_cpu
    group = q.shape[1] // kv_cache.shape[-2]
    for i, seq_len in enumerate(md.seq_lens_cpu):
        start, end = starts[i], starts[i + 1]
        keys, values = gather_kv(kv_cache, md.block_tables[i], seq_len)
        keys = from_kv_cache(keys, torch.float32, k_scale).repeat_interleave(group, dim=1)
        values = from_kv_cache(values, torch.float32, v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        if softcap is not None:  # Gemma 2
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)[:, None]
        allowed = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
        if window is not None:  # sliding: the last `window` positions only
            allowed &= torch.arange(seq_len, device=q.device)[None, :] > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out
