"""Structured outputs' bans in one kernel: -inf for every token a grammar's bitmask leaves out.

llguidance packs a grammar's allowed next tokens into int32 words, token t in bit t % 32 of
word t // 32. The torch way to apply them (`outside_of_bitmask`, then a gather, a
masked_fill and a scatter of the rows) takes ~10 kernel launches and three [R, V] copies a
step; this reads each word once and writes -inf in place, one program per (row, block of
BLOCK tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.pdl import pdl_args

BLOCK = 4096  # tokens per program: 128 words


@triton.jit
def _ban_outside_bitmask_kernel(
    logits_ptr,  # [B, V] float, row stride stride_row; rows[r] of it change in place
    rows_ptr,  # [R] int64: the logits row of bitmask row r
    bitmask_ptr,  # [R, W] int32, contiguous
    vocab_size,
    stride_row,
    num_words,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    r = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab_size
    words = tl.load(bitmask_ptr + r * num_words + tokens // 32, mask=inside, other=-1)
    banned = ((words >> (tokens % 32)) & 1) == 0
    row = tl.load(rows_ptr + r)
    tl.store(logits_ptr + row * stride_row + tokens, float("-inf"), mask=inside & banned)


def ban_outside_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets logits[rows[r], t] = -inf in place for every token t < V whose bit is clear in
    bitmask[r] ([R, ceil(V / 32)] int32). logits: [B, V] float, last dim contiguous; rows:
    [R] int64, no row twice."""
    num_rows, vocab = len(rows), logits.shape[1]
    if logits.stride(-1) != 1 or not bitmask.is_contiguous():
        raise ValueError("ban_outside_bitmask_ needs contiguous logits rows and bitmask")
    if bitmask.shape != (num_rows, triton.cdiv(vocab, 32)) or bitmask.dtype != torch.int32:
        raise ValueError("the bitmask needs one int32 row of ceil(V / 32) words per row")
    if rows.dtype != torch.int64:  # row * stride_row would overflow int32 past 2**31 entries
        raise ValueError("ban_outside_bitmask_ needs int64 rows")
    if num_rows:
        _ban_outside_bitmask_kernel[(num_rows, triton.cdiv(vocab, BLOCK))](
            logits, rows, bitmask, vocab, logits.stride(0), bitmask.shape[1], BLOCK=BLOCK,
            num_warps=4, **pdl_args(logits.device),
        )  # fmt: skip
