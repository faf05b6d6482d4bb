"""GGUF weights: the embedded SmolLM2 matches HF loading the same file; synthetic GGUF files
written with llama.cpp's conventions (permuted q/k, quantized tensors, reversed shapes)
come back as the original HF weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from model_utils import PagedRunner, eos_ids, hf_greedy_choices, hf_logits, rel_err
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from octavo.checkpoint.gguf import iter_gguf_weights, unpermute_qk
from octavo.checkpoint.hf_config import load_hf_config
from octavo.checkpoint.loader import load_model
from octavo.model.config import get_head_dim
from octavo.quant import rounding

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
# SmolLM2's chat template around "What is the capital of France?" / "Write a haiku about the sea."
_SYSTEM = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018]
_SYSTEM += [411, 407, 19712, 8182, 2, 198, 1, 4093, 198]
_ASSISTANT = [2, 198, 1, 520, 9531, 198]
CHAT_PROMPTS = [
    _SYSTEM + [1780, 314, 260, 3575, 282, 4649, 47] + _ASSISTANT,
    _SYSTEM + [19161, 253, 421, 30614, 563, 260, 3426, 30] + _ASSISTANT,
]


# The real model against HF's own GGUF reader: HF's load takes ~13 s on 2 cores, so these
# run in the full suite; the tiny models of test_models_vs_hf check the same paths quickly.
@pytest.fixture(scope="module")
def smollm2(smollm2_path, hf_smollm2):
    """(HF model from the GGUF (the session's), octavo model from the GGUF, octavo's config)."""
    cfg = load_hf_config(smollm2_path)
    return hf_smollm2, load_model(smollm2_path, cfg, torch.float32, CPU), cfg


@pytest.mark.slow
def test_smollm2_config_from_gguf_metadata(smollm2):
    _, _, cfg = smollm2
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.tie_word_embeddings  # the file has no output.weight
    assert (cfg.num_hidden_layers, cfg.hidden_size, get_head_dim(cfg)) == (30, 576, 64)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.vocab_size) == (1, 2, 49152)


@pytest.mark.slow
def test_smollm2_logits_match_hf_from_the_same_gguf(smollm2):
    hf, ours, cfg = smollm2
    outs = PagedRunner(ours, cfg, num_blocks=16, block_size=16).step(list(enumerate(CHAT_PROMPTS)))
    for ids, logits in zip(CHAT_PROMPTS, outs, strict=True):
        assert rel_err(logits, hf_logits(hf, ids)) < 1e-4


@pytest.mark.slow
def test_smollm2_greedy_tokens_match_hf(smollm2):
    hf, ours, cfg = smollm2
    runner = PagedRunner(ours, cfg, num_blocks=16, block_size=16)
    for seq_id, ids in enumerate(CHAT_PROMPTS):
        tokens = runner.greedy(seq_id, ids, 16, eos_ids(hf))
        assert tokens == hf_greedy_choices(hf, ids, tokens, eos_ids(hf))


# --- synthetic GGUF files, written the way llama.cpp's converter writes them ---------------

TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
}
_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permutation of llama q/k rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
    base = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, kind = hf_name.rsplit(".", 1)
    return f"{base[module]}.{kind}"


def write_gguf(
    path, arch: str, cfg, tensors: dict[str, tuple[np.ndarray, Q]], extra=None,
    rope_base: float = 10000.0,
) -> None:  # fmt: skip
    """Writes GGUF metadata for `cfg` and `tensors` (GGUF name -> (float data, type));
    `extra(writer)` adds an architecture's own keys."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(get_head_dim(cfg))
    writer.add_value_length(get_head_dim(cfg))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if extra is not None:
        extra(writer)
    for name, (data, qtype) in tensors.items():
        if qtype == Q.F32:
            writer.add_tensor(name, data)
        elif data.dtype == np.uint8:  # packed already (a type gguf cannot quantize)
            writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_to_gguf_tensors(hf, arch: str, cfg, qtypes: dict[str, Q] | None = None) -> dict:
    """HF state dict -> GGUF tensors as llama.cpp converts them (permuted llama q/k)."""
    out = {}
    for name, w in hf.state_dict().items():
        data = w.float().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        out[gguf_name(name)] = (data, (qtypes or {}).get(gguf_name(name), Q.F32))
    return out


def tiny_hf(config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p)
            )
    return model.eval()


HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SYNTHETIC = {
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=False),
}


@pytest.mark.parametrize("arch", list(SYNTHETIC))
def test_synthetic_gguf_model_matches_its_hf_original(arch, tmp_path):
    """Names, reversed shapes, q/k un-permutation (llama only), tying and config metadata,
    end to end: octavo on the GGUF gives the logits of the HF model it was written from."""
    hf_cfg = SYNTHETIC[arch]()
    hf = tiny_hf(hf_cfg)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, hf_cfg, hf_to_gguf_tensors(hf, arch, hf_cfg))
    cfg = load_hf_config(str(path))
    assert cfg.architectures == [HF_ARCH[arch]]
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert get_head_dim(cfg) == get_head_dim(hf_cfg)
    ours = load_model(str(path), cfg, torch.float32, CPU)
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    (logits,) = PagedRunner(ours, cfg).step([(0, ids)])
    assert rel_err(logits, hf_logits(hf, ids)) < 1e-4


def test_rope_freqs_tensor_applies_llama3_scaling(tmp_path):
    """llama.cpp stores Llama 3.1 rope scaling as a `rope_freqs` tensor of per-frequency
    divisors, not as metadata; octavo on such a GGUF matches HF's llama3-scaled model."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    scaling |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf_cfg = LlamaConfig(**TINY, rope_scaling=scaling, tie_word_embeddings=True)
    hf = tiny_hf(hf_cfg)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    tensors = hf_to_gguf_tensors(hf, "llama", hf_cfg)
    tensors["rope_freqs.weight"] = ((plain / scaled).numpy().astype(np.float32), Q.F32)
    path = tmp_path / "llama3.gguf"
    write_gguf(path, "llama", hf_cfg, tensors)
    cfg = load_hf_config(str(path))
    ours = load_model(str(path), cfg, torch.float32, CPU)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    (logits,) = PagedRunner(ours, cfg).step([(0, ids)])
    assert rel_err(logits, hf_logits(hf, ids)) < 1e-4


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((4 * 16, 8)).astype(np.float32)
    permuted = llama_cpp_permute(w, 4)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_qk(permuted, 4), w)
    bias = w[:, 0].copy()
    assert np.array_equal(unpermute_qk(llama_cpp_permute(bias, 4), 4), bias)


# Upper bounds on ||dequant - original|| / ||original|| for N(0, 1)-like weights.
QUANT_TOL = {
    "blk.0.attn_q.weight": (Q.Q8_0, 0.01),
    "blk.0.attn_k.weight": (Q.Q4_0, 0.15),
    "blk.0.ffn_gate.weight": (Q.Q4_1, 0.12),
    "blk.0.ffn_up.weight": (Q.Q5_0, 0.08),
    "blk.0.ffn_down.weight": (Q.Q5_1, 0.06),
    "blk.1.attn_q.weight": (Q.BF16, 0.005),
    "blk.1.attn_k.weight": (Q.F16, 0.001),
    "token_embd.weight": (Q.Q8_0, 0.01),
}


def test_quantized_tensors_dequantize_to_the_original_hf_weights(tmp_path):
    """Each quant type comes back within its tolerance, in HF layout (q/k un-permuted after
    dequantizing: a wrong order would be off by ~140%, far above any tolerance)."""
    hf_cfg = SYNTHETIC["llama"]()
    hf = tiny_hf(hf_cfg)
    qtypes = {name: qtype for name, (qtype, _) in QUANT_TOL.items()}
    path = tmp_path / "quant.gguf"
    write_gguf(path, "llama", hf_cfg, hf_to_gguf_tensors(hf, "llama", hf_cfg, qtypes))
    loaded = dict(iter_gguf_weights(str(path), load_hf_config(str(path))))
    assert set(loaded) == set(hf.state_dict()) - {"lm_head.weight"}  # tied: no output.weight
    original = {gguf_name(k): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    hf_names = {gguf_name(k): k for k in loaded}
    for gname, ref in original.items():
        got = loaded[hf_names[gname]]
        assert got.dtype == torch.float32 and got.shape == ref.shape, gname
        tol = QUANT_TOL.get(gname, (Q.F32, 0.0))[1]
        assert rel_err(got, ref) <= tol, gname


def _k_quant_rows(qtype: Q, num_rows: int, blocks_per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """Hand-built Q4_K / Q6_K rows whose values are a known constant per row.

    Q4_K block: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles;
    all scales 1, mins 0, nibbles 3 -> every value is 3 * d.
    Q6_K block: 128 bytes low bits, 64 high bits, 16 int8 scales, d (f16);
    all quants 0 (i.e. -32), scales 1 -> every value is -32 * d.
    """
    rows, expected = [], []
    for r in range(num_rows):
        d = np.frombuffer(np.float16(r + 1).tobytes(), np.uint8)
        if qtype == Q.Q4_K:
            block = np.zeros(144, np.uint8)
            block[0:2], block[4:8], block[12:16], block[16:] = d, 1, 1, 0x33
            expected.append(3.0 * (r + 1))
        else:
            block = np.zeros(210, np.uint8)
            block[192:208], block[208:210] = 1, d
            expected.append(-32.0 * (r + 1))
        rows.append(np.tile(block, blocks_per_row))
    values = np.repeat(np.array(expected, np.float32)[:, None], 256 * blocks_per_row, axis=1)
    return np.stack(rows), values


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quant_tensors_dequantize_in_hf_shape(qtype, tmp_path):
    raw, expected = _k_quant_rows(qtype, num_rows=3, blocks_per_row=2)  # HF shape [3, 512]
    path = tmp_path / "kquant.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = Qwen3Config(**TINY)
    ((name, weight),) = list(iter_gguf_weights(str(path), cfg))
    assert name == "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(weight, torch.from_numpy(expected))


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Q4_K blocks [rows, cols / 256 * 144] of random codes: d and dmin (float16), twelve bytes
    of 6-bit scales and minimums (any byte values encode some), 128 bytes of nibbles."""
    blocks = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    d_dmin = rng.uniform(0.0005, 0.004, (blocks.shape[0], 2)).astype(np.float16)
    blocks[:, :4] = d_dmin.view(np.uint8)
    return blocks.reshape(rows, -1)


def test_q4_k_tensors_keep_their_groups_with_quantization_gguf(tmp_path, monkeypatch):
    """A llama whose projections are Q4_K: with quantization="gguf" each holds int4 codes on
    the file's own scales and minimums per 32 columns, which dequantize (float32 scales, as off
    the CPU kernels) to exactly the weights the float load reads through the gguf package; with
    the CPU kernels its logits follow the float model's (bfloat16 activations)."""
    from octavo.model.layers import Linear
    from octavo.quant import weights as quantization

    cfg = LlamaConfig(
        **(TINY | {"hidden_size": 256, "intermediate_size": 512}), tie_word_embeddings=True
    )
    tensors = hf_to_gguf_tensors(tiny_hf(cfg), "llama", cfg)
    rng = np.random.default_rng(0)
    for name, (data, _) in list(tensors.items()):
        if name.startswith("blk.") and data.ndim == 2:
            tensors[name] = (random_q4_k(*data.shape, rng), Q.Q4_K)
    path = str(tmp_path / "q4k.gguf")
    write_gguf(path, "llama", cfg, tensors)
    cfg = load_hf_config(path)
    plain = load_model(path, cfg, torch.float32, CPU)
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    (want,) = PagedRunner(plain, cfg).step([(0, ids)])
    (got,) = PagedRunner(load_model(path, cfg, torch.float32, CPU, quantization="gguf"), cfg).step(
        [(0, ids)]
    )
    assert rel_err(got, want) < 0.02
    monkeypatch.setattr(quantization, "CPU_KERNELS", False)
    kept = load_model(path, cfg, torch.float32, CPU, quantization="gguf")
    weights = dict(plain.named_modules())
    linears = [(n, m) for n, m in kept.named_modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * cfg.num_hidden_layers
    for name, module in linears:
        quant = module.quant
        assert module.weight is None and isinstance(quant, quantization.Int4Weight), name
        codes = torch.stack([quant.qweight & 0xF, quant.qweight >> 4], dim=-1)
        back = rounding.dequantize_int4(
            codes.view(quant.qweight.shape[0], -1), quant.scale, quant.min, quant.in_features,
            torch.float32,
        )  # fmt: skip
        assert torch.equal(back, weights[name].weight), name


def test_unknown_gguf_tensor_raises(tmp_path):
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.mystery.weight", np.zeros((2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        list(iter_gguf_weights(str(path), LlamaConfig(**TINY)))
