"""The benchmark floor counts the weights a forward pass reads: an untied input embedding is
only looked up (a few rows a step), a tied one is read whole as the LM head."""

from __future__ import annotations

import pytest
import torch
from model_utils import TINY
from transformers import LlamaConfig

from octavo.entrypoints.bench_floor import DeviceCeilings, weights_read_per_step, workload_floor
from octavo.model.loader import load_model


@pytest.mark.parametrize("tied", [True, False])
def test_weights_read_per_step(tied):
    cfg = LlamaConfig(**TINY, architectures=["LlamaForCausalLM"], tie_word_embeddings=tied)
    model = load_model("unused", cfg, torch.float32, torch.device("cpu"), "dummy")
    everything = {p.data_ptr(): p.numel() for p in model.parameters()}
    table = 256 * 64
    assert sum(everything.values()) == (1 if tied else 2) * table + sum(
        p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n
    )
    read = sum(p.numel() for p in weights_read_per_step(model))
    assert read == sum(everything.values()) - (0 if tied else table)
    fl = workload_floor(model, cfg, torch.float32, [10], [3], DeviceCeilings(1e9, 1e12))
    assert fl.weight_bytes == 4 * read
    # KV read by 3 decode steps over contexts 10, 11, 12: layers x 2 x kv_heads x head_dim x 4
    assert fl.kv_read_bytes == 2 * 2 * 2 * 16 * 4 * (10 + 11 + 12)
