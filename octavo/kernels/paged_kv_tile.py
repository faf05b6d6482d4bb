"""One online-softmax step of paged attention: the inner loop both attention kernels share.

A chunk of BLOCK_N context positions is gathered from the paged cache through the block table,
page by page (BLOCK_N may span several pages, or part of one):

    block_table[seq] = [7, 2, 9, 4]      BLOCK_SIZE = 16, BLOCK_N = 32
    chunk of positions 32..63 -> logical blocks 2, 3 -> pages 9, 4, rows p % 16 of each

then scored against M query rows with tl.dot and folded into the running (max, sum, output) of
each row, in fp32 and in the log2 domain (scores are pre-multiplied by scale * log2(e)).

An fp8 (e4m3) cache holds k / k_scale and v / v_scale (`to_cache`). Its tiles are widened to
float16 for the dots, with q in float16 too (`dot_operand`): e4m3 widens to float16 exactly
in one conversion instruction per pair of codes, where bfloat16 would take three, enough to
make the loop bound by conversions instead of by its reads. k_scale goes into the kernels'
qk_scale and v_scale multiplies their output, so the loop itself never scales. The torch
reference is attention/torch_backend.py's `to_kv_cache` and `from_kv_cache`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value
F16_MAX = tl.constexpr(65504.0)


@triton.jit
def to_cache(x, scale, cache_ptr):
    """x as the cache at `cache_ptr` holds it: for an e4m3 cache x / scale, clamped to
    +-FP8_MAX; for another cache x in its dtype (the scale unused)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def dot_operand(q, cache_ptr):
    """q as the dots take it against the cache at `cache_ptr`: float16 (clamped to its range)
    for an e4m3 cache, whose tiles widen to float16; q as it is otherwise."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        q = tl.clamp(q.to(tl.float32), -F16_MAX, F16_MAX).to(tl.float16)
    return q


@triton.jit
def attend_kv_chunk(
    acc,  # [M, D] fp32, un-normalized output
    m_i,  # [M] fp32 running max of the scaled scores (log2 domain)
    l_i,  # [M] fp32 running sum of exp2(score - m_i)
    q,  # [M, D] queries
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,  # this sequence's row of the block table
    kv_start,  # first context position of the chunk
    kv_end,  # positions >= kv_end are masked out (used when MASKED)
    q_pos,  # [M] context position of each row's query (used when MASKED)
    kv_head,
    qk_scale,  # softmax scale * log2(e) * k_scale
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    window,  # with SLIDING (and MASKED): a row sees positions > q_pos - window only
    SLIDING: tl.constexpr,
    softcap,  # with SOFTCAP: the scores' cap in the log2 domain (cap * log2(e))
    SOFTCAP: tl.constexpr,
):
    """One online-softmax step over context positions kv_start .. kv_start + BLOCK_N - 1."""
    offs_n = kv_start + tl.arange(0, BLOCK_N)  # [N] context positions
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        in_ctx = offs_n < kv_end
        page = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=in_ctx, other=0)
    else:
        page = tl.load(block_table_ptr + offs_n // BLOCK_SIZE)
    row = (
        page.to(tl.int64) * (BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM)
        + (offs_n % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM)
        + kv_head * HEAD_DIM
    )  # [N] element offset of each position's row
    kv_off = row[:, None] + offs_d[None, :]  # [N, D]
    if MASKED:
        # other=0 keeps stale cache bits (NaN, inf) out of the p @ v product.
        k = tl.load(k_cache_ptr + kv_off, mask=in_ctx[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=in_ctx[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off)
        v = tl.load(v_cache_ptr + kv_off)
    k, v = k.to(q.dtype), v.to(q.dtype)  # e4m3 widened (dot_operand); others hold q's dtype

    s = tl.dot(q, tl.trans(k)) * qk_scale  # [M, N] fp32
    if SOFTCAP:
        s = soft_cap(s, softcap)
    if MASKED:
        allowed = in_ctx[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # m_i starts finite, so m_new is never -inf
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def merge_split(acc, m_i, l_i, acc_s, m_s, l_s):
    """The running (output, max, sum) of M rows merged with one more span's, in float32: a
    span that saw nothing (max -1e30, sum 0, output 0) leaves them as they are, bit for bit."""
    m_new = tl.maximum(m_i, m_s)
    alpha = tl.exp2(m_i - m_new)
    beta = tl.exp2(m_s - m_new)
    return acc * alpha[:, None] + acc_s * beta[:, None], m_new, l_i * alpha + l_s * beta


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap), tanh written with exp (exact enough in float32; saturates)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


def check_attention_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Raises ValueError unless the layouts the attention kernels rely on hold."""
    head_dim = q.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split over {num_kv_heads} KV heads")
    if head_dim < 16 or head_dim & (head_dim - 1) or kv_cache.shape[-1] != head_dim:
        raise ValueError(f"head_dim must be a power of two >= 16 matching the cache: {head_dim}")
    if q.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("q needs head_dim stride 1 and kv_cache must be contiguous")
    if kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"kv_cache is {kv_cache.dtype}: it must hold q's {q.dtype} or e4m3")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 with contiguous rows")
