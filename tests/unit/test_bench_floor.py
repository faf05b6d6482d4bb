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


@pytest.mark.parametrize(
    ("flops", "expected"),
    [
        # Bandwidth-bound GEMMs. prefill 2 x (40 x 30 + 10 x 2) / 1e3 = 2.44; step 0 (both
        # running): KV 4 x (10 + 20) = 120, GEMMs max(100, 0.2) = 100; step 1 (the first
        # only, at position 11): KV 4 x 11 = 44, GEMMs 100.
        (1e3, 2.44 + 220 + 144),
        # Compute-bound GEMMs: prefill 2440; step 0: 120 + max(100, 200); step 1: 44 + 100.
        (1.0, 2440 + 320 + 144),
    ],
)
def test_serial_bound_adds_each_steps_kv_read_to_its_gemms(flops, expected):
    """The serial bound charges each decode step its own KV read plus the larger of its
    weight read and its FLOPs, and the prompts their FLOPs (the LM head only once each)."""
    from octavo.entrypoints.bench_floor import serial_bound

    seconds = serial_bound(
        prompt_lens=[10, 20],
        output_lens=[2, 1],
        weight_bytes=100,
        num_params=50,
        head_params=10,
        kv_bytes_per_token=4,
        ceilings=DeviceCeilings(copy_bytes_per_s=1.0, matmul_flops=flops),
    )
    assert seconds == pytest.approx(expected)


def test_the_serial_bound_is_never_below_the_memory_floor():
    cfg = LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    model = load_model("unused", cfg, torch.float32, torch.device("cpu"), "dummy")
    fl = workload_floor(model, cfg, torch.float32, [100, 7, 300], [50, 9, 1], DeviceCeilings(1e9, 1e12))
    assert fl.serial_s >= fl.memory_s > 0
