"""Prefill / extend attention over the paged KV cache (flash-attention style, Triton).

Handles any step that is not pure decode: whole prompts, chunks of prompts behind a cached
prefix, prefix-cache hits, and decode rows (q_len 1) mixed into the same batch.

Each program owns one tile of BLOCK_Q query tokens of one sequence and ALL query heads of one
KV head group, so a KV tile is loaded once for every head that reads it (GQA). The tile's rows
interleave tokens and heads (GROUP_PAD = group size rounded up to a power of two):

    row m  ->  token first_tok + m // GROUP_PAD,  head kv_head * GROUP + m % GROUP_PAD
    BLOCK_M = BLOCK_Q * GROUP_PAD rows: the M of both tl.dot calls

Query tiles of all sequences are laid end to end on grid axis 0 without a host-side table:
sequence i owns tiles from `query_start_loc[i] // BLOCK_Q + i` on (at least cdiv(q_len_i,
BLOCK_Q) of them; spare ones return at once), and a program finds its sequence by binary
search. The grid is therefore `num_tokens // BLOCK_Q + num_seqs` tiles, known on the host.

Causality: query j of a sequence with context L and q_len new tokens sits at position
L - q_len + j and sees positions <= it. A tile walks the KV in BLOCK_N chunks, gathered page by
page through the block table, in two loops: chunks below every row's diagonal (no mask), then
the chunks the diagonal crosses (masked). Chunks past the tile's last query are never loaded.
With a sliding window the walk starts at the chunk of the tile's first row's window, and
every chunk is masked.

    context:  [ cached prefix ........ | new tokens ]
    KV chunk:  | full | full | full | diag | diag |    (skipped beyond the last query)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.paged_kv_tile import (
    LOG2E,
    attend_kv_chunk,
    check_attention_inputs,
    dot_operand,
    merge_split,
)
from octavo.kernels.pdl import pdl_args


@triton.jit
def find_seq(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first query tile `query_start_loc[i] // BLOCK_Q + i` is
    <= q_tile (binary search; those first tiles increase strictly with i)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D], contiguous
    v_cache_ptr,
    out_ptr,  # [T, H, D]
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    qk_scale,  # softmax scale * log2(e) * k_scale
    v_scale,  # times the output (an fp8 cache's values; 1.0 otherwise)
    num_seqs,
    window,  # with SLIDING: each query sees its last `window` positions
    softcap,  # with SOFTCAP: the scores' cap, times log2(e)
    part_out_ptr,  # with PARTIAL: [T, H, num_splits, D] fp32, each split's output
    part_ml_ptr,  # with PARTIAL: [T, H, num_splits, 2] fp32, each split's (max, sum)
    num_splits,  # with PARTIAL: the workspace's splits per row
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt_seq,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache page size
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile: BLOCK_Q * GROUP_PAD
    BLOCK_N: tl.constexpr,  # context positions per KV chunk
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,  # Gemma 2's soft cap on the scores
    SPLIT: tl.constexpr,  # > 0: the context in fixed spans of SPLIT positions (below)
    PARTIAL: tl.constexpr,  # with SPLIT: this program does span program_id(2) only
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = find_seq(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = (q_tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # within the sequence
    if first_tok >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # cached context in front of the new tokens

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = first_tok + offs_m // GROUP_PAD  # [M] query index within the sequence
    head = kv_head * GROUP + offs_m % GROUP_PAD  # [M]
    row_ok = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    q_pos = prefix + tok  # [M] context position of each row's query
    q_off = (q_start + tok).to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q = dot_operand(q, k_cache_ptr)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    # Chunks entirely at or below the tile's first query: no row masks anything.
    full_end = (prefix + first_tok + 1) // BLOCK_N * BLOCK_N
    masked_start = full_end
    if SLIDING:  # from the chunk of the first row's window on, every chunk masked
        masked_start = tl.maximum(prefix + first_tok + 1 - window, 0) // BLOCK_N * BLOCK_N
        full_end = 0
    last_pos = prefix + tl.minimum(first_tok + BLOCK_Q, q_len)  # exclusive: the last query
    if SPLIT == 0:
        acc, m_i, l_i = attend_span(
            acc, m_i, l_i, q, 0, last_pos,
            k_cache_ptr, v_cache_ptr, block_table_ptr, full_end, masked_start, last_pos,
            seq_len, q_pos, kv_head, qk_scale, window, softcap, NUM_KV_HEADS, HEAD_DIM,
            BLOCK_SIZE, BLOCK_N, SLIDING, SOFTCAP,
        )  # fmt: skip
    elif PARTIAL:  # one split of a decode step; combine_splits merges them
        span = tl.program_id(2) * SPLIT
        first_span = masked_start // SPLIT * SPLIT if SLIDING else 0
        if span >= last_pos or span < first_span:
            return
        acc, m_i, l_i = attend_span(
            acc, m_i, l_i, q, span, span + SPLIT,
            k_cache_ptr, v_cache_ptr, block_table_ptr, full_end, masked_start, last_pos,
            seq_len, q_pos, kv_head, qk_scale, window, softcap, NUM_KV_HEADS, HEAD_DIM,
            BLOCK_SIZE, BLOCK_N, SLIDING, SOFTCAP,
        )  # fmt: skip
        row = ((q_start + tok).to(tl.int64) * (NUM_KV_HEADS * GROUP) + head) * num_splits
        row += tl.program_id(2)
        tl.store(part_ml_ptr + 2 * row, m_i, mask=row_ok)
        tl.store(part_ml_ptr + 2 * row + 1, l_i, mask=row_ok)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None])  # fmt: skip
        return
    else:  # every split from a fresh state, merged in order: what combine_splits computes
        first_span = masked_start // SPLIT * SPLIT if SLIDING else 0
        for span in range(first_span, last_pos, SPLIT):
            a_s = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            m_s = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
            l_s = tl.zeros([BLOCK_M], dtype=tl.float32)
            a_s, m_s, l_s = attend_span(
                a_s, m_s, l_s, q, span, span + SPLIT,
                k_cache_ptr, v_cache_ptr, block_table_ptr, full_end, masked_start, last_pos,
                seq_len, q_pos, kv_head, qk_scale, window, softcap, NUM_KV_HEADS, HEAD_DIM,
                BLOCK_SIZE, BLOCK_N, SLIDING, SOFTCAP,
            )  # fmt: skip
            acc, m_i, l_i = merge_split(acc, m_i, l_i, a_s, m_s, l_s)

    out = acc / l_i[:, None] * v_scale  # every valid row saw its own position: l_i > 0
    o_off = (q_start + tok).to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(
        out_ptr + o_off[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


@triton.jit
def attend_span(
    acc, m_i, l_i, q, lo, hi, k_cache_ptr, v_cache_ptr, block_table_ptr, full_end,
    masked_start, last_pos, seq_len, q_pos, kv_head, qk_scale, window, softcap,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """The tile's chunks in context positions [lo, hi): those below every row's diagonal
    (before `full_end`) unmasked, then those from `masked_start` up to the last query masked."""
    for kv_start in range(lo, tl.minimum(hi, full_end), BLOCK_N):
        acc, m_i, l_i = attend_kv_chunk(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_start, seq_len,
            q_pos, kv_head, qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False,
            window, False, softcap, SOFTCAP,
        )  # fmt: skip
    for kv_start in range(tl.maximum(lo, masked_start), tl.minimum(hi, last_pos), BLOCK_N):
        acc, m_i, l_i = attend_kv_chunk(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_start, last_pos,
            q_pos, kv_head, qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True,
            window, SLIDING, softcap, SOFTCAP,
        )  # fmt: skip
    return acc, m_i, l_i


def default_prefill_config(head_dim: int, group_pad: int, split: int = 0) -> dict[str, int]:
    """Tile shape and launch knobs: BLOCK_M rows (tokens x heads), BLOCK_N KV positions.
    With `split` (deterministic mode, where this kernel runs every step, decode included)
    the tile has 16 rows: a decode program fills only a token's heads of its rows, and the
    smaller tile reads the KV faster there (docs/PERFORMANCE.md)."""
    if head_dim <= 64:
        cfg = {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3}
    elif head_dim <= 128:
        # Faster than the 128 x 64 tile with 8 warps in the kernel sweep (docs/PERFORMANCE.md).
        cfg = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
    else:
        cfg = {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 2}
    if split and head_dim <= 128:
        cfg["block_m"] = 16
    cfg["block_m"] = max(cfg["block_m"], group_pad)
    return cfg


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_seqs: int,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
    split: int = 0,
    all_decode: bool = False,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's paged context (over its last
    `window` positions, with a sliding window; `softcap` caps the scores).

    The new K/V must already be in the cache (see `store_kv`).

    Args:
        q: [T, H, D] queries of the new tokens, sequences laid end to end (head_dim stride 1).
        kv_cache: [2, num_blocks, block_size, KVH, D], contiguous.
        query_start_loc: [B + 1] int32 token offsets of the sequences in q.
        seq_lens: [B] int32 context lengths, new tokens included.
        block_tables: [B, max_blocks] int32.
        scale: softmax scale.
        num_seqs: B, as a host int (sizes the grid without reading the device).
        out: optional [T, H, D] buffer to write into.
        config: optional override of `default_prefill_config` (benchmarks sweep it).
        k_scale, v_scale: the scales of an fp8 (e4m3) cache's keys and values (paged_kv_tile).
        split: > 0 (a multiple of the config's block_n): the context in fixed spans of
            `split` positions, each token's output the same bits in any step (above).
        all_decode: with `split`, a step of one token per sequence: its spans run in
            parallel, merged by `combine_splits`.
    Returns:
        [T, H, D] in q's dtype (`out` when given).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    check_attention_inputs(q, kv_cache, block_tables, num_heads, num_kv_heads)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    cfg = config or default_prefill_config(head_dim, group_pad, split)
    if split % cfg["block_n"]:
        raise ValueError(f"split={split} is not a multiple of the {cfg['block_n']}-position chunk")
    block_q = cfg["block_m"] // group_pad
    if num_tokens == 0:
        return out
    num_splits, parts = 1, (out, out)  # the workspace, used only by a split decode step
    if split and all_decode:
        num_splits = triton.cdiv(block_tables.shape[1] * block_size, split)
        parts = (
            torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32,
                        device=q.device),
            torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32,
                        device=q.device),
        )  # fmt: skip
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    # NOTE: with spans, no multiply-add is fused, so that a merge compiles to the same
    # operations here as in combine_splits.
    fused = {} if not split else {"enable_fp_fusion": False}
    _prefill_kernel[grid](
        q, kv_cache[0], kv_cache[1], out, query_start_loc, seq_lens, block_tables,
        scale * LOG2E * k_scale, v_scale, num_seqs, window or 0, (softcap or 1.0) * LOG2E,
        parts[0], parts[1], num_splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_q * group_pad,
        BLOCK_N=cfg["block_n"], SLIDING=window is not None, SOFTCAP=softcap is not None,
        SPLIT=split, PARTIAL=split > 0 and all_decode, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **fused, **pdl_args(q.device),
    )  # fmt: skip
    if split and all_decode:
        _combine_splits_kernel[(num_tokens, num_kv_heads)](
            parts[0], parts[1], out, seq_lens, v_scale, window or 0, num_splits,
            out.stride(0), out.stride(1), NUM_KV_HEADS=num_kv_heads, GROUP=group,
            GROUP_PAD=group_pad, HEAD_DIM=head_dim, SPLIT=split, SLIDING=window is not None,
            enable_fp_fusion=False, **pdl_args(q.device),
        )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    part_out_ptr,  # [B, H, num_splits, D] fp32
    part_ml_ptr,  # [B, H, num_splits, 2] fp32
    out_ptr,  # [B, H, D]
    seq_lens_ptr,  # [B] int32
    v_scale,
    window,
    num_splits,
    stride_o_tok,
    stride_o_head,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    SLIDING: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """A decode step's spans of one sequence (token) and KV head group, merged in order as
    the split walk merges them in `_prefill_kernel`."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_g
    g_ok = offs_g < GROUP
    row = (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + head) * num_splits  # [G], split 0
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    first = 0
    if SLIDING:
        first = tl.maximum(seq_len - window, 0) // SPLIT
    for s in range(first, tl.cdiv(seq_len, SPLIT)):
        m_s = tl.load(part_ml_ptr + 2 * (row + s), mask=g_ok, other=-1.0e30)
        l_s = tl.load(part_ml_ptr + 2 * (row + s) + 1, mask=g_ok, other=0.0)
        a_s = tl.load(part_out_ptr + (row + s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=g_ok[:, None], other=0.0)  # fmt: skip
        acc, m_i, l_i = merge_split(acc, m_i, l_i, a_s, m_s, l_s)
    out = acc / l_i[:, None] * v_scale
    o_off = seq.to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None])  # fmt: skip
