"""Attention on CUDA through Triton kernels, from the qkv projection to the attention output.

    forward_qkv(qkv, positions, kv_cache, md, spec)
      max_query_len == 1:  decode_attention_qkv: q/k norm, rotary, the K/V store and
                           split-K decode attention in one kernel   (decode_attention.py)
      otherwise:           qk_norm_rope_store: q/k norm, rotary, k/v into their slots
                           (rope.py), then `attend`
    forward(q, k, v, kv_cache, md)      q/k already normalized and rotated
      store_kv             new k/v -> their slots                  (store_kv.py)
      then `attend`
    attend(q, kv_cache, md)             this step's K/V already in the cache
      max_query_len == 1:  decode_attention, split-K over the KV   (decode_attention.py)
      otherwise:           prefill_attention, causal, paged prefix (prefill_attention.py);
                           decode rows mixed into the batch go here too
    deterministic mode (`split`): every step through qk_norm_rope_store and
    prefill_attention over fixed spans of the context, a decode step's spans in parallel

No step reads the device from the host: grid sizes come from host ints (`md.num_tokens`,
`md.num_seqs`) and tensor shapes. The decode launch depends only on shapes (batch size and
block-table width), so a CUDA graph captured over fixed-shape metadata buffers replays the same
grid whatever the lengths are.
"""

from __future__ import annotations

import torch

from octavo.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec
from octavo.kernels.decode_attention import decode_attention, decode_attention_qkv
from octavo.kernels.prefill_attention import prefill_attention
from octavo.kernels.rope import qk_norm_rope_store
from octavo.kernels.store_kv import store_kv


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels (CUDA; also runs under TRITON_INTERPRET=1 on CPU).

    NOTE: for CUDA-graph decode, pad the batch and keep `block_tables` at a fixed width: the
    number of KV splits is chosen from the token count and `block_tables.shape[1]`, and a
    padding sequence with seq_len 0 produces zeros. Its padding tokens still go through the
    K/V store, so their `slot_mapping` entries must name a slot no real sequence reads (e.g. a
    reserved block).
    """

    name = "triton"
    # Pure-decode steps run `decode_attention_qkv`, one kernel from qkv to the output. False
    # sends them through `qk_norm_rope_store` and `attend` instead, as other steps go (the
    # same results, two kernels; benchmarks switch it to compare the two).
    decodes_from_qkv = True
    # > 0: deterministic mode (runner/deterministic.py). Every step, decode included, runs
    # the prefill kernel over fixed spans of `split` context positions, so a token's output
    # is the same bits whatever step computes it.
    split = 0

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        spec: AttentionSpec,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """See AttentionBackend.forward_qkv. Returns [T, H, D] in qkv's dtype (T of a
        decode step is qkv's rows, else `md.num_tokens`)."""
        cos_sin_cache = spec.rotary_emb.cos_sin_cache  # [max_position, D] float32
        q_weight = k_weight = None
        eps = 1e-6  # read only with norm weights
        if spec.q_norm is not None and spec.k_norm is not None:
            q_weight, k_weight, eps = spec.q_norm.weight, spec.k_norm.weight, spec.q_norm.eps
        slot_mapping = md.slot_mapping[: qkv.shape[0]]
        if md.is_all_decode and self.decodes_from_qkv and not self.split:
            # NOTE: the kernel rotates at position seq_len - 1, not `positions`: the same in a
            # step of one new token per sequence, CUDA-graph padding rows included
            # (runner/inputs.py).
            return decode_attention_qkv(
                qkv, kv_cache, md.seq_lens, md.block_tables, slot_mapping, cos_sin_cache,
                spec.scale, spec.num_heads, q_weight, k_weight, eps, order=md.decode_order,
                k_scale=k_scale, v_scale=v_scale, window=spec.sliding_window,
                softcap=spec.logit_softcap,
            )  # fmt: skip
        # q [T, H, D] comes back; k and v go straight into their cache slots.
        q = qk_norm_rope_store(
            qkv, positions, cos_sin_cache, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            kv_cache, slot_mapping, q_weight, k_weight, eps, k_scale, v_scale,
        )  # fmt: skip
        return self.attend(
            q, kv_cache, md, spec.scale, k_scale, v_scale, spec.sliding_window,
            spec.logit_softcap,
        )  # fmt: skip

    def forward(
        self,
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
        """See AttentionBackend.forward. Returns [md.num_tokens, H, D] in q's dtype."""
        num_tokens = md.num_tokens
        store_kv(
            k[:num_tokens], v[:num_tokens], kv_cache, md.slot_mapping[:num_tokens],
            k_scale, v_scale,
        )  # fmt: skip
        return self.attend(q, kv_cache, md, scale, k_scale, v_scale, window, softcap)

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of q [T, H, D] over the cache, which already holds this step's K/V."""
        q = q[: md.num_tokens]  # [T, H, D]
        scales = {"k_scale": k_scale, "v_scale": v_scale, "window": window, "softcap": softcap}
        if md.is_all_decode and not self.split:
            # One token per sequence: row b of q is sequence b.
            return decode_attention(
                q, kv_cache, md.seq_lens, md.block_tables, scale, order=md.decode_order, **scales
            )
        return prefill_attention(
            q,
            kv_cache,
            md.query_start_loc,
            md.seq_lens,
            md.block_tables,
            scale,
            num_seqs=md.num_seqs,
            split=self.split,
            all_decode=md.is_all_decode,
            **scales,
        )
