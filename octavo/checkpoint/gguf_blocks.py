"""A GGUF tensor's values: dequantized to float32, or, for the block types octavo keeps
(Q4_0, Q4_1, Q4_K, Q8_0), its codes and its groups' scales and minimums read apart from its
bytes, never as floats (checkpoint/gguf.py reads the file)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

# ggml tensor types (GGMLQuantizationType) dequantized here; any other type goes through the
# `gguf` package's slower code.
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
Q4_K = 12  # dequantized by the `gguf` package; with quantization="gguf" kept as 4-bit groups
BLOCK_TYPES = (Q4_0, Q4_1, Q4_K, Q8_0)  # kept in their blocks with quantization="gguf"
# ggml type -> (elements per block, bytes per block).
BLOCK_SIZES = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20)}
BLOCK_SIZES[Q8_0] = (32, 34)


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file, not read yet."""

    name: str
    shape: tuple[int, ...]  # HF order: GGUF's dims reversed
    ggml_type: int
    data: np.ndarray  # its bytes (uint8), a view of the file's memory map


def dequantize_tensor(tensor: GGUFTensor) -> torch.Tensor:
    """A GGUF tensor as float32 in HF shape. An F32 tensor is a view of the memory map."""
    return torch.from_numpy(dequantize_array(tensor))


def dequantize_array(tensor: GGUFTensor) -> np.ndarray:
    # NOTE: numpy, not torch: single-threaded elementwise work over small blocks, which
    # torch's thread pool slows down many times over when the CPU is shared.
    data, kind = tensor.data, tensor.ggml_type
    if kind == F32:
        values = data.view(np.float32)
    elif kind == F16:
        values = data.view(np.float16).astype(np.float32)
    elif kind == BF16:  # bfloat16 is the upper half of a float32
        values = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif kind in _BLOCK_DEQUANTIZERS:
        values = _BLOCK_DEQUANTIZERS[kind](data.reshape(-1, BLOCK_SIZES[kind][1]))
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = data.reshape(-1, data.size // max(1, int(np.prod(tensor.shape[:-1]))))
        values = dequantize(rows, GGMLQuantizationType(kind)).astype(np.float32, copy=False)
    return values.reshape(tensor.shape)


# Block layouts (ggml's): float16 scale d (and for Q4_1 a float16 offset m), then 32 quants.
# Q4 packs two per byte: byte j holds element j in its low nibble and j + 16 in its high.
# The arithmetic follows the `gguf` package's, so both give the same floats.
def _halves(blocks: np.ndarray, count: int) -> np.ndarray:
    """The first `count` float16 fields of each block as float32: [B, count]."""
    return blocks[:, : 2 * count].copy().view(np.float16).astype(np.float32)


def _nibbles(quants: np.ndarray) -> np.ndarray:
    """[B, 16] bytes -> [B, 32] float32 values 0..15, low nibbles first."""
    out = np.empty((quants.shape[0], 2, 16), np.float32)
    np.bitwise_and(quants, 0x0F, out=out[:, 0], casting="unsafe")
    np.right_shift(quants, 4, out=out[:, 1], casting="unsafe")
    return out.reshape(-1, 32)


def _dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 2:])
    q -= 8
    q *= _halves(blocks, 1)
    return q


def _dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    d_m = _halves(blocks, 2)
    q = _nibbles(blocks[:, 4:])
    q *= d_m[:, :1]
    q += d_m[:, 1:]
    return q


def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    q *= _halves(blocks, 1)
    return q


_BLOCK_DEQUANTIZERS = {Q4_0: _dequantize_q4_0, Q4_1: _dequantize_q4_1, Q8_0: _dequantize_q8_0}


# Where a Q4 block's quants start: after d (Q4_0); d and m (Q4_1); d, dmin and 12 bytes of
# 6-bit scales and minimums (Q4_K's super-block of 256).
_Q4_QUANTS_AT = {Q4_0: 2, Q4_1: 4, Q4_K: 16}


def block_codes(tensor: GGUFTensor) -> np.ndarray:
    """A Q4_0/Q4_1/Q4_K/Q8_0 tensor's codes (uint8) in its shape, read from its bytes: 0..15
    for the Q4 types, the int8 code + 128 for Q8_0.

    Q4_0/Q4_1: byte j of a block's 16 holds element j in its low nibble and j + 16 in its
    high. Q4_K: each of a super-block's four runs of 32 bytes holds two groups of 32, the
    first in the low nibbles, the second in the high ones.
    """
    kind = tensor.ggml_type
    if kind == Q8_0:
        codes = tensor.data.reshape(-1, BLOCK_SIZES[Q8_0][1])[:, 2:] ^ np.uint8(0x80)
        return codes.reshape(tensor.shape)
    block_bytes = 144 if kind == Q4_K else BLOCK_SIZES[kind][1]
    quants = tensor.data.reshape(-1, block_bytes)[:, _Q4_QUANTS_AT[kind] :]
    width = 32 if kind == Q4_K else 16
    # NOTE: torch, not numpy (as _nibbles): its loops take these short rows ~3x faster.
    runs = torch.from_numpy(quants).unflatten(1, (-1, width))  # [B, runs, width]
    codes = torch.empty((*runs.shape[:2], 2, width), dtype=torch.uint8)
    torch.bitwise_and(runs, 0x0F, out=codes[:, :, 0])
    torch.bitwise_right_shift(runs, 4, out=codes[:, :, 1])
    return codes.numpy().reshape(tensor.shape)


def block_groups(tensor: GGUFTensor) -> np.ndarray:
    """A Q4_0/Q4_1/Q4_K/Q8_0 tensor [..., K]'s groups of 32 as float32 [..., K / 16]: group g's
    scale in column 2 g, its minimum in column 2 g + 1 (value = code * scale + min, codes as
    block_codes gives them). Q4_1 stores both; Q4_0 its scale d, with min -8 d; Q8_0 d,
    with min -128 d; Q4_K a 6-bit scale and minimum per group, times its super-block's d
    and dmin."""
    if tensor.ggml_type == Q4_K:
        return _q4_k_groups(tensor).reshape(*tensor.shape[:-1], -1)
    blocks = tensor.data.reshape(-1, BLOCK_SIZES[tensor.ggml_type][1])
    d_m = _halves(blocks, 2 if tensor.ggml_type == Q4_1 else 1)  # [B, 2] or [B, 1]
    if tensor.ggml_type != Q4_1:
        d_m = np.concatenate([d_m, (-8 if tensor.ggml_type == Q4_0 else -128) * d_m], axis=1)
    return d_m.reshape(*tensor.shape[:-1], -1)


def _q4_k_groups(tensor: GGUFTensor) -> np.ndarray:
    """block_groups of a Q4_K tensor as [B, 8, 2]: per super-block of 256, d and dmin (float16),
    twelve bytes of 6-bit scales and minimums for its eight groups, then the codes; a value
    is (d * scale) * q - dmin * min, computed as the `gguf` package dequantizes it."""
    from gguf.quants import Q4_K as Q4KFormat

    blocks = tensor.data.reshape(-1, Q4KFormat.type_size)
    d_dmin = _halves(blocks, 2)
    scales, mins = Q4KFormat.get_scale_min(blocks[:, 4:16])  # [B, 8] each
    out = np.empty((blocks.shape[0], 8, 2), np.float32)
    out[:, :, 0] = d_dmin[:, :1] * scales.astype(np.float32)
    out[:, :, 1] = -(d_dmin[:, 1:] * mins.astype(np.float32))
    return out
