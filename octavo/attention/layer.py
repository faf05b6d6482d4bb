"""The attention layer the models hold: a thin handle on the backend and its KV cache."""

from __future__ import annotations

import torch
from torch import nn

from octavo.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Paged attention of one transformer layer.

    The model runner binds `kv_cache` ([2, num_blocks, block_size, num_kv_heads, head_dim])
    and `backend` after allocating the cache; the model only passes q/k/v and metadata.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, KVH*D] -> [T, H*D]."""
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("Attention used before the model runner bound a KV cache")
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, self.kv_cache, md, self.scale)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    @property
    def attends_stored_kv(self) -> bool:
        """Whether the model may write this step's K/V itself and call `attend_stored`."""
        return self.backend is not None and self.backend.attends_stored_kv

    @property
    def decodes_from_qkv(self) -> bool:
        """Whether the model may hand a pure-decode step's qkv to `decode_from_qkv`."""
        return self.backend is not None and self.backend.decodes_from_qkv

    def decode_from_qkv(
        self,
        qkv: torch.Tensor,
        md: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """qkv [B, (H + 2 * KVH) * D] of a pure-decode step -> [B, H*D]: norm, rotary, the
        K/V store and attention in the backend (see TritonAttentionBackend.decode_from_qkv)."""
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("Attention used before the model runner bound a KV cache")
        out = self.backend.decode_from_qkv(
            qkv, self.kv_cache, md, self.scale, self.num_heads, cos_sin_cache, q_norm, k_norm,
            eps,
        )  # fmt: skip
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def attend_stored(self, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D], with this step's K/V already in `kv_cache` -> [T, H*D]."""
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("Attention used before the model runner bound a KV cache")
        out = self.backend.attend(q, self.kv_cache, md, self.scale)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)


def bind_kv_caches(
    model: nn.Module, kv_caches: list[torch.Tensor], backend: AttentionBackend
) -> list[Attention]:
    """Gives each Attention module of `model`, in order, its layer's cache and the backend."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(kv_caches):
        raise RuntimeError(f"model has {len(layers)} attention layers, got {len(kv_caches)} caches")
    for layer, cache in zip(layers, kv_caches, strict=True):
        layer.kv_cache = cache
        layer.backend = backend
    return layers
