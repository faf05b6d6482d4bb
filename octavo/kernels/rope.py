"""Rotary embedding of the q and k heads of a fused qkv projection, with Qwen3's per-head
RMSNorm before it, in one kernel: one program per token, all its heads at once.

    qkv [T, (H + 2 * KVH) * D]:  | q heads 0..H-1 | k heads 0..KVH-1 | v heads |
    head h of token t:  x = qkv[t, h * D : (h + 1) * D]
      (optional) x = w * to_dtype(x * rsqrt(mean(x^2) + eps))       w: q's or k's norm weight
      x1, x2 = x[:D/2], x[D/2:]                                       (HF's rotate-half layout)
      out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]                cos/sin at position t

Two ways out:
- `qk_norm_rope`: q and k land in one [T, H + KVH, D] tensor and come back as views of it.
- `qk_norm_rope_store`: q lands in a [T, H, D] tensor, while the rotated k and the untouched
  v go straight to the token's slot of the paged KV cache (what `store_kv` would do next),
  which saves a kernel per layer and a round trip of k through memory.

The torch reference is `RotaryEmbedding` (and `RMSNorm` on each head) on a non-CUDA tensor;
here the rotation is computed in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.paged_kv_tile import to_cache
from octavo.kernels.pdl import pdl_args


@triton.jit
def _norm_rope_heads(
    src_ptr,  # first head of this token's group of heads in qkv
    weight_ptr,  # [D] norm weight (read only if HAS_NORM)
    cos,  # [HALF] float32
    sin,
    eps,
    NUM: tl.constexpr,  # heads in the group
    NUM_PAD: tl.constexpr,  # next power of two >= NUM
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """The rotated halves [NUM_PAD, D/2] of NUM consecutive heads (padding rows are 0)."""
    half: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, NUM_PAD)
    offs = tl.arange(0, half)
    mask = (offs_h < NUM)[:, None]
    ptrs = src_ptr + offs_h[:, None] * HEAD_DIM + offs[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + half, mask=mask, other=0.0)
    if HAS_NORM:
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        sq = tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)
        inv_rms = tl.rsqrt(sq / HEAD_DIM + eps)[:, None]  # [NUM_PAD, 1]
        w1 = tl.load(weight_ptr + offs).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + half + offs).to(tl.float32)[None, :]
        # As HF: normalize, round to the dtype, times the weight, round again.
        x1 = ((x1f * inv_rms).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype)
        x2 = ((x2f * inv_rms).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    return x1f * cos[None, :] - x2f * sin[None, :], x2f * cos[None, :] + x1f * sin[None, :]


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,  # [T, >= (H + 2 * KVH) * D], head_dim contiguous
    q_out_ptr,  # [T, q_out_heads, D], contiguous: q heads first (then k unless STORE_KV)
    positions_ptr,  # [T] int64
    cos_sin_ptr,  # [max_position, D] float32: cos in the first half, sin in the second
    q_weight_ptr,  # [D] (read only if HAS_NORM)
    k_weight_ptr,  # [D]
    k_cache_ptr,  # [num_slots, KVH, D] (written only if STORE_KV)
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64 (read only if STORE_KV)
    k_scale,  # an fp8 cache's (paged_kv_tile.to_cache)
    v_scale,
    stride_qkv,
    q_out_heads,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, half)
    pos = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + offs)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + half + offs)
    src = qkv_ptr + token * stride_qkv

    q1, q2 = _norm_rope_heads(
        src, q_weight_ptr, cos, sin, eps, NUM_HEADS, HEADS_PAD, HEAD_DIM, HAS_NORM
    )
    offs_h = tl.arange(0, HEADS_PAD)
    dst = q_out_ptr + token * q_out_heads * HEAD_DIM + offs_h[:, None] * HEAD_DIM + offs[None, :]
    mask = (offs_h < NUM_HEADS)[:, None]
    tl.store(dst, q1.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, q2.to(q_out_ptr.dtype.element_ty), mask=mask)

    k1, k2 = _norm_rope_heads(
        src + NUM_HEADS * HEAD_DIM, k_weight_ptr, cos, sin, eps, NUM_KV_HEADS, KV_HEADS_PAD,
        HEAD_DIM, HAS_NORM,
    )  # fmt: skip
    offs_h = tl.arange(0, KV_HEADS_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None]
    rows = offs_h[:, None] * HEAD_DIM + offs[None, :]  # [KV_HEADS_PAD, HALF]
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + token)  # int64: slot * row size cannot overflow
        row = slot * (NUM_KV_HEADS * HEAD_DIM)
        tl.store(k_cache_ptr + row + rows, to_cache(k1, k_scale, k_cache_ptr), mask=mask)
        tl.store(k_cache_ptr + row + rows + half, to_cache(k2, k_scale, k_cache_ptr), mask=mask)
        v_src = src + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + rows
        v1 = tl.load(v_src, mask=mask)
        v2 = tl.load(v_src + half, mask=mask)
        tl.store(v_cache_ptr + row + rows, to_cache(v1, v_scale, v_cache_ptr), mask=mask)
        tl.store(v_cache_ptr + row + rows + half, to_cache(v2, v_scale, v_cache_ptr), mask=mask)
    else:
        dst = q_out_ptr + (token * q_out_heads + NUM_HEADS) * HEAD_DIM + rows
        tl.store(dst, k1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half, k2.to(q_out_ptr.dtype.element_ty), mask=mask)


def _check(qkv, head_dim, q_weight, k_weight) -> None:
    if qkv.stride(-1) != 1 or head_dim & (head_dim - 1) or head_dim < 2:
        raise ValueError("qk_norm_rope needs a contiguous last dim and a power-of-two head_dim")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("pass both q and k norm weights, or neither")


def _launch(qkv, out, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim, q_weight,
            k_weight, eps, kv_cache=None, slot_mapping=None,
            kv_scales=(1.0, 1.0)) -> None:  # fmt: skip
    has_norm = q_weight is not None
    store = kv_cache is not None
    dummy = cos_sin_cache  # any tensor, for pointers the kernel never reads
    _qk_norm_rope_kernel[(qkv.shape[0],)](
        qkv,
        out,
        positions,
        cos_sin_cache,
        q_weight if has_norm else dummy,
        k_weight if has_norm else dummy,
        kv_cache[0] if store else dummy,
        kv_cache[1] if store else dummy,
        slot_mapping if store else positions,
        *kv_scales,
        qkv.stride(0),
        out.shape[1],
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HAS_NORM=has_norm,
        STORE_KV=store,
        num_warps=4 if num_heads * head_dim >= 2048 else 2,
        **pdl_args(qkv.device),
    )


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (and, with weights, first RMS-normalized) q and k heads of `qkv`.

    Args:
        qkv: [T, (H + 2 * KVH) * D] from the fused projection (rows may be strided).
        positions: [T] int64; cos_sin_cache: [P, D] float32 (cos | sin halves).
        q_weight, k_weight: [D] per-head norm weights (Qwen3), or both None.
    Returns:
        q [T, H, D] and k [T, KVH, D]: views of one new [T, H + KVH, D] tensor.
    """
    _check(qkv, head_dim, q_weight, k_weight)
    num_tokens = qkv.shape[0]
    out = torch.empty(
        num_tokens, num_heads + num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device
    )
    if num_tokens:
        _launch(qkv, out, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim,
                q_weight, k_weight, eps)  # fmt: skip
    return out[:, :num_heads], out[:, num_heads:]


def qk_norm_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """As `qk_norm_rope`, but the rotated k and the v heads of `qkv` are written to their
    slots of the paged cache instead of returned.

    Args:
        kv_cache: [2, num_blocks, block_size, KVH, D], contiguous, in qkv's dtype or e4m3.
        slot_mapping: [T] int64 slot of each token (`block * block_size + offset`).
        k_scale, v_scale: the scales of an fp8 (e4m3) cache's keys and values.
    Returns:
        q [T, H, D], a new contiguous tensor.
    """
    _check(qkv, head_dim, q_weight, k_weight)
    num_tokens = qkv.shape[0]
    if kv_cache.shape[-2:] != (num_kv_heads, head_dim) or not kv_cache.is_contiguous():
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} is not a contiguous paged cache "
            f"of {num_kv_heads} heads x {head_dim}"
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be [T] int64, got {slot_mapping.dtype}")
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _launch(qkv, out, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim,
                q_weight, k_weight, eps, kv_cache, slot_mapping, (k_scale, v_scale))  # fmt: skip
    return out
