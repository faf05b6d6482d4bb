"""The attention layer the models hold: a thin handle on the backend and its KV cache."""

from __future__ import annotations

import torch
from torch import nn

from octavo.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec


class Attention(nn.Module):
    """Paged attention of one transformer layer, from the qkv projection to its output.

    The model passes its rotary embedding and optional per-head q/k norms at construction;
    the layer keeps them in `spec` by reference, not as submodules, so their parameters stay
    the model's (and keep their checkpoint names). The model runner binds `kv_cache`
    ([2, num_blocks, block_size, num_kv_heads, head_dim]) and `backend` after allocating the
    cache; the backend picks how to compute (see AttentionBackend.forward_qkv).

    `k_scale` and `v_scale` scale an fp8 cache's keys and values (AttentionBackend): 1.0,
    vLLM's default for a checkpoint without scales. octavo reads none and calibrates none
    (docs/ARCHITECTURE.md, "An fp8 KV cache", says why). NOTE: a CUDA graph keeps the values
    it was captured with.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        rotary_emb: nn.Module,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        # A frozen dataclass is a plain attribute to nn.Module: nothing here is registered.
        self.spec = AttentionSpec(
            num_heads, num_kv_heads, head_dim, scale, rotary_emb, q_norm, k_norm,
            sliding_window, logit_softcap,
        )  # fmt: skip
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.k_scale = self.v_scale = 1.0

    def forward(
        self, qkv: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """qkv: [T, (H + 2 * KVH) * D], positions: [T] -> [T, H * D].

        Raises RuntimeError if the model runner has not bound a KV cache yet.
        """
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("Attention used before the model runner bound a KV cache")
        if md.sliding is not None and self.spec.sliding_window is not None:
            md = md.sliding  # this layer's blocks are the sliding layers' (core/hybrid_kv.py)
        out = self.backend.forward_qkv(
            qkv, positions, self.kv_cache, md, self.spec, self.k_scale, self.v_scale
        )
        return out.reshape(out.shape[0], self.spec.num_heads * self.spec.head_dim)


def bind_kv_caches(
    model: nn.Module, kv_caches: list[torch.Tensor | None], backend: AttentionBackend
) -> list[Attention]:
    """Gives each Attention module of `model`, in order, its layer's cache (None: none) and
    the backend."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(kv_caches):
        raise RuntimeError(f"model has {len(layers)} attention layers, got {len(kv_caches)} caches")
    for layer, cache in zip(layers, kv_caches, strict=True):
        layer.kv_cache = cache
        layer.backend = backend
    return layers
