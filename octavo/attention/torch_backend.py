"""Attention over the paged KV cache in plain torch: the CPU path and the kernels' oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.attention.backend import AttentionBackend, AttentionMetadata

DECODE_GROUPS = 4  # length groups of a decode step (see TorchAttentionBackend._decode)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatters the new tokens' keys/values into their slots.

    k, v: [T, KVH, D]; kv_cache: [2, num_blocks, block_size, KVH, D]; slot_mapping: [T].
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, KVH, D]
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len keys and values of one sequence, each [seq_len, KVH, D]."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[:, block_table[:num_blocks].long()]  # [2, nb, bs, KVH, D]
    blocks = blocks.flatten(1, 2)[:, :seq_len]  # [2, seq_len, KVH, D]
    return blocks[0], blocks[1]


class TorchAttentionBackend(AttentionBackend):
    """Reference attention: one batched call for pure-decode steps, a loop over sequences
    otherwise (prefill, chunked prefill and prefix hits all take the loop)."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, md.slot_mapping[: md.num_tokens])
        q = q[: md.num_tokens]
        if md.is_all_decode:
            return self._decode(q, kv_cache, md, scale)
        out = torch.empty_like(q)
        starts = md.query_start_loc_cpu
        for i, seq_len in enumerate(md.seq_lens_cpu):
            start, end = starts[i], starts[i + 1]
            if end == start:
                continue
            keys, values = gather_kv(kv_cache, md.block_tables[i], seq_len)
            out[start:end] = _attend(q[start:end], keys, values, scale)
        return out

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """One token per sequence. The sequences are sorted by length and attended in up to
        DECODE_GROUPS groups, each padded only to its own longest context: padding a batch
        of mixed lengths to its longest wastes about half of the K/V gathering."""
        num_seqs = md.num_seqs
        lens = md.seq_lens_cpu
        groups = min(DECODE_GROUPS, num_seqs)
        if groups == 1:
            tables, seq_lens = md.block_tables[:num_seqs], md.seq_lens[:num_seqs]
            return _decode_group(q, kv_cache, tables, seq_lens, max(lens), scale)
        order_cpu = sorted(range(num_seqs), key=lens.__getitem__)
        order = torch.tensor(order_cpu, device=q.device)
        bounds = [num_seqs * g // groups for g in range(groups + 1)]
        out = torch.empty_like(q)
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            rows = order[lo:hi]
            longest = lens[order_cpu[hi - 1]]
            out[rows] = _decode_group(
                q[rows], kv_cache, md.block_tables[rows], md.seq_lens[rows], longest, scale
            )
        return out


def _decode_group(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Decode attention of B sequences padded to max_seq_len. q: [B, H, D] -> [B, H, D]."""
    block_size = kv_cache.shape[2]
    num_blocks = (max_seq_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()
    kv = kv_cache[:, table].flatten(2, 3)  # [2, B, L, KVH, D]
    length = kv.shape[2]
    valid = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, D]
        kv[0].transpose(1, 2),  # [B, KVH, L, D]
        kv[1].transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)  # [B, H, D]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q_len positions of a context over the whole context.

    q: [q_len, H, D]; keys/values: [ctx_len, KVH, D]; returns [q_len, H, D].
    """
    q_len, ctx_len = q.shape[0], keys.shape[0]
    qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if q_len == ctx_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query j sits at context position ctx_len - q_len + j and sees positions <= it.
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos  # [q_len, ctx_len]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Float32, loop-only reference (the oracle the kernels and the decode path are tested
    against). Same contract as AttentionBackend.forward."""
    write_kv_cache(k, v, kv_cache, md.slot_mapping[: md.num_tokens])
    out = torch.empty(q.shape[0], q.shape[1], q.shape[2], dtype=torch.float32, device=q.device)
    starts = md.query_start_loc_cpu
    group = q.shape[1] // kv_cache.shape[-2]
    for i, seq_len in enumerate(md.seq_lens_cpu):
        start, end = starts[i], starts[i + 1]
        keys, values = gather_kv(kv_cache.float(), md.block_tables[i], seq_len)
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)[:, None]
        allowed = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out
