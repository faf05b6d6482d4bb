"""Decode attention (one query token per sequence) over the paged KV cache: flash-decoding.

Decode is memory-bound: every step reads each sequence's whole K/V once, and does only
~2 * group flops per KV element loaded. Four ideas keep the GPU busy:

1. GQA grouping. One program owns all GROUP query heads of one KV head, so each KV chunk is
   loaded once for the heads that share it. The heads are the M rows of a tl.dot, padded to 16
   (the smallest MMA tile). The padded rows cost tensor-core cycles that a memory-bound kernel
   has to spare, while a sum over head_dim on CUDA cores would cost shuffles and G times the
   FMA work per loaded byte; one code path also serves every group size, including 1.

2. Split-K. With few sequences (batch 1, long context) B * KVH programs cannot fill the SMs,
   so each sequence's context is cut into num_splits equal parts (rounded to BLOCK_N) that run
   in parallel; each writes its partial output and log-sum-exp, and a second small kernel
   combines them. With one split the first kernel writes the output directly.

    seq_len = 1000, num_splits = 4, BLOCK_N = 64:  split_len = cdiv(cdiv(1000, 4), 64) * 64 = 256
    splits: [0, 256) [256, 512) [512, 768) [768, 1000)

num_splits depends only on the batch size and the block-table width (the largest context the
table can describe), never on this step's lengths, so a CUDA graph captured for a padded batch
launches the same grid on every replay. A sequence with seq_len 0 gets zeros.

3. Longest first. With many sequences there is one split each, and contexts differ in
   length; the GPU starts programs in grid order as others finish, so a long sequence that
   starts last runs alone at the end while most SMs idle. Given `order`
   (the sequences sorted by length, longest first, made on the host with the step's inputs),
   grid row i runs sequence order[i], with its KV heads next to each other in the grid.

4. From the qkv projection (`decode_attention_qkv`). Each program first does for its own
   heads what `qk_norm_rope_store` would do as a separate launch: q/k RMSNorm (Qwen3),
   rotary at position seq_len - 1, and the K/V store, by the program whose split holds that
   position. The new token attends to itself from registers, so the cache loop stops one
   position short and no program reads a slot that another one writes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from octavo.kernels.paged_kv_tile import (
    LOG2E,
    attend_kv_chunk,
    check_attention_inputs,
    dot_operand,
    soft_cap,
    to_cache,
)
from octavo.kernels.pdl import pdl_args

MIN_SPLIT_LEN = 256  # context positions per split: below this the partial writes dominate
MAX_SPLITS = 64


@triton.jit
def _norm_rope_rows(row_ptrs, row_ok, weight_ptr, cos, sin, eps, HEAD_DIM: tl.constexpr,
                    HAS_NORM: tl.constexpr):  # fmt: skip
    """Heads [R, D] starting at row_ptrs [R, 1]: RMS-normalized with weight_ptr (if HAS_NORM),
    then rotated (HF's rotate-half), in float32, on whole heads: element d pairs with
    d +- D/2. The same roundings as `octavo/kernels/rope.py`; the sum of squares may add in
    another order, so a normalized head can differ from that kernel's by one ulp."""
    half: tl.constexpr = HEAD_DIM // 2
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    partner = (offs_d + half) % HEAD_DIM
    x = tl.load(row_ptrs + offs_d, mask=row_ok, other=0.0)
    xr = tl.load(row_ptrs + partner, mask=row_ok, other=0.0)
    if HAS_NORM:
        dtype = x.dtype
        xf = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(weight_ptr + offs_d).to(tl.float32)
        wr = tl.load(weight_ptr + partner).to(tl.float32)
        x = ((xf * inv_rms).to(dtype).to(tl.float32) * w).to(dtype)
        xr = ((xr.to(tl.float32) * inv_rms).to(dtype).to(tl.float32) * wr).to(dtype)
    # First half: x1 cos - x2 sin; second half: x2 cos + x1 sin.
    sign = tl.where(offs_d < half, -1.0, 1.0)
    return x.to(tl.float32) * cos + sign * xr.to(tl.float32) * sin


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D], contiguous
    v_cache_ptr,
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    order_ptr,  # [B] int32: the sequence of each grid row, longest first (if HAS_ORDER)
    out_ptr,  # [B, H, D], written when SINGLE_SPLIT
    part_out_ptr,  # [B, H, num_splits, D] fp32, written otherwise
    part_lse_ptr,  # [B, H, num_splits] fp32 (log2 domain)
    cos_sin_ptr,  # FUSED_QK: [max_position, D] float32, cos | sin halves
    q_norm_ptr,  # FUSED_QK and HAS_NORM: [D] per-head norm weights of q and k
    k_norm_ptr,
    slot_ptr,  # FUSED_QK: [B] int64 cache slot of each sequence's new token
    eps,
    qk_scale,  # softmax scale * log2(e) * k_scale
    k_scale,  # FUSED_QK: the new key is stored over it (to_cache)
    v_scale,  # times the output (an fp8 cache's values; 1.0 otherwise)
    num_splits,  # a run-time value, so changing it costs no recompilation
    window,  # with SLIDING: the query sees its last `window` positions
    softcap,  # with SOFTCAP: the scores' cap, times log2(e)
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt_seq,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # max(16, next power of two >= GROUP): the dot's M
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,  # num_splits == 1: write the output directly
    HAS_ORDER: tl.constexpr,
    FUSED_QK: tl.constexpr,  # q_ptr is the qkv projection: norm, rotate and store here
    HAS_NORM: tl.constexpr,
    SLIDING: tl.constexpr,  # a sliding window: the splits cover its positions only
    SOFTCAP: tl.constexpr,  # Gemma 2's soft cap on the scores
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    if HAS_ORDER:
        seq = tl.load(order_ptr + seq)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    base = 0
    if SLIDING:  # the first chunk that holds a position of the window
        base = tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(seq_len - base, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = base + split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, seq_len)  # may be <= kv_lo: an empty split

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_g  # [G]
    head_ok = offs_g < GROUP
    q_off = seq.to(tl.int64) * stride_q_tok + head * stride_q_head
    if FUSED_QK:
        # The new token's q, k and v come raw from the qkv projection (module docstring, 4.).
        pos = tl.maximum(seq_len - 1, 0)
        half: tl.constexpr = HEAD_DIM // 2
        cs_row = cos_sin_ptr + pos.to(tl.int64) * HEAD_DIM
        cos = tl.load(cs_row + offs_d % half)[None, :]  # [1, D]: cos of each pair, twice
        sin = tl.load(cs_row + half + offs_d % half)[None, :]
        q = _norm_rope_rows(
            q_ptr + q_off[:, None], head_ok[:, None], q_norm_ptr, cos, sin, eps, HEAD_DIM,
            HAS_NORM,
        ).to(q_ptr.dtype.element_ty)  # fmt: skip
        tok = q_ptr + seq.to(tl.int64) * stride_q_tok
        k_src = tok + (NUM_KV_HEADS * GROUP + kv_head) * HEAD_DIM
        row0 = tl.arange(0, 1)[:, None]  # [1, 1] zero offset: the one k head, always in bounds
        k_rot = _norm_rope_rows(
            k_src + row0, row0 == 0, k_norm_ptr, cos, sin, eps, HEAD_DIM, HAS_NORM
        )  # [1, D] float32
        v_src = tok + (NUM_KV_HEADS * GROUP + NUM_KV_HEADS + kv_head) * HEAD_DIM
        # As the cache holds them: the new token attends to what later ones will read.
        k_new = to_cache(k_rot, k_scale, k_cache_ptr)  # [1, D]
        v_new = to_cache(tl.load(v_src + offs_d)[None, :], v_scale, v_cache_ptr)
        owns_new = (kv_lo <= pos) & (pos < kv_hi)
        if owns_new:
            slot = tl.load(slot_ptr + seq)
            dst = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d[None, :]
            tl.store(k_cache_ptr + dst, k_new)
            tl.store(v_cache_ptr + dst, v_new)
        kv_hi = tl.where(owns_new, pos, kv_hi)
    else:
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=head_ok[:, None], other=0.0)
    q = dot_operand(q, k_cache_ptr)

    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (seq_len - 1)  # the query is the last one
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    full_end = kv_lo + tl.maximum(kv_hi - kv_lo, 0) // BLOCK_N * BLOCK_N
    if SLIDING:  # every chunk masked: the window's edge may cross the split's first one
        full_end = kv_lo
    for kv_start in range(kv_lo, full_end, BLOCK_N):
        acc, m_i, l_i = attend_kv_chunk(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_start, kv_hi,
            q_pos, kv_head, qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False,
            window, False, softcap, SOFTCAP,
        )  # fmt: skip
    for kv_start in range(full_end, kv_hi, BLOCK_N):  # the split's ragged tail, if any
        acc, m_i, l_i = attend_kv_chunk(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_start, kv_hi,
            q_pos, kv_head, qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True,
            window, SLIDING, softcap, SOFTCAP,
        )  # fmt: skip

    if FUSED_QK:  # the new token, from registers (a split without it adds exp2(-1e30) = 0)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * qk_scale  # [G]
        if SOFTCAP:
            s_new = soft_cap(s_new, softcap)
        s_new = tl.where(owns_new, s_new, -1.0e30)
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.exp2(m_i - m_new)
        p_new = tl.where(owns_new, tl.exp2(s_new - m_new), 0.0)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)
        m_i = m_new

    # An empty split (or seq_len 0) leaves l_i == 0 and acc == 0: write 0 and lse = -inf.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale  # [G, D]
    if SINGLE_SPLIT:
        o_off = seq.to(tl.int64) * stride_o_tok + head * stride_o_head
        o_ptrs = out_ptr + o_off[:, None] + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        row = (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + head) * num_splits + split  # [G]
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None]
        )
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=head_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr,  # [B, H, num_splits, D] fp32
    part_lse_ptr,  # [B, H, num_splits] fp32 (log2 domain)
    out_ptr,  # [B, H, D]
    stride_o_tok,
    stride_o_head,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    """out = sum_s w_s * part_s / sum_s w_s, with w_s = 2^(lse_s - max lse)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits
    row = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits
    lse = tl.load(part_lse_ptr + row + offs_s, mask=split_ok, other=float("-inf"))  # [S]
    lse_max = tl.maximum(tl.max(lse, 0), -1.0e30)  # finite even when every split is empty
    w = tl.exp2(lse - lse_max)  # [S], 0 for empty splits
    parts = tl.load(
        part_out_ptr + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )  # [S, D]
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)  # [D]
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (132 on an H100 SXM; 132 off-GPU, for tests)."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, sms: int) -> int:
    """Splits per sequence so that num_seqs * num_kv_heads * splits programs fill the GPU
    about twice over, with each split at least MIN_SPLIT_LEN positions of the longest context
    allowed. Depends on shapes only (CUDA-graph safe), not on the step's actual lengths. A
    power of two, at most MAX_SPLITS."""
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = triton.cdiv(2 * sms, programs)
    by_length = max(max_context // MIN_SPLIT_LEN, 1)
    splits = min(wanted, by_length, MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def default_decode_config(head_dim: int) -> dict[str, int]:
    """Chunk length and launch knobs of the split kernel."""
    if head_dim <= 128:
        # 128-position chunks keep more of the copy bandwidth on mixed contexts than 64, and
        # 3 stages hurt a single long context (see docs/PERFORMANCE.md).
        return {"block_n": 128, "num_warps": 4, "num_stages": 2}
    return {"block_n": 32, "num_warps": 4, "num_stages": 2}


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    order: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each sequence's single new token over its whole paged context (over its
    last `window` positions, with a sliding window; `softcap` caps the scores).

    The new K/V must already be in the cache (see `store_kv`).

    Args:
        q: [B, H, D], token b belongs to sequence b (head_dim stride 1).
        kv_cache: [2, num_blocks, block_size, KVH, D], contiguous.
        seq_lens: [B] int32 context lengths including the new token (0 allowed: zeros out).
        block_tables: [B, max_blocks] int32.
        scale: softmax scale.
        num_splits: KV splits per sequence; default `choose_num_splits` from B and the
            block-table width, so it is fixed for fixed input shapes.
        out: optional [B, H, D] buffer to write into.
        config: optional override of `default_decode_config` (benchmarks sweep it).
        order: optional [B] int32 permutation of the sequences, longest first: programs start
            in that order, so the long ones do not run alone at the end (see the module doc).
        k_scale, v_scale: the scales of an fp8 (e4m3) cache's keys and values (paged_kv_tile).
    Returns:
        [B, H, D] in q's dtype (`out` when given).
    """
    check_attention_inputs(q, kv_cache, block_tables, q.shape[1], kv_cache.shape[3])
    return _decode(q, q.stride(0), q.stride(1), q.shape[1], kv_cache, seq_lens, block_tables,
                   scale, num_splits=num_splits, out=out, config=config, order=order,
                   kv_scales=(k_scale, v_scale), window=window, softcap=softcap)  # fmt: skip


class FusedQK(NamedTuple):
    """What `decode_attention_qkv` adds to a decode launch: rotary, q/k norm, the K/V store."""

    cos_sin_cache: torch.Tensor  # [max_position, D] float32, cos | sin halves
    q_norm: torch.Tensor | None  # [D], or None (then k_norm too)
    k_norm: torch.Tensor | None
    slot_mapping: torch.Tensor  # [B] int64
    eps: float


def decode_attention_qkv(
    qkv: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    scale: float,
    num_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    order: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`decode_attention` straight from the qkv projection: each program also does what
    `qk_norm_rope_store` would do first for its heads (Qwen3's q/k norm if the weights are
    given, rotary at position seq_len - 1, k and v into the new token's cache slot), and the
    new token attends to itself from registers. One launch per layer instead of two.

    Args:
        qkv: [B, (H + 2 * KVH) * D] (rows may be strided; head_dim contiguous).
        slot_mapping: [B] int64 cache slot of each sequence's new token.
        cos_sin_cache: [max_position, D] float32 (cos | sin halves), as `RotaryEmbedding`.
        q_norm, k_norm: [D] per-head RMSNorm weights, or both None.
        The rest as `decode_attention`; an fp8 cache gets the new k / k_scale and v / v_scale.
    Returns:
        [B, H, D] in qkv's dtype.
    """
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    num_seqs = qkv.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] < width:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} does not hold {num_heads} + 2 x "
            f"{num_kv_heads} heads of {head_dim} with a contiguous last dim"
        )
    if (q_norm is None) != (k_norm is None):
        raise ValueError("pass both q and k norm weights, or neither")
    if slot_mapping.shape != (num_seqs,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be [B] int64, got {tuple(slot_mapping.shape)}")
    q_view = qkv[:, : num_heads * head_dim].view(num_seqs, num_heads, head_dim)
    check_attention_inputs(q_view, kv_cache, block_tables, num_heads, num_kv_heads)
    fused = FusedQK(cos_sin_cache, q_norm, k_norm, slot_mapping, eps)
    return _decode(qkv, qkv.stride(0), head_dim, num_heads, kv_cache, seq_lens, block_tables,
                   scale, num_splits=num_splits, order=order, fused=fused,
                   kv_scales=(k_scale, v_scale), window=window, softcap=softcap)  # fmt: skip


def _decode(
    q: torch.Tensor,  # queries [B, H, D], or the qkv rows with `fused`
    stride_tok: int,
    stride_head: int,
    num_heads: int,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    order: torch.Tensor | None = None,
    fused: FusedQK | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Launches the split kernel (and the reduction, with several splits)."""
    num_seqs = q.shape[0]
    num_kv_heads, block_size, head_dim = kv_cache.shape[3], kv_cache.shape[2], kv_cache.shape[4]
    if out is None:
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, num_sms(q.device))
    cfg = config or default_decode_config(head_dim)
    group = num_heads // num_kv_heads
    if num_splits > 1:
        part_out = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # unused by the kernel
    # Without `fused` the kernel reads none of these: any tensors will do.
    cos_sin, q_norm, k_norm, slots, eps = fused or FusedQK(out, None, None, seq_lens, 0.0)
    has_norm = q_norm is not None
    _decode_split_kernel[(num_kv_heads, num_seqs, num_splits)](
        q,
        kv_cache[0],
        kv_cache[1],
        seq_lens,
        block_tables,
        seq_lens if order is None else order,
        out,
        part_out,
        part_lse,
        cos_sin,
        q_norm if has_norm else cos_sin,  # any tensor: never read without HAS_NORM
        k_norm if has_norm else cos_sin,
        slots,
        eps,
        scale * LOG2E * kv_scales[0],
        *kv_scales,
        num_splits,
        window or 0,
        (softcap or 1.0) * LOG2E,
        stride_tok,
        stride_head,
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg["block_n"],
        SINGLE_SPLIT=num_splits == 1,
        HAS_ORDER=order is not None,
        FUSED_QK=fused is not None,
        HAS_NORM=has_norm,
        SLIDING=window is not None,
        SOFTCAP=softcap is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl_args(q.device),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim >= 128 else 2,
            **pdl_args(q.device),
        )
    return out
