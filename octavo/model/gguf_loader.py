"""GGUF files: read once through one memory map, then the HF config, the tokenizer's chat
template and the weights (dequantized to float32, renamed to HF checkpoint names) all come
from the same `GGUFFile`. Q4 and Q8_0 tensors also come as they are stored, codes and
groups apart (iter_gguf_blocks), for quantization="gguf" to keep without building their
float values.

GGUF stores shapes fastest-dimension first, so a GGUF [hidden, vocab] tensor is HF's
[vocab, hidden]. llama.cpp's converter permutes the rows of llama-arch q/k projections
from HF's rotate-half rope layout to its interleaved one; we permute them back:

    HF rows of one head:   [x0 .. x(D/2-1) | y0 .. y(D/2-1)]      (pairs are (xi, yi))
    GGUF rows of one head: [x0 y0 x1 y1 ...]
"""

from __future__ import annotations

import functools
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# GGUF tensor name (after `blk.N.`) -> HF name (after `model.layers.N.`).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors that are not weights of the HF model; `rope_freqs` is read into the config.
_IGNORED = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_GGUF_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
# Metadata value types (GGUFValueType): fixed-size ones by struct format; 8 and 9 below.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALAR_FORMATS |= {10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# ggml tensor types (GGMLQuantizationType) dequantized here; any other type goes through the
# `gguf` package's slower code.
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
Q4_K = 12  # dequantized by the `gguf` package; with quantization="gguf" kept as 4-bit groups
BLOCK_TYPES = (Q4_0, Q4_1, Q4_K, Q8_0)  # kept in their blocks with quantization="gguf"
# ggml type -> (elements per block, bytes per block).
_BLOCK_SIZES = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20)}
_BLOCK_SIZES[Q8_0] = (32, 34)


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file, not read yet."""

    name: str
    shape: tuple[int, ...]  # HF order: GGUF's dims reversed
    ggml_type: int
    data: np.ndarray  # its bytes (uint8), a view of the file's memory map


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (key -> int, float, bool, str or list) and its tensors by name."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


def open_gguf(path: str) -> GGUFFile:
    """The GGUF file at `path`, read once per process while the file is unchanged: the
    config, the tokenizer and the weights share one read.

    Raises:
        ValueError: not a GGUF file, an unsupported version, or a truncated file.
    """
    real = os.path.realpath(path)
    stat = os.stat(real)
    return _open_cached(real, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    # size and mtime are part of the key, so a file rewritten in place is read again.
    return read_gguf(path)


def read_gguf(path: str) -> GGUFFile:
    """Parses the header, metadata and tensor table of a GGUF file; tensor data stays in the
    memory map until dequantized. See `open_gguf` for errors."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < _HEADER_BYTES:
            raise ValueError(f"{path} is not a GGUF file (shorter than a GGUF header)")
        # ACCESS_COPY: writable views (torch.from_numpy takes them) that never write the file.
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        return _parse(path, buf)
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: a truncated or corrupt GGUF file ({e})") from e


def _parse(path: str, buf: mmap.mmap) -> GGUFFile:
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in _GGUF_VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
    pos = _HEADER_BYTES
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key, pos = _read_string(buf, pos)
        (value_type,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _read_value(buf, pos + 4, value_type)
    table = []
    for _ in range(num_tensors):
        name, pos = _read_string(buf, pos)
        (num_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * num_dims)
        pos += 4 + 8 * num_dims + 12
        table.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-pos // alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, offset in table:
        start = data_start + offset
        nbytes = _num_bytes(ggml_type, shape)
        if start + nbytes > len(buf):
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
        data = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start)
        tensors[name] = GGUFTensor(name, shape, ggml_type, data)
    return GGUFFile(path, metadata, tensors)


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + length
    return buf[pos + 8 : end].decode("utf-8"), end


def _read_value(buf: mmap.mmap, pos: int, value_type: int) -> tuple[Any, int]:
    """One metadata value and the position after it; arrays come back as lists."""
    if value_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(buf, pos)
    if value_type != _ARRAY:
        raise ValueError(f"unknown GGUF metadata value type {value_type}")
    item_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[item_type]
        items = struct.unpack_from(f"<{count}{fmt[1]}", buf, pos)
        return list(items), pos + count * struct.calcsize(fmt)
    values = []
    if item_type == _STRING:  # a vocabulary, say: the file's largest metadata, read inline
        unpack_length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (length,) = unpack_length(buf, pos)
            values.append(buf[pos + 8 : pos + 8 + length].decode("utf-8"))
            pos += 8 + length
        return values, pos
    for _ in range(count):  # nested arrays
        value, pos = _read_value(buf, pos, item_type)
        values.append(value)
    return values, pos


def _num_bytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    if ggml_type in _BLOCK_SIZES:
        block_elems, block_bytes = _BLOCK_SIZES[ggml_type]
    else:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError) as e:
            raise ValueError(f"unknown ggml tensor type {ggml_type}") from e
    num_elems = int(np.prod(shape, dtype=np.int64))
    if num_elems % block_elems:
        raise ValueError(f"a tensor of shape {shape} is not whole blocks of {block_elems}")
    return num_elems // block_elems * block_bytes


def gguf_to_hf_name(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if unknown."""
    match = _LAYER_RE.fullmatch(name)
    if match:
        layer, base, kind = match.groups()
        if base not in _LAYER_NAMES:
            return None
        return f"model.layers.{layer}.{_LAYER_NAMES[base]}.{kind}"
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverts llama.cpp's q/k row permutation (`w` is [n_head * D, ...] or a bias [n_head * D])."""
    head_dim = w.shape[0] // n_head
    w = w.reshape(n_head, head_dim // 2, 2, *w.shape[1:])  # [heads, D/2, (x, y), ...]
    return w.swapaxes(1, 2).reshape(n_head * head_dim, *w.shape[3:])  # [heads * D, ...]


def dequantize_tensor(tensor: GGUFTensor) -> torch.Tensor:
    """A GGUF tensor as float32 in HF shape. An F32 tensor is a view of the memory map."""
    return torch.from_numpy(_dequantize(tensor))


def _dequantize(tensor: GGUFTensor) -> np.ndarray:
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
        values = _BLOCK_DEQUANTIZERS[kind](data.reshape(-1, _BLOCK_SIZES[kind][1]))
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
        codes = tensor.data.reshape(-1, _BLOCK_SIZES[Q8_0][1])[:, 2:] ^ np.uint8(0x80)
        return codes.reshape(tensor.shape)
    block_bytes = 144 if kind == Q4_K else _BLOCK_SIZES[kind][1]
    quants = tensor.data.reshape(-1, block_bytes)[:, _Q4_QUANTS_AT[kind] :]
    width = 32 if kind == Q4_K else 16
    # NOTE: torch, not numpy (as _nibbles): its loops take these short rows ~3x faster.
    runs = torch.from_numpy(quants).unflatten(1, (-1, width))  # [B, runs, width]
    codes = torch.empty((*runs.shape[:2], 2, width), dtype=torch.uint8)
    torch.bitwise_and(runs, 0x0F, out=codes[:, :, 0])
    torch.bitwise_right_shift(runs, 4, out=codes[:, :, 1])
    return codes.numpy().reshape(tensor.shape)


def block_groups(tensor: GGUFTensor) -> np.ndarray:
    """A Q4_0/Q4_1/Q4_K/Q8_0 tensor [N, K]'s groups of 32 as float32 [N, K / 16]: group g's
    scale in column 2 g, its minimum in column 2 g + 1 (value = code * scale + min, codes as
    block_codes gives them). Q4_1 stores both; Q4_0 its scale d, with min -8 d; Q8_0 d,
    with min -128 d; Q4_K a 6-bit scale and minimum per group, times its super-block's d
    and dmin."""
    if tensor.ggml_type == Q4_K:
        return _q4_k_groups(tensor).reshape(tensor.shape[0], -1)
    blocks = tensor.data.reshape(-1, _BLOCK_SIZES[tensor.ggml_type][1])
    d_m = _halves(blocks, 2 if tensor.ggml_type == Q4_1 else 1)  # [B, 2] or [B, 1]
    if tensor.ggml_type != Q4_1:
        d_m = np.concatenate([d_m, (-8 if tensor.ggml_type == Q4_0 else -128) * d_m], axis=1)
    return d_m.reshape(tensor.shape[0], -1)


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


class GGUFWeight:
    """A GGUF tensor in HF layout, not dequantized yet: what a weight loader narrows (as
    loader.LazyTensor for safetensors), so that a weight no loader reads is never
    dequantized. `num_heads`: un-permute its rows as a llama q/k projection's (None: not)."""

    def __init__(self, tensor: GGUFTensor, num_heads: int | None) -> None:
        self.tensor = tensor
        self.num_heads = num_heads
        self.shape = tensor.shape

    def dequantize(self) -> torch.Tensor:
        """The whole tensor as float32 (a view of the file's memory map if it is F32)."""
        return torch.from_numpy(self._hf_rows(_dequantize(self.tensor)))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.dequantize().narrow(dim, start, length)

    def codes(self) -> torch.Tensor:
        """A Q4_0/Q4_1/Q4_K/Q8_0 matrix's codes, uint8 [N, K] (block_codes)."""
        return torch.from_numpy(self._hf_rows(block_codes(self.tensor)))

    def groups(self) -> torch.Tensor:
        """Its scales and minimums, float32 [N, K / 16] (block_groups)."""
        return torch.from_numpy(self._hf_rows(block_groups(self.tensor)))

    def _hf_rows(self, rows: np.ndarray) -> np.ndarray:
        return rows if self.num_heads is None else unpermute_qk(rows, self.num_heads)


def iter_gguf_weights(
    path: str, hf_config: PretrainedConfig, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """Yields (HF name, float32 tensor) for every weight of the GGUF file; lazy=True: a
    GGUFWeight instead, dequantized when a loader narrows it.

    Raises:
        ValueError: a tensor name that maps to no HF weight and is not known to be ignorable.
    """
    for name, weight in _iter_gguf(path, hf_config):
        yield name, weight if lazy else weight.dequantize()


def iter_gguf_blocks(
    path: str, hf_config: PretrainedConfig, part: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, tensor) for the file's Q4_0, Q4_1, Q4_K and Q8_0 matrices only, read
    from their bytes (no float values): part "codes", their codes as uint8 [N, K] (0..15 for
    the Q4 types); part "groups", each group of 32's scale and minimum as float32 [N, K / 16]
    (value = code * scale + min); part "bits", the bits of their codes (8 for Q8_0, else 4)
    as uint8 [N, K / 16], read from no bytes. All are in HF layout, so a model's own weight
    loaders place them as they place the weights: rows alike, and a slice of input features
    on whole groups alike.

    Raises:
        ValueError: an unknown part, or as iter_gguf_weights.
    """
    if part not in ("codes", "groups", "bits"):
        raise ValueError(f"part must be 'codes', 'groups' or 'bits', got {part!r}")
    for name, weight in _iter_gguf(path, hf_config):
        kind = weight.tensor.ggml_type
        if kind not in BLOCK_TYPES or len(weight.shape) != 2:
            continue
        if part == "bits":
            bits = torch.tensor(8 if kind == Q8_0 else 4, dtype=torch.uint8)
            yield name, bits.expand(weight.shape[0], weight.shape[1] // 16)
        else:
            yield name, weight.codes() if part == "codes" else weight.groups()


def _iter_gguf(path: str, hf_config: PretrainedConfig) -> Iterator[tuple[str, GGUFWeight]]:
    """(HF name, GGUFWeight) for every weight of the GGUF file."""
    gguf_file = open_gguf(path)
    arch = gguf_file.metadata.get("general.architecture")
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    # llama.cpp's fallback: an untied model without `output.weight` uses the embedding.
    head_from_embedding = "output.weight" not in gguf_file.tensors and not getattr(
        hf_config, "tie_word_embeddings", False
    )
    for tensor in gguf_file.tensors.values():
        if tensor.name in _IGNORED:
            continue
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            raise ValueError(f"{path}: GGUF tensor {tensor.name!r} has no HF counterpart")
        heads = None
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            heads = num_heads
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            heads = num_kv_heads
        yield hf_name, GGUFWeight(tensor, heads)
        if tensor.name == "token_embd.weight" and head_from_embedding:
            yield "lm_head.weight", GGUFWeight(tensor, None)
