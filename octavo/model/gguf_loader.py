"""Weights from a GGUF file, dequantized to float32 and renamed to HF checkpoint names.

GGUF stores shapes fastest-dimension first, so a GGUF [hidden, vocab] tensor is HF's
[vocab, hidden]. llama.cpp's converter permutes the rows of llama-arch q/k projections
from HF's rotate-half rope layout to its interleaved one; we permute them back:

    HF rows of one head:   [x0 .. x(D/2-1) | y0 .. y(D/2-1)]      (pairs are (xi, yi))
    GGUF rows of one head: [x0 y0 x1 y1 ...]
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
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


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUF ReaderTensor as float32 in HF shape (GGUF's dims reversed)."""
    from gguf.quants import dequantize

    data = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    data = np.asarray(data, dtype=np.float32).reshape(shape)
    return data if data.flags.writeable else data.copy()  # F32 tensors view the mmap


def iter_gguf_weights(path: str, hf_config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, float32 tensor) for every weight of the GGUF file.

    Raises:
        ValueError: a tensor name that maps to no HF weight and is not known to be ignorable.
    """
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    names = {t.name for t in reader.tensors}
    for tensor in reader.tensors:
        if tensor.name in _IGNORED:
            continue
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            raise ValueError(f"{path}: GGUF tensor {tensor.name!r} has no HF counterpart")
        weight = dequantize_tensor(tensor)
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            weight = unpermute_qk(weight, num_heads)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            weight = unpermute_qk(weight, num_kv_heads)
        yield hf_name, torch.from_numpy(weight)
        untied = not getattr(hf_config, "tie_word_embeddings", False)
        if tensor.name == "token_embd.weight" and "output.weight" not in names and untied:
            yield "lm_head.weight", torch.from_numpy(weight.copy())  # llama.cpp's fallback
