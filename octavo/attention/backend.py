"""The attention backend interface and the metadata every backend reads.

A backend does two things per layer and step: write the new K/V into their slots of the
paged cache, then attend each query token over its sequence's cached context.

    block_table[seq] = [7, 2, 9]      block_size = 4
    token 9 of seq -> logical block 9 // 4 = 2 -> physical 9 -> slot 9 * 4 + 9 % 4 = 37
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


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
    max_seq_len: int
    # Host copies, so CPU-side code never synchronizes with the device to read them.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Decode steps may carry [B] int32: the sequences by context length, longest first. The
    # Triton decode kernel starts them in that order (a scheduling hint, not a semantic).
    decode_order: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_all_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Computes attention over the paged KV cache.

    A KV cache tensor of one layer has shape [2, num_blocks, block_size, num_kv_heads,
    head_dim] (keys at index 0, values at 1); the model runner allocates one per layer and
    binds it, with the backend, to that layer's `Attention` module.
    """

    name: str = "abstract"
    # True if `attend` exists: attention over K/V that an earlier kernel already stored
    # (the fused rotary kernel writes them on CUDA).
    attends_stored_kv: bool = False
    # True if `decode_from_qkv` exists: a pure-decode step straight from the qkv projection,
    # q/k norm, rotary and the K/V store included (one Triton kernel on CUDA).
    decodes_from_qkv: bool = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store k/v of the new tokens in the cache, then attend.

        Args:
            q: [T, num_heads, head_dim] queries of the new tokens.
            k, v: [T, num_kv_heads, head_dim] keys/values of the new tokens.
            kv_cache: this layer's cache, [2, num_blocks, block_size, num_kv_heads, head_dim].
            md: the step's metadata, shared by all layers.
            scale: softmax scale, usually head_dim ** -0.5.
        Returns:
            [T, num_heads, head_dim] attention output.
        """


def get_attention_backend(name: str) -> AttentionBackend:
    """Backends by name, imported lazily so the CPU path never imports Triton."""
    if name == "torch":
        from octavo.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from octavo.attention.triton_backend import TritonAttentionBackend  # type: ignore

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")


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
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=list(seq_lens),
    )
