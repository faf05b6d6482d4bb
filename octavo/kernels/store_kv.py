"""Writes the new tokens' keys and values into their slots of the paged KV cache.

One program per token copies that token's [KVH, D] key and value rows to its slot (an fp8
cache gets k / k_scale and v / v_scale in e4m3: paged_kv_tile.to_cache):

    kv_cache: [2, num_blocks, block_size, KVH, D]  ->  viewed as [2, num_slots, KVH, D]
    slot_mapping[t] = 37  ->  k[t] goes to kv_cache[0, 37 // block_size, 37 % block_size]

The torch reference is `octavo.attention.torch_backend.write_kv_cache`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.paged_kv_tile import to_cache
from octavo.kernels.pdl import pdl_args


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, KVH, D], head_dim contiguous
    v_ptr,  # [T, KVH, D]
    k_cache_ptr,  # [num_slots, KVH, D], contiguous
    v_cache_ptr,  # [num_slots, KVH, D]
    slot_mapping_ptr,  # [T] int64
    k_scale,
    v_scale,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)  # int64, so slot * row size cannot overflow
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_KV_HEADS)[:, None]  # [BLOCK_H, 1]

    k_src = k_ptr + token * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :]
    v_src = v_ptr + token * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :]
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_src, mask=mask)  # [BLOCK_H, D]
    v = tl.load(v_src, mask=mask)
    tl.store(k_cache_ptr + dst, to_cache(k, k_scale, k_cache_ptr), mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_scale, v_cache_ptr), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatters k/v of the new tokens into the paged cache, in place.

    Args:
        k, v: [T, KVH, D]; the token and head strides may be anything (a slice of a fused
            qkv projection is fine), the head_dim stride must be 1.
        kv_cache: [2, num_blocks, block_size, KVH, D], contiguous; keys at 0, values at 1.
        slot_mapping: [T] int64 slot of each token (`block * block_size + offset`).
        k_scale, v_scale: the scales of an fp8 (e4m3) cache's keys and values.
    Raises:
        ValueError: when the layouts above do not hold.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or kv_cache.shape[-2:] != (num_kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(kv_cache.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("store_kv needs head_dim-contiguous k/v and a contiguous kv_cache")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be [T] int64, got {slot_mapping.dtype}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        k_scale,
        v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
        **pdl_args(k.device),
    )
