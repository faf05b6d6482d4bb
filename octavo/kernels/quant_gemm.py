"""Weight-only quantized GEMMs, y = x W^T with W dequantized inside the kernel: int4 with a
scale and a minimum per group of input columns (W4A16), int8 with a scale per row (W8A16).
The torch reference is quant/weights.py's dequantize_int4 / dequantize_int8 + F.linear.

Storage (what Int4Weight and Int8Weight keep on CUDA; `pack_int4`, `pack_int8`): int32 words
[N, Kp * BITS / 32], rows along K. A word holds 32 / BITS codes ("fields", lowest bits first)
of one block of columns: a group of `group_size` columns for int4, 64 columns for int8
(whose scale is per row; K is padded to whole blocks with zero codes). Within a block of
B columns and W = B * BITS / 32 words, field j of word w is column j * W + w:

    int4, group 128 (W = 16):   word 0 = columns 0, 16, 32, ..., 112    (fields 0..7)
                                word 1 = columns 1, 17, 33, ..., 113
    int8, block 64 (W = 16):    word 0 = columns 0, 16, 32, 48          (fields 0..3)

so field j of a row of words is a contiguous run of columns: the kernels unpack one field at
a time in the layout the words were loaded in, against a contiguous slice of x. Scales and
minimums are in the activations' dtype: int4 w = q * scale + min per group, q in 0..15;
int8 w = q * scale per row.

Unpacking without int-to-float conversions (a quarter of the FMA rate on Hopper): a b-bit
field u placed in the top mantissa bits of 1.0f reads as v = 1 + u / 2**b, exactly. Then

    int4  q = u                         w = q s + m = 16 s v + (m - 16 s)
    int8  q = u - 128 (u = byte ^ 0x80)  w = q s     = s (256 v - 384)

so a code costs a shift and one and-or before its FMA.

fp8 (e4m3, a float32 scale per row, or per 128 x 128 block as HF fp8 checkpoints store it)
keeps the plain [N, K] layout that torch._scaled_mm reads, so one copy serves both: viewed as
int32 words [N, K / 4], byte j of word w is column 4 w + j. Only the GEMV reads it
(`fp8_gemv`). There the hardware widens the codes, a pair to two float16 in one instruction
(exact, subnormals included), then each to float32: 5.4 instructions a code in the loop
against 7.3 for float32 built by shifts and masks (`gpu_kernels.py --sass`).

Three paths, picked by the row count M (`plan`):

    M = 1       _gemv_kernel, on the FMA units: per word it sums v * x and x over the
                word's fields, then applies the group's scale and min to those two sums, so
                a code costs one FMA.
    M > 1       _gemm_kernel: each tile is dequantized in registers into x's dtype and is the
                left operand of tl.dot ([BLOCK_N, BLOCK_K], at least 64 rows as wgmma
                wants), with x^T the right one ([BLOCK_K, BLOCK_M], 16 to 256 rows of x).
    M >= DEQUANT_MIN_ROWS  _dequant_kernel writes the whole weight in x's dtype, then
                F.linear: at prefill sizes cuBLAS's GEMM beats a tile kernel that dequantizes
                per block of rows.

Split-K. At decode row counts N / BLOCK_N tiles are too few programs to keep enough loads in
flight for HBM, so K is cut into `splits` ranges run by separate programs. Each writes its
float32 partial to a workspace, then takes a ticket from its tile's counter; the program that
takes the last ticket adds the partials in split order (the result does not depend on which
finished last), writes y and puts the counter back to 0. One launch, no memset.

    one row, N = 4096, K = 4096: GEMV tiles of 32 rows by 512 columns, splits = 4
    128 tiles x 4 = 512 programs of 2 iterations; tile t's counter goes 0 -> 4 -> 0

NOTE: the counters are one buffer per device, shared by every call. Kernels on one stream run
one after another (under PDL each waits for the grid before it), so launches never share a
counter; GEMMs on two streams at once would need a buffer each. A plan depends on shapes only
and the workspace is allocated per call, so a CUDA graph replays the same grid each time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from octavo.kernels.decode_attention import num_sms
from octavo.kernels.pdl import pdl_args

INT4_GROUP_SIZES = (32, 64, 128)  # a larger group runs as runs of 128 (Int4Weight)
INT8_BLOCK = 64  # columns an int8 word's fields spread over
DTYPES = (torch.bfloat16, torch.float16)
DEQUANT_MIN_ROWS = 1024  # from here on: dequantize once, then cuBLAS
MAX_SPLITS = 16
COUNTERS = 4096  # split-K tiles per launch at most (a split launch has fewer than 4 x SMs)
# 1.0f's bits, passed to the kernels as a value: held in a register, it lets the compiler do
# a field's and-or in one instruction (with two immediate constants it takes two).
ONE_BITS = 0x3F800000


# --- storage -------------------------------------------------------------------------------


def _pack(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """fields [N, blocks, 32 / bits, W] (uint8, < 2**bits) -> int32 words [N, blocks * W]
    with field j of word w in bits `bits` * j and up (little-endian bytes)."""
    n, blocks, _, wpb = fields.shape
    if bits == 4:  # two fields a byte, the lower one in the low nibble
        fields = fields[:, :, 0::2] | (fields[:, :, 1::2] << 4)
    return fields.transpose(2, 3).contiguous().view(torch.int32).view(n, blocks * wpb)


def pack_int4(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """codes [N, Kp] in 0..15 (Kp a multiple of group_size) -> the kernels' int32 words."""
    n, kp = codes.shape
    wpg = group_size // 8
    return _pack(codes.to(torch.uint8).view(n, kp // group_size, 8, wpg), 4)


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """codes int8 [N, K] -> the kernels' int32 words [N, Kp / 4], K padded to INT8_BLOCK."""
    n, k = codes.shape
    padded = F.pad(codes, (0, -k % INT8_BLOCK)).view(torch.uint8)
    return _pack(padded.view(n, -1, 4, INT8_BLOCK // 4), 8)


# --- the plan ------------------------------------------------------------------------------


class Plan(NamedTuple):
    """How one product runs: `kernel` "gemv", "gemm" or "dequant"; a tile of block_m rows of
    x by block_n rows of W, block_k columns per iteration; K cut in `splits`."""

    kernel: str
    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int


def plan(m: int, n: int, k: int, bits: int, group: int, sms: int) -> Plan:
    """The plan for x [m, k] by W [n, k] (k padded to whole blocks) with `bits`-bit codes in
    blocks of `group` columns, on `sms` SMs."""
    if m == 1:  # 32 rows by 256 bytes of codes an iteration: 4 rows by 4 words a thread
        block_k = max(2048 // bits, group)
        splits = _splits(triton.cdiv(n, 32), triton.cdiv(k, block_k), 4 * sms, min_iters=2)
        return Plan("gemv", 1, 32, block_k, splits, num_warps=4, num_stages=3)
    if m >= DEQUANT_MIN_ROWS:
        return Plan("dequant", m, 32, max(1024 // bits, group), 1, num_warps=4, num_stages=1)
    block_k = max(128, group)
    if m > 128 and triton.cdiv(n, 128) * triton.cdiv(m, 256) >= sms:
        # Each tile of W dequantized once for up to 256 rows of x, where these tiles still
        # fill the GPU (2 stages: 3 would not fit in shared memory).
        return Plan("gemm", 256, 128, block_k, 1, num_warps=8, num_stages=2)
    block_m = min(max(16, triton.next_power_of_2(m)), 128)
    m_tiles = triton.cdiv(m, block_m)
    # 128 rows of W a tile spread the per-tile work over more codes; at 64 rows of x their
    # accumulator would not fit 4 warps' registers, at 128 it takes 8 warps, and only
    # where the tiles still fill the GPU.
    wide = block_m <= 32 or (block_m == 128 and triton.cdiv(n, 128) * m_tiles >= sms)
    block_n = 128 if wide else 64
    splits = 1
    if block_m <= 64:  # beyond, the partials would move about as many bytes as the codes
        tiles = triton.cdiv(n, block_n) * m_tiles
        splits = _splits(tiles, triton.cdiv(k, block_k), 2 * sms, min_iters=4)
    warps = 8 if block_m == 128 and wide else 4
    return Plan("gemm", block_m, block_n, block_k, splits, warps, 4 if block_m <= 32 else 3)


def _splits(tiles: int, iters: int, target: int, min_iters: int) -> int:
    """The power of two that brings `tiles` programs up to `target`, each split keeping at
    least `min_iters` of the `iters` K iterations."""
    splits = 1
    while (
        splits < MAX_SPLITS
        and tiles * splits < target
        and iters >= 2 * splits * min_iters
        and tiles <= COUNTERS
    ):
        splits *= 2
    return splits


# --- the kernels ---------------------------------------------------------------------------


@triton.jit
def _field(words, j: tl.constexpr, one, BITS: tl.constexpr):
    """Field j of each word as the float32 v = 1 + u / 2**BITS, where u is the int4 code, or
    the int8 code + 128. `one` is 1.0f's bits (see ONE_BITS)."""
    HALF: tl.constexpr = 16 // BITS  # fields per half word
    i: tl.constexpr = j % HALF
    if BITS == 8:
        words = words ^ -0x7F7F7F80  # 0x80808080: two's complement -> offset binary
    if j >= HALF:
        words = words >> 16
    # Masked in place, then moved to the top of the mantissa, under 1.0f's exponent.
    u = (words & (((1 << BITS) - 1) << (BITS * i))) << (23 - BITS - BITS * i)
    return (u | one).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_value(words, j: tl.constexpr):
    """Byte j of each word, an e4m3 code, as float32 (e4m3 -> float16 pairs -> float32)."""
    return (words >> (8 * j)).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    """tl.load, 0 where `mask` is off; unmasked when the shapes divide into whole tiles."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _load_words(w_ptr, offs_n, n_ok, it, KW, TILE_G: tl.constexpr, WPG: tl.constexpr,
                EVEN: tl.constexpr):  # fmt: skip
    """Iteration `it`'s words [BLOCK_N, TILE_G, WPG]: TILE_G blocks of WPG words a row, 0
    past the row's end. Loaded as [BLOCK_N, TILE_G * WPG], so that threads spread along
    the row before the blocks are split out."""
    word = it * TILE_G * WPG + tl.arange(0, TILE_G * WPG)
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * KW
    words = _load(rows + word[None, :], n_ok[:, None] & (word < KW)[None, :], EVEN)
    return tl.reshape(words, [words.shape[0], TILE_G, WPG])


@triton.jit
def _group_params(scale_ptr, min_ptr, offs_n, n_ok, it, NG, TILE_G: tl.constexpr,
                  EVEN: tl.constexpr):  # fmt: skip
    """Iteration `it`'s int4 (16 scale, min - 16 scale) [BLOCK_N, TILE_G, 1] in float32; 0 for
    groups past the row's end."""
    g = it * TILE_G + tl.arange(0, TILE_G)
    offs = offs_n[:, None] * NG + g[None, :]
    mask = n_ok[:, None] & (g < NG)[None, :]
    s16 = 16.0 * _load(scale_ptr + offs, mask, EVEN).to(tl.float32)
    lo = _load(min_ptr + offs, mask, EVEN).to(tl.float32)
    return s16[:, :, None], (lo - s16)[:, :, None]


@triton.jit
def _code_value(words, j: tl.constexpr, one, s16, shift, BITS: tl.constexpr,
                dtype: tl.constexpr):  # fmt: skip
    """Field j of each word dequantized, in `dtype` (int8: the code, before its row's scale)."""
    if BITS == 4:
        return (_field(words, j, one, 4) * s16 + shift).to(dtype)
    return (_field(words, j, one, 8) * 256.0 - 384.0).to(dtype)


@triton.jit
def _dequant_tile(w_ptr, scale_ptr, min_ptr, offs_n, n_ok, it, KW, NG, one, BITS: tl.constexpr,
                  BLOCK_N: tl.constexpr, TILE_G: tl.constexpr, WPG: tl.constexpr,
                  EVEN: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
    """Iteration `it`'s tile of W [BLOCK_N, TILE_G * WPG * 32 // BITS] in `dtype`, columns in
    order (int8: the codes, before their row's scale)."""
    words = _load_words(w_ptr, offs_n, n_ok, it, KW, TILE_G, WPG, EVEN)
    if BITS == 4:
        s16, shift = _group_params(scale_ptr, min_ptr, offs_n, n_ok, it, NG, TILE_G, EVEN)
        # Field j goes to column j * WPG + w of its group: pairing j with j + 4 (new axis a),
        # then with j + 2 (b), then with j + 1 (c) makes the new axes [a, b, c] count
        # j = 4a + 2b + c in order.
        t = tl.join(
            tl.join(
                tl.join(_code_value(words, 0, one, s16, shift, 4, dtype),
                        _code_value(words, 4, one, s16, shift, 4, dtype)),
                tl.join(_code_value(words, 2, one, s16, shift, 4, dtype),
                        _code_value(words, 6, one, s16, shift, 4, dtype)),
            ),
            tl.join(
                tl.join(_code_value(words, 1, one, s16, shift, 4, dtype),
                        _code_value(words, 5, one, s16, shift, 4, dtype)),
                tl.join(_code_value(words, 3, one, s16, shift, 4, dtype),
                        _code_value(words, 7, one, s16, shift, 4, dtype)),
            ),
        )  # [BLOCK_N, TILE_G, WPG, 2, 2, 2]  # fmt: skip
        t = tl.permute(t, (0, 1, 3, 4, 5, 2))  # [BLOCK_N, TILE_G, 2, 2, 2, WPG]
    else:  # the same with 4 fields: j = 2a + b
        t = tl.join(
            tl.join(_code_value(words, 0, one, 0.0, 0.0, 8, dtype),
                    _code_value(words, 2, one, 0.0, 0.0, 8, dtype)),
            tl.join(_code_value(words, 1, one, 0.0, 0.0, 8, dtype),
                    _code_value(words, 3, one, 0.0, 0.0, 8, dtype)),
        )  # [BLOCK_N, TILE_G, WPG, 2, 2]  # fmt: skip
        t = tl.permute(t, (0, 1, 3, 4, 2))
    return tl.reshape(t, [BLOCK_N, TILE_G * WPG * 32 // BITS])


@triton.jit
def _write(out, offs, mask, y_ptr, partial_ptr, counter_ptr, tile, pid_k, num_splits, plane,
           SPLIT: tl.constexpr):  # fmt: skip
    """Stores the float32 tile `out` at y_ptr + offs. Under split-K it stores its partial at
    partial_ptr + pid_k * plane + offs instead, and the tile's last program to arrive adds
    the partials into y."""
    if SPLIT:
        tl.store(partial_ptr + pid_k * plane + offs, out, mask=mask)
        tl.debug_barrier()  # every thread's partial is out before the ticket is taken
        ticket = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == num_splits - 1:
            total = tl.zeros_like(out)
            for s in range(num_splits):
                # .cg reads L2, where the other programs' partials are, never a stale L1 line
                part = tl.load(partial_ptr + s * plane + offs, mask=mask, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
                total += part
            tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(counter_ptr + tile, 0)
    else:
        tl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_iters", "iters_per_split"])
def _gemv_kernel(
    x_ptr,  # [K], one row
    w_ptr,  # [N, KW] int32 words
    scale_ptr,  # int4: [N, NG]; int8, fp8: [N]; fp8 in blocks: [N / FP8_BLOCK, NG]
    min_ptr,  # int4: [N, NG]; int8, fp8: unused
    y_ptr,  # [N]
    partial_ptr,  # [splits, N] float32 (only if SPLIT)
    counter_ptr,  # [tiles] int32, 0 between launches (only if SPLIT)
    N,
    K,
    KW,
    NG,
    num_iters,
    iters_per_split,
    one,  # ONE_BITS
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,  # columns per block of words (int4: per group)
    BLOCK_N: tl.constexpr,
    TILE_G: tl.constexpr,  # blocks per iteration
    EVEN: tl.constexpr,  # N, K in whole tiles: no masks but the split's
    SPLIT: tl.constexpr,
    FP8: tl.constexpr,  # e4m3 bytes in the plain layout (BITS 8)
    FP8_BLOCK: tl.constexpr,  # fp8 with a scale per FP8_BLOCK x FP8_BLOCK block; 0: per row
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    WPG: tl.constexpr = BLOCK * BITS // 32  # words per block
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N, TILE_G, WPG], tl.float32)
    x_sum = tl.zeros([TILE_G, WPG], tl.float32)  # int8: the sum of x, for the -384 s term
    first = pid_k * iters_per_split
    last = tl.minimum(first + iters_per_split, num_iters)
    for it in tl.range(first, last, num_stages=NUM_STAGES):
        words = _load_words(w_ptr, offs_n, n_ok, it, KW, TILE_G, WPG, EVEN)
        block = (it * TILE_G + tl.arange(0, TILE_G))[:, None]
        if FP8:  # field j of word w: column 4 w + j
            col0 = 4 * (block * WPG + tl.arange(0, WPG)[None, :])
        else:  # column j * WPG + w of the word's block
            col0 = block * BLOCK + tl.arange(0, WPG)[None, :]
        vx = tl.zeros([BLOCK_N, TILE_G, WPG], tl.float32)  # sum over a word's fields of v x
        xs = tl.zeros([TILE_G, WPG], tl.float32)  # ... and of x
        for j in tl.static_range(32 // BITS):
            k = col0 + j if FP8 else col0 + j * WPG
            x = _load(x_ptr + k, k < K, EVEN).to(tl.float32)
            if FP8:
                vx += _fp8_value(words, j) * x[None, :, :]
            else:
                vx += _field(words, j, one, BITS) * x[None, :, :]
                xs += x
        if FP8_BLOCK:  # each block of words lies in one block of scales
            kb = (it * TILE_G + tl.arange(0, TILE_G)) * BLOCK // FP8_BLOCK
            offs = (offs_n // FP8_BLOCK)[:, None] * NG + kb[None, :]
            s = _load(scale_ptr + offs, n_ok[:, None] & (kb < NG)[None, :], EVEN)
            acc += vx * s[:, :, None]
        elif FP8:
            acc += vx
        elif BITS == 4:  # sum over a word's fields of (16 s v + m - 16 s) x
            s16, shift = _group_params(scale_ptr, min_ptr, offs_n, n_ok, it, NG, TILE_G, EVEN)
            acc += s16 * vx + shift * xs[None, :, :]
        else:
            acc += vx
            x_sum += xs
    out = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N]
    if FP8:
        if not FP8_BLOCK:  # the row's scale (a block's was applied in the loop)
            out *= tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
    elif BITS == 8:  # the sum of s (256 v - 384) x
        scale = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        out = scale * (256.0 * out - 384.0 * tl.sum(tl.sum(x_sum, axis=1), axis=0))
    _write(out, offs_n, n_ok, y_ptr, partial_ptr, counter_ptr, pid_n, pid_k,
           tl.num_programs(1), N, SPLIT)  # fmt: skip


@triton.jit(do_not_specialize=["M", "num_iters", "iters_per_split"])
def _gemm_kernel(
    x_ptr,  # [M, K], rows stride_xm apart
    w_ptr,  # [N, KW] int32 words
    scale_ptr,  # int4: [N, NG]; int8: [N]
    min_ptr,  # int4: [N, NG]; int8: unused
    y_ptr,  # [M, N]
    partial_ptr,  # [splits, M, N] float32 (only if SPLIT)
    counter_ptr,  # [tiles] int32, 0 between launches (only if SPLIT)
    M,
    N,
    K,
    KW,
    NG,
    stride_xm,
    num_iters,
    iters_per_split,
    one,  # ONE_BITS
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,  # columns per block of words (int4: per group)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_G: tl.constexpr,  # blocks per iteration
    EVEN: tl.constexpr,  # N, K in whole tiles: no masks but the split's and x's rows
    SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    WPG: tl.constexpr = BLOCK * BITS // 32  # words per block
    BLOCK_K: tl.constexpr = TILE_G * BLOCK
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y^T's tile: W is the dot's left operand
    first = pid_k * iters_per_split
    for it in range(first, tl.minimum(first + iters_per_split, num_iters)):
        w = _dequant_tile(w_ptr, scale_ptr, min_ptr, offs_n, n_ok, it, KW, NG, one, BITS,
                          BLOCK_N, TILE_G, WPG, EVEN, x_ptr.dtype.element_ty)  # fmt: skip
        k = it * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN:
            x_ok = m_ok[None, :]
        else:
            x_ok = m_ok[None, :] & (k < K)[:, None]
        xt = tl.load(x_rows + k[:, None], mask=x_ok, other=0.0)  # [BLOCK_K, BLOCK_M]
        acc = tl.dot(w, xt, acc)  # [BLOCK_N, BLOCK_M]
    if BITS == 8:
        acc *= tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    offs = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]  # y[m, n] = acc[n, m]
    tile = pid_m * tl.num_programs(0) + pid_n
    _write(acc, offs, m_ok[None, :] & n_ok[:, None], y_ptr, partial_ptr, counter_ptr, tile,
           pid_k, tl.num_programs(2), M * N, SPLIT)  # fmt: skip


@triton.jit
def _dequant_kernel(
    w_ptr,  # [N, KW] int32 words
    scale_ptr,  # int4: [N, NG]; int8: [N]
    min_ptr,  # int4: [N, NG]; int8: unused
    out_ptr,  # [N, K]
    N,
    K,
    KW,
    NG,
    one,  # ONE_BITS
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_G: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    WPG: tl.constexpr = BLOCK * BITS // 32
    BLOCK_K: tl.constexpr = TILE_G * BLOCK
    pid_n, it = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w = _dequant_tile(w_ptr, scale_ptr, min_ptr, offs_n, n_ok, it, KW, NG, one, BITS, BLOCK_N,
                      TILE_G, WPG, False, tl.float32)  # fmt: skip
    if BITS == 8:
        w *= tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    k = it * BLOCK_K + tl.arange(0, BLOCK_K)
    out = out_ptr + offs_n.to(tl.int64)[:, None] * K + k[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & (k < K)[None, :])


# --- launching -----------------------------------------------------------------------------

_counters: dict[torch.device, torch.Tensor] = {}


def prepare(device: torch.device) -> None:
    """Allocates `device`'s split-K counters (zeros) if it has none yet. Must run before a
    CUDA graph captures the first call on `device`: a capture records the zeroing without
    running it. Int4Weight and Int8Weight call it when they are built."""
    if device not in _counters:
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def _device_counters(device: torch.device) -> torch.Tensor:
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("quant_gemm.prepare(device) must run before CUDA graph capture")
        prepare(device)
    return _counters[device]


def int4_linear(
    x: torch.Tensor,
    words: torch.Tensor,
    scale: torch.Tensor,
    lo: torch.Tensor,
    group_size: int,
    config: Plan | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 or fp16) times the int4 weight `pack_int4` made (words [N, Kp / 8],
    Kp >= K) with scale and min [N, Kp / group_size]: x W^T [..., N] in x's dtype. `config`
    replaces `plan`'s choice."""
    if group_size not in INT4_GROUP_SIZES or words.shape[1] * 8 < x.shape[-1]:
        raise ValueError(f"int4_linear needs a group size in {INT4_GROUP_SIZES} and codes for "
                         f"all {x.shape[-1]} columns; got {group_size}, {tuple(words.shape)}")  # fmt: skip
    return _run(x, words, scale, lo, 4, group_size, config)


def int8_linear(
    x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, config: Plan | None = None
) -> torch.Tensor:
    """x [..., K] (bf16 or fp16) times the int8 weight `pack_int8` made (words [N, Kp / 4],
    Kp >= K) with a scale [N] per row: x W^T [..., N] in x's dtype."""
    if words.shape[1] * 4 < x.shape[-1]:
        raise ValueError(f"int8_linear: codes {tuple(words.shape)} for {x.shape[-1]} columns")
    return _run(x, words, scale, scale, 8, INT8_BLOCK, config)


def fp8_gemv(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    block_size: int = 0,
    config: Plan | None = None,
) -> torch.Tensor:
    """One row x [..., K] (bf16 or fp16) times e4m3 codes [N, K] (contiguous, K a multiple of 4)
    with a float32 scale [N] per row, or with block_size B (a multiple of 64) a scale
    [ceil(N / B), ceil(K / B)] per B x B block: x W^T [..., N] in x's dtype, W read as it is
    stored."""
    n, k = codes.shape
    if x.numel() != x.shape[-1] or x.shape[-1] != k or k % 4 or not codes.is_contiguous():
        raise ValueError(f"fp8_gemv takes one row of {k} columns and contiguous codes with K in "
                         f"4s; got {tuple(x.shape)} by {tuple(codes.shape)}")  # fmt: skip
    if x.dtype not in DTYPES or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"fp8_gemv takes {DTYPES} activations and contiguous float32 scales")
    want = (-(-n // block_size), -(-k // block_size)) if block_size else (n,)
    if block_size % INT8_BLOCK or tuple(scale.shape) != want:
        raise ValueError(
            f"fp8_gemv: scales {tuple(scale.shape)} for codes {tuple(codes.shape)} in blocks "
            f"of {block_size} (a multiple of {INT8_BLOCK}; 0: per row)"
        )
    words = codes.view(torch.int32)
    x2 = x.reshape(1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    p = config or plan(1, n, k, 8, INT8_BLOCK, num_sms(x.device))
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _launch(x2, words, scale, scale, y, 8, INT8_BLOCK, p, fp8_block=block_size, fp8=True)
    return y.view(*x.shape[:-1], n)


def _run(x, words, scale, lo, bits, block, config) -> torch.Tensor:
    if x.dtype not in DTYPES or words.dtype != torch.int32 or not words.is_contiguous():
        raise ValueError(f"quantized GEMMs take {DTYPES} activations and contiguous int32 words")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, (n, kw) = x2.shape[0], words.shape
    p = config or plan(max(m, 1), n, kw * 32 // bits, bits, block, num_sms(x.device))
    if p.kernel == "dequant":
        y = F.linear(x2, _dequantize(words, scale, lo, bits, block, k, x.dtype, p))
    else:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m:
            _launch(x2, words, scale, lo, y, bits, block, p)
    return y.view(*x.shape[:-1], n)


def _launch(x, words, scale, lo, y, bits, block, p: Plan, fp8=False, fp8_block=0) -> None:
    (m, k), (n, kw) = x.shape, words.shape
    words_per_iter = p.block_k * bits // 32
    num_iters = triton.cdiv(kw, words_per_iter)  # the last one may be partial
    per_split = triton.cdiv(num_iters, p.splits)
    split = p.splits > 1
    tiles = triton.cdiv(n, p.block_n) * triton.cdiv(m, p.block_m)
    if split and tiles > COUNTERS:
        raise ValueError(f"split-K over {tiles} tiles; at most {COUNTERS}")
    partial = torch.empty(p.splits, m, n, dtype=torch.float32, device=x.device) if split else y
    counters = _device_counters(x.device) if split else y
    num_groups = scale.shape[1] if bits == 4 or fp8_block else 1
    even = n % p.block_n == 0 and kw % words_per_iter == 0 and k * bits == kw * 32
    common = dict(
        BITS=bits, BLOCK=block, BLOCK_N=p.block_n, TILE_G=p.block_k // block, EVEN=even,
        SPLIT=split, num_warps=p.num_warps, **pdl_args(x.device),
    )  # fmt: skip
    if p.kernel == "gemv":
        _gemv_kernel[(triton.cdiv(n, p.block_n), p.splits)](
            x, words, scale, lo, y, partial, counters, n, k, kw, num_groups, num_iters,
            per_split, ONE_BITS, FP8=fp8, FP8_BLOCK=fp8_block, NUM_STAGES=p.num_stages, **common,
        )  # fmt: skip
    elif fp8:
        raise ValueError(f"fp8 codes run the GEMV only, not {p.kernel!r}")
    else:
        _gemm_kernel[(triton.cdiv(n, p.block_n), triton.cdiv(m, p.block_m), p.splits)](
            x, words, scale, lo, y, partial, counters, m, n, k, kw, num_groups, x.stride(0),
            num_iters, per_split, ONE_BITS, BLOCK_M=p.block_m, num_stages=p.num_stages,
            **common,
        )  # fmt: skip


def _dequantize(words, scale, lo, bits, block, k, dtype, p: Plan) -> torch.Tensor:
    """The weight [N, K] in `dtype`."""
    n, kw = words.shape
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    grid = (triton.cdiv(n, p.block_n), triton.cdiv(kw, p.block_k * bits // 32))
    _dequant_kernel[grid](
        words, scale, lo, out, n, k, kw, scale.shape[1] if bits == 4 else 1, ONE_BITS, BITS=bits,
        BLOCK=block, BLOCK_N=p.block_n, TILE_G=p.block_k // block, num_warps=p.num_warps,
        **pdl_args(words.device),
    )  # fmt: skip
    return out
