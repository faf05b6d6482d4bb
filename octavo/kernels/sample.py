"""Sampling from softmax(logits / T) by the inverse CDF, in two small passes over the logits.

    pass 1, one program per (row, chunk of CHUNK entries):
        M_c = max_v logits[v] / T,   S_c = sum_v exp(logits[v] / T - M_c)
    pass 2, one program per row:
        w_c = S_c exp(M_c - M),  M = max_c M_c          (the chunk's share of the row's mass)
        target = U * sum_c w_c,  U ~ Uniform[0, 1) from Philox keyed by the row's seed
        the chunk c where the running sum of w passes target, then the entry of chunk c where
        the running sum of exp(logits[v] / T - M) passes what is left of target

Token v comes out with probability softmax(logits / T)[v], and a row's token depends only on
its logits and its seed. One uniform per row, where an exponential race (Gumbel-max) draws one
per vocabulary entry and spends most of its time drawing them at large batches (see
docs/PERFORMANCE.md). Pass 1 reads the logits once, in their own dtype; pass 2 reads one chunk
per row again. A row with T = 0 takes the argmax, ties to the smallest index.

The two passes sum the same terms in different orders, so in fp32 they can disagree in the
last bits. If what is left of target lands in that sliver at the end of chunk c, the scan
never passes it, and the chunk's last entry with non-zero mass is taken (a bias of ~1e-7).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.pdl import pdl_args

CHUNK = 8192  # vocabulary entries per program of pass 1
BLOCK = 1024  # entries per step of a program's loop
LOG2E = tl.constexpr(1.4426950408889634)
NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": exp2(NEG - NEG) stays 1, never nan


@triton.jit
def _chunk_stats_kernel(
    logits_ptr,  # [B, V], any float dtype, row stride stride_row
    temperature_ptr,  # [B] float32, 0 = greedy
    max_ptr,  # [B, num_chunks] float32: M_c (greedy rows: the chunk's max logit)
    sum_ptr,  # [B, num_chunks] float32: S_c (greedy rows: unused)
    index_ptr,  # [B, num_chunks] int64: greedy rows: the chunk's first argmax
    vocab_size,
    stride_row,
    num_chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    scale = tl.where(greedy, 1.0, LOG2E / temperature)  # logits -> log2 domain of p
    row_ptr = logits_ptr + row * stride_row
    lanes = tl.arange(0, BLOCK)
    # Each lane keeps its own running max and sum (online softmax), merged at the end.
    m = tl.full([BLOCK], NEG, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    best = tl.zeros([BLOCK], tl.int64)
    end = tl.minimum(chunk * CHUNK + CHUNK, vocab_size)
    for start in range(chunk * CHUNK, end, BLOCK):
        offs = start + lanes
        x = tl.load(row_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
        x = x * scale
        better = x > m  # strict: a lane keeps its first index on ties
        best = tl.where(better, offs.to(tl.int64), best)
        m_new = tl.maximum(m, x)
        s = s * tl.exp2(m - m_new) + tl.exp2(x - m_new)
        m = m_new
    m_chunk = tl.max(m, axis=0)
    s_chunk = tl.sum(s * tl.exp2(m - m_chunk), axis=0)
    first = tl.min(tl.where(m == m_chunk, best, vocab_size), axis=0)
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, m_chunk)
    tl.store(sum_ptr + out, s_chunk)
    tl.store(index_ptr + out, first)


@triton.jit
def _pick_kernel(
    logits_ptr,
    temperature_ptr,
    seeds_ptr,  # [B] int64
    max_ptr,
    sum_ptr,
    index_ptr,
    out_ptr,  # [B] int64
    vocab_size,
    stride_row,
    num_chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,  # next power of two >= num_chunks
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    offs_c = tl.arange(0, CHUNKS_PAD)
    chunk_ok = offs_c < num_chunks
    m_c = tl.load(max_ptr + row * num_chunks + offs_c, mask=chunk_ok, other=NEG)
    m_row = tl.max(m_c, axis=0)
    if temperature == 0.0:  # the first chunk holding the max, then its first argmax
        c = tl.min(tl.where(m_c == m_row, offs_c, CHUNKS_PAD), axis=0)
        tl.store(out_ptr + row, tl.load(index_ptr + row * num_chunks + c))
    else:
        s_c = tl.load(sum_ptr + row * num_chunks + offs_c, mask=chunk_ok, other=0.0)
        w = s_c * tl.exp2(m_c - m_row)  # [C] each chunk's mass, relative to exp2(m_row)
        cum = tl.cumsum(w, axis=0)
        u = tl.rand(tl.load(seeds_ptr + row), tl.full([], 0, tl.int32))  # counter 0: [0, 1)
        target = u * tl.sum(w, axis=0)
        # The first chunk whose running sum passes target (the last one with mass, at most).
        last_c = tl.max(tl.where(w > 0, offs_c, 0), axis=0)
        c = tl.minimum(tl.sum(((cum <= target) & chunk_ok).to(tl.int32), axis=0), last_c)
        left = target - tl.sum(tl.where(offs_c < c, w, 0.0), axis=0)
        scale = LOG2E / temperature
        row_ptr = logits_ptr + row * stride_row
        lanes = tl.arange(0, BLOCK)
        end = tl.minimum(c * CHUNK + CHUNK, vocab_size)
        found = vocab_size  # none yet
        last_with_mass = c * CHUNK
        running = 0.0
        for start in range(c * CHUNK, end, BLOCK):
            offs = start + lanes
            x = tl.load(row_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
            p = tl.exp2(x * scale - m_row)
            within = tl.cumsum(p, axis=0) + running
            passed = (within > left) & (p > 0)
            found = tl.minimum(found, tl.min(tl.where(passed, offs, vocab_size), axis=0))
            last_with_mass = tl.maximum(last_with_mass, tl.max(tl.where(p > 0, offs, 0), axis=0))
            running += tl.sum(p, axis=0)
        token = tl.where(found < vocab_size, found, last_with_mass)
        tl.store(out_ptr + row, token.to(tl.int64))


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """One token per row of logits [B, V] (last dim contiguous), drawn from
    softmax(logits / temperature[b]) with the uniform keyed by seeds[b]; temperature 0 is the
    argmax. Returns [B] int64."""
    num_rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("sample_tokens needs logits with a contiguous last dim")
    if temperature.shape != (num_rows,) or seeds.shape != (num_rows,):
        raise ValueError("temperature and seeds need one entry per row")
    num_chunks = triton.cdiv(vocab, CHUNK)
    device = logits.device
    chunk_max = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=device)
    chunk_sum = torch.empty_like(chunk_max)
    chunk_index = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=device)
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows:
        args = (vocab, logits.stride(0), num_chunks)
        pdl = pdl_args(device)
        _chunk_stats_kernel[(num_rows, num_chunks)](
            logits, temperature, chunk_max, chunk_sum, chunk_index, *args, CHUNK=CHUNK,
            BLOCK=BLOCK, num_warps=4, **pdl,
        )  # fmt: skip
        _pick_kernel[(num_rows,)](
            logits, temperature, seeds, chunk_max, chunk_sum, chunk_index, out, *args,
            CHUNK=CHUNK, BLOCK=BLOCK, CHUNKS_PAD=triton.next_power_of_2(num_chunks),
            num_warps=4, **pdl,
        )  # fmt: skip
    return out
