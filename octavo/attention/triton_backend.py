"""Attention on CUDA through Triton kernels: store K/V, then decode or prefill/extend.

    forward(q, k, v, kv_cache, md)
      store_kv             new k/v -> their slots                  (octavo/kernels/store_kv.py)
      max_query_len == 1:  decode_attention, split-K over the KV   (decode_attention.py)
      otherwise:           prefill_attention, causal, paged prefix (prefill_attention.py);
                           decode rows mixed into the batch go here too

No step reads the device from the host: grid sizes come from host ints (`md.num_tokens`,
`md.num_seqs`) and tensor shapes. The decode launch depends only on shapes (batch size and
block-table width), so a CUDA graph captured over fixed-shape metadata buffers replays the same
grid whatever the lengths are.
"""

from __future__ import annotations

import torch

from octavo.attention.backend import AttentionBackend, AttentionMetadata
from octavo.kernels.decode_attention import decode_attention, decode_attention_qkv
from octavo.kernels.prefill_attention import prefill_attention
from octavo.kernels.store_kv import store_kv


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels (CUDA; also runs under TRITON_INTERPRET=1 on CPU).

    NOTE: for CUDA-graph decode, pad the batch and keep `block_tables` at a fixed width: the
    number of KV splits is chosen from the token count and `block_tables.shape[1]`, and a
    padding sequence with seq_len 0 produces zeros. Its padding tokens still go through
    `store_kv`, so their `slot_mapping` entries must name a slot no real sequence reads (e.g. a
    reserved block).
    """

    name = "triton"
    attends_stored_kv = True
    decodes_from_qkv = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """See AttentionBackend.forward. Returns [md.num_tokens, H, D] in q's dtype."""
        num_tokens = md.num_tokens
        store_kv(k[:num_tokens], v[:num_tokens], kv_cache, md.slot_mapping[:num_tokens])
        return self.attend(q, kv_cache, md, scale)

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Attention of q [T, H, D] over the cache, which already holds this step's K/V."""
        q = q[: md.num_tokens]  # [T, H, D]
        if md.is_all_decode:
            # One token per sequence: row b of q is sequence b.
            return decode_attention(
                q, kv_cache, md.seq_lens, md.block_tables, scale, order=md.decode_order
            )
        return prefill_attention(
            q,
            kv_cache,
            md.query_start_loc,
            md.seq_lens,
            md.block_tables,
            scale,
            num_seqs=md.num_seqs,
        )

    def decode_from_qkv(
        self,
        qkv: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        num_heads: int,
        cos_sin_cache: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """A pure-decode step (md.is_all_decode) from qkv [B, (H + 2 * KVH) * D]: q/k norm
        (if given) and rotary at position seq_len - 1, the K/V store and attention, in one
        kernel (`decode_attention_qkv`). Returns [B, H, D]."""
        return decode_attention_qkv(
            qkv, kv_cache, md.seq_lens, md.block_tables, md.slot_mapping[: qkv.shape[0]],
            cos_sin_cache, scale, num_heads, q_norm, k_norm, eps, order=md.decode_order,
        )  # fmt: skip
