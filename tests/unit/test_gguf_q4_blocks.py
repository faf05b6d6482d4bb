"""quantization="gguf": Q4_0/Q4_1/Q4_K/Q8_0 tensors kept as their own codes, scales and
minimums, read from the file's bytes and placed by the model's weight loaders, never through
float weights; whatever cannot be kept loads as float."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from test_gguf_loader import TINY, hf_to_gguf_tensors, tiny_hf, write_gguf
from transformers import LlamaConfig

from octavo.checkpoint.gguf_blocks import GGUFTensor, block_codes, block_groups
from octavo.checkpoint.hf_config import load_hf_config
from octavo.checkpoint.loader import load_model
from octavo.model.layers import Linear
from octavo.model.parallel import set_tp
from octavo.quant import gguf as gguf_method
from octavo.quant import rounding
from octavo.quant import weights as quantization

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_codes_and_groups_give_the_gguf_packages_values(qtype):
    """Random blocks: codes in ggml's element order (Q4_0/Q4_1: byte j holds element j low and
    j + 16 high; Q4_K: each 32 bytes a group low and the next high; Q8_0: int8 + 128) times
    their group's scale plus its minimum are exactly the `gguf` package's dequantization. A
    wrong nibble order misplaces ~15 of 16 values."""
    rng = np.random.default_rng(0)
    rows, cols = 6, 512
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_elems, block_bytes), dtype=np.uint8)
    halves = 1 if qtype in (Q.Q4_0, Q.Q8_0) else 2  # d; d and m (Q4_1) or dmin (Q4_K)
    scales = rng.uniform(0.001, 0.01, (blocks.shape[0], halves)) * rng.choice([-1, 1], halves)
    blocks[:, : 2 * halves] = scales.astype(np.float16).view(np.uint8)
    raw = blocks.reshape(rows, -1)
    tensor = GGUFTensor("blk.0.ffn_up.weight", (rows, cols), qtype, raw.reshape(-1))
    codes, groups = block_codes(tensor), block_groups(tensor)
    assert codes.dtype == np.uint8 and codes.shape == (rows, cols)
    assert (codes.max() <= 15) == (qtype != Q.Q8_0)
    assert groups.dtype == np.float32 and groups.shape == (rows, cols // 16)
    got = codes.reshape(rows, -1, 32) * groups[:, 0::2, None] + groups[:, 1::2, None]
    np.testing.assert_array_equal(got.reshape(rows, cols), dequantize(raw, qtype))


def _mixed_q4_gguf(tmp_path) -> str:
    """A tiny llama whose projections are Q4_0 and Q4_1 (q and k rows permuted as llama.cpp
    writes them), but for layer 1's v_proj, Q8_0: its qkv_proj cannot keep 4-bit groups
    (8-bit ones on the CPU kernels)."""
    cfg = LlamaConfig(**TINY, tie_word_embeddings=True)
    qtypes = {}
    for layer in range(cfg.num_hidden_layers):
        for i, name in enumerate(("q", "k", "v", "output")):
            qtypes[f"blk.{layer}.attn_{name}.weight"] = (Q.Q4_0, Q.Q4_1)[(i + layer) % 2]
        for i, name in enumerate(("gate", "up", "down")):
            qtypes[f"blk.{layer}.ffn_{name}.weight"] = (Q.Q4_1, Q.Q4_0)[(i + layer) % 2]
    qtypes["blk.1.attn_v.weight"] = Q.Q8_0
    path = str(tmp_path / "q4.gguf")
    write_gguf(path, "llama", cfg, hf_to_gguf_tensors(tiny_hf(cfg), "llama", cfg, qtypes))
    return path


FLOAT_LINEAR = "model.layers.1.self_attn.qkv_proj"


def _linears(model) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


def _dequantized(quant: quantization.Int4Weight) -> torch.Tensor:
    """An Int4Weight off the CPU kernels (two codes a byte, float32 scales) as float32."""
    packed = quant.qweight
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)
    return rounding.dequantize_int4(codes, quant.scale, quant.min, quant.in_features, torch.float32)


def test_q4_0_and_q4_1_projections_keep_the_files_codes(tmp_path, monkeypatch):
    """Each projection whose parts are all Q4_0/Q4_1 dequantizes exactly to the float load's
    weight; with the CPU kernels it packs exactly as quantizing that float weight on the
    file's grid does (the float-then-quantize path). Off the CPU kernels the qkv_proj with a
    Q8_0 part stays float, exactly the float load's; on them it keeps 8-bit codes
    (test_q8_0_projections_keep_their_blocks)."""
    path = _mixed_q4_gguf(tmp_path)
    cfg = load_hf_config(path)
    plain = _linears(load_model(path, cfg, torch.float32, CPU))
    with_kernels = _linears(load_model(path, cfg, torch.float32, CPU, quantization="gguf"))
    monkeypatch.setattr(quantization, "CPU_KERNELS", False)
    kept = _linears(load_model(path, cfg, torch.float32, CPU, quantization="gguf"))
    assert set(kept) == set(plain) and len(kept) == 4 * cfg.num_hidden_layers
    assert kept[FLOAT_LINEAR].quant is None
    assert torch.equal(kept[FLOAT_LINEAR].weight, plain[FLOAT_LINEAR].weight)
    monkeypatch.undo()
    for name, module in kept.items():
        if name == FLOAT_LINEAR:
            continue
        assert module.weight is None, name
        assert torch.equal(_dequantized(module.quant), plain[name].weight), name
        if not quantization.CPU_KERNELS:
            continue
        # The codes recovered from the float load's weight on the kept grid, packed again.
        scale, lo = module.quant.scale, module.quant.min
        w = plain[name].weight.view(scale.shape[0], scale.shape[1], 32)
        codes = ((w - lo[..., None]) / scale[..., None]).round().view(w.shape[0], -1)
        want = quantization.Int4Weight(
            plain[name].weight, 32, grid=(scale, lo), codes=codes.to(torch.uint8)
        )
        got = with_kernels[name].quant
        assert got.cpu_kernel, name
        for key, value in want.state_dict().items():
            assert torch.equal(got.state_dict()[key], value), (name, key)


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_keeps_its_shard_of_the_codes(tmp_path, monkeypatch, size):
    """Tensor parallelism: each rank's kept projection dequantizes to its shard of the float
    load (fused parts split by rows, o and down by input features). With 4 ranks, o_proj
    holds 16 input features a rank, half a group of 32: it stays float, as that shard."""
    path = _mixed_q4_gguf(tmp_path)
    cfg = load_hf_config(path)
    monkeypatch.setattr(quantization, "CPU_KERNELS", False)
    try:
        for rank in range(size):
            set_tp(rank, size, None)
            plain = _linears(load_model(path, cfg, torch.float32, CPU))
            kept = _linears(load_model(path, cfg, torch.float32, CPU, quantization="gguf"))
            for name, module in kept.items():
                if name == FLOAT_LINEAR or (size == 4 and name.endswith("o_proj")):
                    assert module.quant is None, name
                    assert torch.equal(module.weight, plain[name].weight), name
                else:
                    assert module.weight is None, name
                    assert torch.equal(_dequantized(module.quant), plain[name].weight), name
    finally:
        set_tp(0, 1, None)


def test_q8_0_projections_keep_their_blocks(tmp_path, monkeypatch):
    """Q8_0 projections (and the Q4 + Q8_0 qkv_proj of the mixed model) keep 8-bit codes on
    the CPU kernels: their products match the float load's weights, within float32's
    rounding on octavo's kernel (bfloat16's of the activations on torch's). Off the kernels
    they load as float, exactly."""
    if not quantization.CPU_KERNELS:
        pytest.skip("this torch has no CPU int4 kernel")
    cfg = LlamaConfig(**TINY, tie_word_embeddings=True)
    qtypes = {name: Q.Q8_0 for name in _projection_names(cfg)}
    all_q8 = str(tmp_path / "q8.gguf")
    write_gguf(all_q8, "llama", cfg, hf_to_gguf_tensors(tiny_hf(cfg), "llama", cfg, qtypes))
    x = torch.randn(3, cfg.intermediate_size, generator=torch.Generator().manual_seed(0))
    for path, names in ((all_q8, None), (_mixed_q4_gguf(tmp_path), {FLOAT_LINEAR})):
        hf_config = load_hf_config(path)
        plain = _linears(load_model(path, hf_config, torch.float32, CPU))
        kept = _linears(load_model(path, hf_config, torch.float32, CPU, quantization="gguf"))
        for name in names or kept:
            module, w = kept[name], plain[name].weight
            assert isinstance(module.quant, gguf_method.Q8Weight), name
            assert module.quant.cpu_kernel and module.weight is None, name
            xi = x[:, : w.shape[1]]
            want = xi @ w.t()
            tolerance = 1e-6 if module.quant.packed is not None else 1e-2
            assert (module(xi) - want).norm() <= tolerance * want.norm(), name
    monkeypatch.setattr(quantization, "CPU_KERNELS", False)
    plain = _linears(load_model(all_q8, load_hf_config(all_q8), torch.float32, CPU))
    kept = _linears(
        load_model(all_q8, load_hf_config(all_q8), torch.float32, CPU, quantization="gguf")
    )
    for name, module in kept.items():
        assert module.quant is None and torch.equal(module.weight, plain[name].weight), name


def test_off_the_kernels_a_q8_0_part_not_its_values_sends_a_linear_to_float(tmp_path, monkeypatch):
    """Off the CPU kernels a Linear keeps its blocks only as 4-bit codes, decided by its
    tensors' types: a Q4_1 group of zeros, and one whose minimum is -128 times its scale as
    a Q8_0 group's is, still keep theirs; a Q8_0 part of zeros (codes 128) sends its Linear to
    float. Each equals the float load's weights exactly."""
    cfg = LlamaConfig(**TINY, tie_word_embeddings=True)
    hf = tiny_hf(cfg)
    with torch.no_grad():
        hf.model.layers[0].self_attn.v_proj.weight.zero_()
        up = hf.model.layers[0].mlp.up_proj.weight
        up[:, :32].zero_()
        up[:, 32:64] = (torch.arange(32) % 16 - 128) * 2.0**-10  # d = 2^-10, m = -128 d
    qtypes = {name: Q.Q4_1 for name in _projection_names(cfg)}
    qtypes["blk.0.attn_v.weight"] = Q.Q8_0
    path = str(tmp_path / "zeros.gguf")
    write_gguf(path, "llama", cfg, hf_to_gguf_tensors(hf, "llama", cfg, qtypes))
    monkeypatch.setattr(quantization, "CPU_KERNELS", False)
    hf_config = load_hf_config(path)
    plain = _linears(load_model(path, hf_config, torch.float32, CPU))
    kept = _linears(load_model(path, hf_config, torch.float32, CPU, quantization="gguf"))
    qkv, gate_up = "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"
    assert kept[qkv].quant is None and torch.equal(kept[qkv].weight, plain[qkv].weight)
    assert isinstance(kept[gate_up].quant, quantization.Int4Weight)
    assert torch.equal(_dequantized(kept[gate_up].quant), plain[gate_up].weight)


# (tied, the embedding's type, the untied head's type). Q4_K's groups are those of the
# others (test_codes_and_groups_give_the_gguf_packages_values); `gguf` cannot write it.
VOCAB_CASES = {
    "tied-Q8_0": (True, Q.Q8_0, None),
    "tied-Q4_0": (True, Q.Q4_0, None),
    "untied-Q4_1": (False, Q.Q4_1, Q.F32),
    "untied-Q8_0": (False, Q.Q8_0, Q.F32),
    "untied-Q4_0-head-Q8_0": (False, Q.Q4_0, Q.Q8_0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", VOCAB_CASES)
def test_the_token_embedding_keeps_its_blocks_unless_a_tied_head_needs_its_table(
    tmp_path, case, dtype
):
    """A Q4_0/Q4_1/Q8_0 token embedding looks its rows up from the file's codes and groups,
    exactly the float load's rows, and holds no float table; tied to an LM head that keeps
    no blocks of its own (only a Q8_0 head does), the table stays. A kept Q8_0 head holds no
    float table either."""
    tied, embedding_type, head_type = VOCAB_CASES[case]
    cfg = LlamaConfig(**TINY, tie_word_embeddings=tied)
    hidden = cfg.hidden_size
    qtypes = {"token_embd.weight": embedding_type, "output.weight": head_type}
    path = str(tmp_path / "vocab.gguf")
    write_gguf(path, "llama", cfg, hf_to_gguf_tensors(tiny_hf(cfg), "llama", cfg, qtypes))
    hf_config = load_hf_config(path)
    plain = load_model(path, hf_config, dtype, CPU)
    kept = load_model(path, hf_config, dtype, CPU, quantization="gguf")
    ids = torch.tensor([0, 5, cfg.vocab_size - 1, 5, 64])
    embedding, head = kept.model.embed_tokens, kept.lm_head
    assert torch.equal(embedding(ids), plain.model.embed_tokens(ids))
    assert embedding(ids[:0]).shape == (0, hidden)
    head_keeps = (embedding_type if tied else head_type) == Q.Q8_0
    keeps_rows = not tied or head_keeps
    assert (embedding.kept_rows is not None) == keeps_rows
    assert embedding.weight.numel() == (0 if keeps_rows else cfg.vocab_size * hidden)
    assert (head.quant is not None) == head_keeps
    assert head.weight.numel() == (0 if head_keeps else cfg.vocab_size * hidden)
    assert (head.weight is embedding.weight) == tied


def _projection_names(cfg) -> list[str]:
    names = []
    for layer in range(cfg.num_hidden_layers):
        names += [f"blk.{layer}.attn_{n}.weight" for n in ("q", "k", "v", "output")]
        names += [f"blk.{layer}.ffn_{n}.weight" for n in ("gate", "up", "down")]
    return names
