"""The attention backend interface, the metadata every backend reads, and the spec of a layer.

A backend takes one layer's qkv projection for one step and does everything up to the
attention output: split it into q, k and v, normalize the q/k heads (if the layer has
norms), rotate q and k, write the new K/V into their slots of the paged cache, then attend
each query token over its sequence's cached context. The backend picks how: the torch backend
does each step in torch, the Triton backend fuses them into one or two kernels.

    block_table[seq] = [7, 2, 9]      block_size = 4
    token 9 of seq -> logical block 9 // 4 = 2 -> physical 9 -> slot 9 * 4 + 9 % 4 = 37
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """Where each token of a flat batch goes and what it attends to.

    The batch is `B` sequences laid end to end: sequence i owns query tokens
    `query_start_loc[i]:query_start_loc[i+1]`, which are the last tokens of a context of
    `seq_lens[i]` tokens (cached prefix + new tokens). Causality follows from that: query
    token j of sequence i sees context positions `< seq_lens[i] - query_len_i + j + 1`.
    """

    num_tokens: int
    query_start_loc: torch.Tensor  # [B + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    # Host copies, so CPU-side code never synchronizes with the device to read them.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Decode steps may carry [B] int32: the sequences by context length, longest first. The
    # Triton decode kernel starts them in that order (a scheduling hint, not a semantic).
    decode_order: torch.Tensor | None = None
    # A model whose layers attend two ways (core/hybrid_kv.py): this metadata with the
    # sliding-window layers' own slots and block tables, which those layers read instead.
    sliding: AttentionMetadata | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_all_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """What one layer's attention computes, besides its KV cache.

        qkv [T, (H + 2 * KVH) * D] = | q: H * D | k: KVH * D | v: KVH * D |
        q, k -> RMSNorm over each head (q_norm, k_norm; both or neither) -> rotary

    NOTE: `rotary_emb`, `q_norm` and `k_norm` are the model's own modules, held by reference:
    the model keeps them as its attributes, so their parameters keep their checkpoint names,
    and a backend reads their current tensors at each call.

    Attributes:
        rotary_emb: `forward(positions [T], q [T, H * D], k [T, KVH * D])` -> rotated (q, k),
            the same in two steps (`cos_sin(positions, dtype)` once a step, then
            `rotate(x, cos, sin)`), and `cos_sin_cache` [max_position, D] float32 (cos | sin
            halves).
        q_norm, k_norm: RMSNorm over head_dim (`weight` [D], `eps`), or None.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # softmax scale, usually head_dim ** -0.5
    rotary_emb: nn.Module
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    # A query at context position p sees positions p - window + 1 .. p (None: all up to p).
    sliding_window: int | None = None
    # Gemma 2: a score x (after the scale) becomes cap * tanh(x / cap) before the softmax.
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("q_norm and k_norm must be given together, or neither")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def qkv_sizes(self) -> tuple[int, int, int]:
        """Widths of q, k and v in a qkv row."""
        kv_size = self.num_kv_heads * self.head_dim
        return self.num_heads * self.head_dim, kv_size, kv_size


class AttentionBackend(ABC):
    """Computes attention over the paged KV cache.

    A KV cache tensor of one layer has shape [2, num_blocks, block_size, num_kv_heads,
    head_dim] (keys at index 0, values at 1); the model runner allocates one per layer and
    binds it, with the backend, to that layer's `Attention` module. It holds the model's dtype,
    or float8 e4m3 (`kv_cache_dtype="fp8"`): then a key k is stored as e4m3(k / k_scale),
    clamped to +-448, and read back as that times k_scale, values likewise with v_scale
    (torch_backend.to_kv_cache). Other caches ignore the scales, which are 1.0 for them.
    """

    name: str = "abstract"

    @abstractmethod
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
        """One layer's attention from its qkv projection: split, q/k norm, rotary, the K/V
        store, attention. What the `Attention` layer calls.

        Args:
            qkv: [T, (H + 2 * KVH) * D] output of the fused projection (rows may be strided).
            positions: [T] int64 position of each token in its sequence.
            kv_cache: this layer's cache, [2, num_blocks, block_size, num_kv_heads, head_dim].
            md: the step's metadata, shared by all layers.
            spec: the layer's head counts, scale, rotary and q/k norms.
            k_scale, v_scale: the scales of an fp8 cache's keys and values.
        Returns:
            [T, num_heads, head_dim] attention output.
        """

    @abstractmethod
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
        """Store k/v of the new tokens in the cache, then attend: the attention of
        `forward_qkv` once q and k are normalized and rotated.

        Args:
            q: [T, num_heads, head_dim] queries of the new tokens.
            k, v: [T, num_kv_heads, head_dim] keys/values of the new tokens.
            kv_cache, md, k_scale, v_scale: as for forward_qkv.
            scale, window, softcap: the spec's scale, sliding_window (or None) and
                logit_softcap (or None).
        Returns:
            [T, num_heads, head_dim] attention output.
        """


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Builds metadata from plain lists (the model runner and tests use this).

    Slots follow the block tables: the new tokens of sequence i sit at positions
    `seq_lens[i] - query_lens[i] .. seq_lens[i] - 1` of its context.
    """
    query_start_loc = [0]
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        query_start_loc.append(query_start_loc[-1] + q_len)
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max((len(t) for t in block_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        num_tokens=query_start_loc[-1],
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(
            len(block_tables), width
        ),
        max_query_len=max(query_lens, default=0),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=list(seq_lens),
    )
