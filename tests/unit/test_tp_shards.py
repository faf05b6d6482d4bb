"""Tensor-parallel shards, built in this process (no process group: building and loading
need only the rank and the size): each rank's parameters are its slices of the whole
model's, from safetensors and from dummy weights alike."""

from __future__ import annotations

import pytest
import torch
from model_utils import TINY
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from octavo.checkpoint.hf_config import load_hf_config
from octavo.checkpoint.loader import load_model
from octavo.model.parallel import set_tp

CONFIGS = {
    "llama": lambda: LlamaConfig(**(TINY | {"vocab_size": 255}), tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**(TINY | {"num_key_value_heads": 1}), head_dim=24),
}


@pytest.fixture(params=list(CONFIGS))
def checkpoint(request, tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[request.param]()).save_pretrained(tmp_path)
    return str(tmp_path), load_hf_config(str(tmp_path))


def _shards(path, cfg, load_format: str, size: int = 2):
    whole = load_model(path, cfg, torch.float32, torch.device("cpu"), load_format)
    shards = []
    try:
        for rank in range(size):
            set_tp(rank, size, None)
            shards.append(load_model(path, cfg, torch.float32, torch.device("cpu"), load_format))
    finally:
        set_tp(0, 1, None)
    return dict(whole.named_parameters()), [dict(s.named_parameters()) for s in shards]


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_each_rank_holds_its_slices_of_the_whole_model(checkpoint, load_format):
    path, cfg = checkpoint
    whole, shards = _shards(path, cfg, load_format)
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, 64 // 4
    d = getattr(cfg, "head_dim", None) or d
    vocab, rows = cfg.vocab_size, -(-cfg.vocab_size // 2)
    for rank, shard in enumerate(shards):
        for name, p in shard.items():
            w = whole[name]
            if "qkv_proj" in name:
                q, kv = heads * d, kv_heads * d
                kv_rows = w[q : q + kv] if kv_heads == 1 else w[q + rank * kv // 2 :][: kv // 2]
                v_rows = w[q + kv :] if kv_heads == 1 else w[q + kv + rank * kv // 2 :][: kv // 2]
                expected = torch.cat([w[rank * q // 2 :][: q // 2], kv_rows, v_rows])
            elif "gate_up_proj" in name:
                i = w.shape[0] // 2
                expected = torch.cat(
                    [w[rank * i // 2 :][: i // 2], w[i + rank * i // 2 :][: i // 2]]
                )
            elif "o_proj" in name or "down_proj" in name:
                expected = w.chunk(2, dim=1)[rank]
            elif "embed_tokens" in name or "lm_head" in name:
                expected = torch.zeros(rows, w.shape[1])
                part = w[rank * rows : (rank + 1) * rows]
                expected[: len(part)] = part
                assert len(part) == min(rows, vocab - rank * rows)
            else:  # norms: whole on every rank
                expected = w
            assert torch.equal(p, expected), name
