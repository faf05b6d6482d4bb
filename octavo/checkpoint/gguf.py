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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from octavo.checkpoint.gguf_blocks import (
    BLOCK_SIZES,
    BLOCK_TYPES,
    Q8_0,
    GGUFTensor,
    block_codes,
    block_groups,
    dequantize_array,
)

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
    "ffn_gate_inp": "mlp.gate",  # the experts' router
    "ffn_gate_exps": "mlp.experts.gate_proj",  # every expert's, stacked: [E, I, hidden]
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",  # [E, hidden, I]
}
# Gemma's norms around both sub-blocks (llama.cpp's gemma2 / gemma3 names).
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3's fused projections, as HF stores them too (the model splits them).
_PHI3_LAYER_NAMES = _LAYER_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Architectures whose converter stores RMSNorm weights as 1 + w (HF keeps w).
_NORMS_PLUS_ONE = ("gemma2", "gemma3")
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors that are not weights of the HF model; the rope ones are read into the config.
_IGNORED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_GGUF_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
# Metadata value types (GGUFValueType): fixed-size ones by struct format; 8 and 9 below.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALAR_FORMATS |= {10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


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
    if ggml_type in BLOCK_SIZES:
        block_elems, block_bytes = BLOCK_SIZES[ggml_type]
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


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if unknown.
    `arch` picks Gemma's names for its norms."""
    match = _LAYER_RE.fullmatch(name)
    if match:
        layer, base, kind = match.groups()
        names = _GEMMA_LAYER_NAMES if arch in _NORMS_PLUS_ONE else _LAYER_NAMES
        names = _PHI3_LAYER_NAMES if arch == "phi3" else names
        return f"model.layers.{layer}.{names[base]}.{kind}" if base in names else None
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverts llama.cpp's q/k row permutation (`w` is [n_head * D, ...] or a bias [n_head * D])."""
    head_dim = w.shape[0] // n_head
    w = w.reshape(n_head, head_dim // 2, 2, *w.shape[1:])  # [heads, D/2, (x, y), ...]
    return w.swapaxes(1, 2).reshape(n_head * head_dim, *w.shape[3:])  # [heads * D, ...]


class GGUFWeight:
    """A GGUF tensor in HF layout, not dequantized yet: what a weight loader narrows (as
    loader.LazyTensor for safetensors), so that a weight no loader reads is never
    dequantized. `num_heads`: un-permute its rows as a llama q/k projection's (None: not)."""

    def __init__(self, tensor: GGUFTensor, num_heads: int | None, offset: float = 0.0) -> None:
        self.tensor = tensor
        self.num_heads = num_heads
        self.offset = offset  # added to every value (Gemma's norms: -1)
        self.shape = tensor.shape

    def dequantize(self) -> torch.Tensor:
        """The whole tensor as float32 (a view of the file's memory map if it is F32)."""
        values = torch.from_numpy(self._hf_rows(dequantize_array(self.tensor)))
        return values + self.offset if self.offset else values

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.dequantize().narrow(dim, start, length)

    @property
    def bits(self) -> int | None:
        """The bits of a block type's codes kept as they are (8 for Q8_0, 4 for the Q4
        types); None for any other type."""
        kind = self.tensor.ggml_type
        return None if kind not in BLOCK_TYPES else 8 if kind == Q8_0 else 4

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
            bits = torch.tensor(weight.bits, dtype=torch.uint8)
            yield name, bits.expand(weight.shape[0], weight.shape[1] // 16)
        else:
            yield name, weight.codes() if part == "codes" else weight.groups()


def _iter_gguf(path: str, hf_config: PretrainedConfig) -> Iterator[tuple[str, GGUFWeight]]:
    """(HF name, GGUFWeight) for every weight of the GGUF file."""
    gguf_file = open_gguf(path)
    arch = gguf_file.metadata.get("general.architecture")
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    qk_heads = {"q_proj": num_heads, "k_proj": num_kv_heads}
    # llama.cpp's fallback: an untied model without `output.weight` uses the embedding.
    head_from_embedding = "output.weight" not in gguf_file.tensors and not getattr(
        hf_config, "tie_word_embeddings", False
    )
    for tensor in gguf_file.tensors.values():
        if tensor.name in _IGNORED:
            continue
        hf_name = gguf_to_hf_name(tensor.name, arch)
        if hf_name is None:
            raise ValueError(f"{path}: GGUF tensor {tensor.name!r} has no HF counterpart")
        # llama.cpp permuted the rows of llama's q and k projections (see unpermute_qk).
        heads = qk_heads.get(hf_name.split(".")[-2]) if arch == "llama" else None
        offset = -1.0 if arch in _NORMS_PLUS_ONE and hf_name.endswith("norm.weight") else 0.0
        yield hf_name, GGUFWeight(tensor, heads, offset)
        if tensor.name == "token_embd.weight" and head_from_embedding:
            yield "lm_head.weight", GGUFWeight(tensor, None)
