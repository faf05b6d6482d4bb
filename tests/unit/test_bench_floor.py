"""The benchmark floor counts the weights a forward pass reads: an untied input embedding is
only looked up (a few rows a step), a tied one is read whole as the LM head."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_utils import TINY
from transformers import LlamaConfig

from octavo.checkpoint.loader import load_model
from octavo.entrypoints.bench_floor import (
    DeviceCeilings,
    copy_sizes,
    meta_model,
    weights_read_per_step,
    workload_floor,
)


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


@pytest.mark.parametrize("name", ["qwen3-32b", "llama-3.1-70b"])
def test_meta_model_counts_a_bundled_models_parameters_without_memory(name):
    """A tensor-parallel floor builds the whole model on the meta device (rotary scaling too)."""
    from octavo.checkpoint.hf_config import load_hf_config
    from octavo.engine.builder import resolve_model

    cfg = load_hf_config(resolve_model(name))
    model = meta_model(cfg, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    assert {"qwen3-32b": 32.8e9, "llama-3.1-70b": 70.6e9}[name] == pytest.approx(params, rel=0.01)


# prompts 10 and 20 tokens, 3 and 2 output tokens: decode steps 1 (both) and 2 (the first).
WORK = dict(
    prompt_lens=[10, 20],
    output_lens=[3, 2],
    weight_bytes=100,
    num_params=50,
    head_params=10,
    kv_bytes_per_token=4,
)
# prefill FLOPs: 2 x ((50 - 10) x 30 + 10 x 2) = 2440; decode FLOPs: 2 x 50 x (2 + 1) = 300
# decode KV: step 1 reads 4 x (11 + 21) = 128, step 2 reads 4 x 12 = 48


@pytest.mark.parametrize(
    ("flops", "expected"),
    [
        (1e4, 176 + 300),  # weights bound: 3 steps x 100 against 2740 / 1e4
        (1.0, 176 + 2740),  # FLOPs bound: 2740 against 300
    ],
)
def test_serial_floor_adds_decode_kv_reads_to_the_gemms_larger_bound(flops, expected):
    """The serial floor: decode KV reads plus the larger of all weight reads (one per step of
    the longest request) and all FLOPs (the LM head once per prompt)."""
    from octavo.entrypoints.bench_floor import SerialWork, serial_floor

    ceilings = DeviceCeilings(copy_bytes_per_s=1.0, matmul_flops=flops)
    assert serial_floor(SerialWork(**WORK), ceilings) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("flops", "expected"),
    [
        # prefill max(100, 2.44); step 1: 128 + max(100, 2 x 50 x 2 / 1e3 = 0.2);
        # step 2: 48 + max(100, 0.1)
        (1e3, 100 + 228 + 148),
        # prefill 2440 / 0.9; step 1: 128 + max(100, 200 / 0.9); step 2: 48 + max(100, 100 / 0.9)
        (0.9, (2440 + 200 + 100) / 0.9 + 128 + 48),
    ],
)
def test_fcfs_estimate_charges_each_decode_step_its_kv_read_and_gemms(flops, expected):
    """The FCFS estimate: a prefill step (its weight read or the prompts' FLOPs), then each
    decode step's own KV read plus the larger of its weight read and its FLOPs at the batch
    still running."""
    from octavo.entrypoints.bench_floor import SerialWork, fcfs_serial_estimate

    ceilings = DeviceCeilings(copy_bytes_per_s=1.0, matmul_flops=flops)
    assert fcfs_serial_estimate(SerialWork(**WORK), ceilings) == pytest.approx(expected)


@given(
    lens=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40)), min_size=1, max_size=8),
    flops=st.floats(1e2, 1e7),
)
@settings(max_examples=50, deadline=None)
def test_the_serial_floor_lies_between_the_memory_floor_and_the_fcfs_estimate(lens, flops):
    """Any schedule can do at least as well as FCFS's, and no serial engine beats reading
    the weights once per step plus the decode KV (the memory floor, less its prefill KV)."""
    from octavo.entrypoints.bench_floor import SerialWork, fcfs_serial_estimate, serial_floor

    prompts, outputs = [p for p, _ in lens], [o for _, o in lens]
    work = SerialWork(prompts, outputs, 1000, 500, 100, 4)
    ceilings = DeviceCeilings(copy_bytes_per_s=1.0, matmul_flops=flops)
    weights_only = max(outputs) * 1000
    floor = serial_floor(work, ceilings)
    assert weights_only <= floor <= fcfs_serial_estimate(work, ceilings) * (1 + 1e-9)


def test_a_mixture_of_experts_step_reads_the_experts_its_tokens_reach():
    """Of W = 1000 bytes, 800 are 8 experts of which a token reaches 2: one token reads
    200 + 800 / 4; more tokens reach more, up to all; a token multiplies by its 2 experts."""
    from octavo.entrypoints.bench_floor import SerialWork, serial_floor

    work = SerialWork([10], [3], 1000, 500, 100, 4, expert_bytes=800, expert_params=400,
                      expert_share=0.25)  # fmt: skip
    assert work.step_weight_bytes(1) == pytest.approx(400)
    assert work.step_weight_bytes(2) == pytest.approx(1000 - 800 * 0.75**2)
    assert work.step_weight_bytes(10_000) == pytest.approx(1000)
    assert work.active_params == 200
    dense = SerialWork([10], [3], 1000, 500, 100, 4)
    assert dense.step_weight_bytes(1) == dense.step_weight_bytes(50) == 1000
    ceilings = DeviceCeilings(copy_bytes_per_s=1.0, matmul_flops=1e9)
    # Three steps of the one request, 400 bytes each, and decode KV 4 x (11 + 12).
    assert serial_floor(work, ceilings) == pytest.approx(3 * 400 + 4 * 23)


def test_copy_sizes_keep_the_smallest_and_add_those_that_fit():
    gib = 1 << 30
    assert copy_sizes(0) == [gib]  # always one copy to time, whatever the free memory
    assert copy_sizes(5 * gib) == [gib, 2 * gib]  # 2 x 2 GiB + 1 GiB spare fits; 4 GiB not
    assert copy_sizes(9 * gib) == [gib, 2 * gib, 4 * gib]
    assert copy_sizes(9 * gib - 1) == [gib, 2 * gib]


def test_weights_read_per_step_of_kept_gguf_blocks(tmp_path):
    """With a GGUF file's blocks kept, a step reads the LM head's blocks (the tied Q8_0
    embedding's, as two 4-bit planes and their scales), not the embedding's lookup blocks or
    an empty float table; the head still counts as vocabulary x hidden parameters."""
    import gguf
    from test_gguf_loader import TINY as GGUF_TINY
    from test_gguf_loader import hf_to_gguf_tensors, tiny_hf, write_gguf

    from octavo.checkpoint.hf_config import load_hf_config
    from octavo.entrypoints.bench_floor import lm_head_params, lm_head_weights

    cfg = LlamaConfig(**GGUF_TINY, tie_word_embeddings=True)
    qtypes = {"token_embd.weight": gguf.GGMLQuantizationType.Q8_0}
    path = str(tmp_path / "q8.gguf")
    write_gguf(path, "llama", cfg, hf_to_gguf_tensors(tiny_hf(cfg), "llama", cfg, qtypes))
    cpu, hf_config = torch.device("cpu"), load_hf_config(path)
    model = load_model(path, hf_config, torch.float32, cpu, quantization="gguf")
    read = {id(p) for p in weights_read_per_step(model)}
    head = {id(p) for p in model.lm_head.quant.parameters()}
    lookup = {id(p) for p in model.model.embed_tokens.parameters()}
    assert head <= read and not lookup & read
    assert {id(p) for p in lm_head_weights(model)} == head
    assert lm_head_params(model) == cfg.vocab_size * cfg.hidden_size
    assert len(read) == len({id(p) for p in model.parameters()}) - len(lookup)


def test_a_sliding_layer_reads_at_most_its_window():
    """K = 4 bytes a token over two layers, one with a window of 4: contexts 3, 4, 5 and 6
    read 3 + 4 + 4 + 4 positions there and 3 + 4 + 5 + 6 on the other, 2 bytes each."""
    from octavo.entrypoints.bench_floor import SerialWork

    work = SerialWork([3], [4], 1000, 500, 100, 4, windows=(4, None))
    assert work.kv_bytes_read(3, 4) == 2 * (15 + 18)
    assert work.decode_kv_bytes(1) == 2 * (4 + 4)
    assert SerialWork([3], [4], 1000, 500, 100, 4).kv_bytes_read(3, 4) == 4 * 18
