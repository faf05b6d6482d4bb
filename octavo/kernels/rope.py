"""Rotary embedding of the q and k heads of a fused qkv projection, with Qwen3's per-head
RMSNorm before it, in one kernel: one program per (token, head).

    qkv [T, (H + 2 * KVH) * D]:  | q heads 0..H-1 | k heads 0..KVH-1 | v heads |
    head h of token t:  x = qkv[t, h * D : (h + 1) * D]
      (optional) x = w * to_dtype(x * rsqrt(mean(x^2) + eps))       w: q's or k's norm weight
      x1, x2 = x[:D/2], x[D/2:]                                       (HF's rotate-half layout)
      out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]                cos/sin at position t

The result lands in one [T, H + KVH, D] tensor, so q and k come back as views of it. The
torch reference is `RotaryEmbedding` (and `RMSNorm` on each head) on a non-CUDA tensor; here
the rotation is computed in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,  # [T, >= (H + KVH) * D], head_dim contiguous
    out_ptr,  # [T, H + KVH, D], contiguous
    positions_ptr,  # [T] int64
    cos_sin_ptr,  # [max_position, D] float32: cos in the first half, sin in the second
    q_weight_ptr,  # [D] (read only if HAS_NORM)
    k_weight_ptr,  # [D]
    stride_qkv,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    offs = tl.arange(0, HEAD_DIM // 2)
    src = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    x1 = tl.load(src + offs)
    x2 = tl.load(src + half + offs)
    if HAS_NORM:
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        inv_rms = tl.rsqrt((tl.sum(x1f * x1f, axis=0) + tl.sum(x2f * x2f, axis=0)) / HEAD_DIM + eps)
        is_q = head < NUM_HEADS
        q_w1 = tl.load(q_weight_ptr + offs).to(tl.float32)
        q_w2 = tl.load(q_weight_ptr + half + offs).to(tl.float32)
        k_w1 = tl.load(k_weight_ptr + offs).to(tl.float32)
        k_w2 = tl.load(k_weight_ptr + half + offs).to(tl.float32)
        w1 = tl.where(is_q, q_w1, k_w1)
        w2 = tl.where(is_q, q_w2, k_w2)
        # As HF: normalize, round to the dtype, times the weight, round again.
        x1 = ((x1f * inv_rms).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype)
        x2 = ((x2f * inv_rms).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype)
    pos = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + offs)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + half + offs)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    dst = out_ptr + (token * (NUM_HEADS + NUM_KV_HEADS) + head) * HEAD_DIM
    tl.store(dst + offs, (x1f * cos - x2f * sin).to(out_ptr.dtype.element_ty))
    tl.store(dst + half + offs, (x2f * cos + x1f * sin).to(out_ptr.dtype.element_ty))


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
    num_tokens = qkv.shape[0]
    if qkv.stride(-1) != 1 or head_dim & (head_dim - 1) or head_dim < 2:
        raise ValueError("qk_norm_rope needs a contiguous last dim and a power-of-two head_dim")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("pass both q and k norm weights, or neither")
    out = torch.empty(num_tokens, num_heads + num_kv_heads, head_dim, dtype=qkv.dtype,
                      device=qkv.device)
    if num_tokens:
        has_norm = q_weight is not None
        _qk_norm_rope_kernel[(num_tokens, num_heads + num_kv_heads)](
            qkv,
            out,
            positions,
            cos_sin_cache,
            q_weight if has_norm else cos_sin_cache,
            k_weight if has_norm else cos_sin_cache,
            qkv.stride(0),
            eps,
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HAS_NORM=has_norm,
            num_warps=1 if head_dim <= 128 else 2,
        )
    return out[:, :num_heads], out[:, num_heads:]
