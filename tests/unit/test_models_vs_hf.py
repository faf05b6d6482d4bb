"""octavo's Llama / Qwen2 / Qwen3 / Mistral / Phi-3 / Gemma 2 / Gemma 3 give HF transformers'
logits and greedy tokens.

Tiny random HF models are saved as safetensors, loaded by octavo's loader and run over the
paged KV cache: whole prompts, mixed batches, chunked prefill and decode must all agree with
HF's full-sequence logits in float32.
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_utils import TINY, PagedRunner, eos_ids, hf_greedy, hf_logits, randomize, rel_err
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from octavo.checkpoint.hf_config import load_hf_config
from octavo.checkpoint.loader import load_model
from octavo.model.config import get_rope_scaling
from octavo.model.gemma import GemmaRMSNorm

TOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # wavelengths of head_dim 16 at theta 1e4 span 6..~6e3: all three bands are present.
    "original_max_position_embeddings": 16,
}
PHI3_ROPE = {
    "type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.3 * i for i in range(8)],
}
CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "llama3_rope": lambda: LlamaConfig(**TINY, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=True),
    # a window shorter than most of the tests' contexts
    "mistral": lambda: MistralConfig(**TINY, head_dim=None, sliding_window=11),
    # fused qkv / gate_up tensors; longrope (every position below the original 128: short
    # factors, and the attention factor of 256 / 128)
    "phi3": lambda: Phi3Config(
        **TINY,
        original_max_position_embeddings=128,
        rope_scaling=PHI3_ROPE,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # three layers: sliding, sliding, full, with rope bases 1e4 and 1e6 (linear scaling on
    # the full layer)
    "gemma3": lambda: Gemma3TextConfig(
        **(TINY | {"num_hidden_layers": 3}), head_dim=24, query_pre_attn_scalar=32,
        sliding_window=7, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        },
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
    "gemma2": lambda: Gemma2Config(
        **TINY, head_dim=16, query_pre_attn_scalar=24, sliding_window=9,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip


def _build(arch: str, path) -> tuple:
    """(HF model, octavo model loaded from HF's safetensors in `path`, octavo's config)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(
        CONFIGS[arch](), attn_implementation="eager", dtype=torch.float32
    )
    randomize(hf, seed=1)
    hf.eval()
    hf.save_pretrained(path)
    cfg = load_hf_config(str(path))
    return hf, load_model(str(path), cfg, torch.float32, torch.device("cpu")), cfg


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(HF model, octavo model, config) for one tiny architecture."""
    return _build(request.param, tmp_path_factory.mktemp(request.param))


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_single_prompt_prefill_matches_hf(pair):
    hf, ours, cfg = pair
    ids = _prompt(0, 20)
    (logits,) = PagedRunner(ours, cfg).step([(0, ids)])
    assert rel_err(logits, hf_logits(hf, ids)) < TOL


def test_flat_batch_of_different_lengths_matches_hf(pair):
    hf, ours, cfg = pair
    prompts = [_prompt(i, n) for i, n in enumerate([7, 1, 13, 20])]
    outs = PagedRunner(ours, cfg).step(list(enumerate(prompts)))
    for ids, logits in zip(prompts, outs, strict=True):
        assert rel_err(logits, hf_logits(hf, ids)) < TOL


def test_chunked_prefill_then_decode_matches_hf(pair):
    """Prefix in the cache, then the rest (batched with another sequence's decode), then
    token-by-token decode: every position equals HF's full-sequence logits."""
    hf, ours, cfg = pair
    ids, other = _prompt(3, 26), _prompt(4, 5)
    runner = PagedRunner(ours, cfg)
    first, other_prefill = runner.step([(0, ids[:9]), (1, other)])
    second, other_decode = runner.step([(0, ids[9:20]), (1, [7])])
    pieces = [first, second]
    for pos in range(20, 26):
        pieces += runner.step([(0, [ids[pos]])])
    ref = hf_logits(hf, ids)
    assert rel_err(torch.cat(pieces), ref) < TOL
    assert rel_err(torch.cat([other_prefill, other_decode]), hf_logits(hf, other + [7])) < TOL


def test_greedy_tokens_match_hf_generate(pair):
    hf, ours, cfg = pair
    ids = _prompt(5, 12)
    assert PagedRunner(ours, cfg).greedy(0, ids, 10, eos_ids(hf)) == hf_greedy(hf, ids, 10)


def test_attention_reads_the_models_own_rope_and_norms(pair):
    """Each Attention layer holds the rotary embedding and q/k norms of its block by
    reference: their parameters keep HF's names (`self_attn.q_norm.weight`), so the loader
    fills the very tensors attention reads, and the layer registers no parameter of its own."""
    hf, ours, _ = pair
    hf_params = dict(hf.named_parameters())
    for i, block in enumerate(ours.model.layers):
        attn = block.self_attn
        assert list(attn.attn.named_parameters()) == []
        assert attn.attn.spec.rotary_emb is attn.rotary_emb
        assert attn.attn.spec.q_norm is attn.q_norm and attn.attn.spec.k_norm is attn.k_norm
        if attn.q_norm is not None:
            for name in ("q_norm", "k_norm"):
                want = hf_params[f"model.layers.{i}.self_attn.{name}.weight"]
                norm = getattr(attn, name)
                if isinstance(norm, GemmaRMSNorm):  # holds 1 + w
                    want = want + 1.0
                assert torch.equal(norm.weight, want)
    assert not any(".attn." in name for name, _ in ours.named_parameters())


def test_llama3_rope_scaling_changes_the_result(tmp_path):
    """Guards the llama3 case itself: with plain rope, the logits would not match."""
    hf, _, cfg = _build("llama3_rope", tmp_path)
    assert get_rope_scaling(cfg)["rope_type"] == "llama3"
    plain = copy.deepcopy(cfg)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    unscaled = load_model(str(tmp_path), plain, torch.float32, torch.device("cpu"))
    ids = _prompt(6, 20)
    (logits,) = PagedRunner(unscaled, plain).step([(0, ids)])
    assert rel_err(logits, hf_logits(hf, ids)) > 1e-2


def test_dummy_weights_are_finite_and_seeded(tmp_path):
    cfg = Qwen3Config(**TINY, head_dim=24, architectures=["Qwen3ForCausalLM"])
    ids = _prompt(7, 10)

    def run(seed: int) -> torch.Tensor:
        model = load_model(str(tmp_path), cfg, torch.float32, torch.device("cpu"), "dummy", seed)
        return PagedRunner(model, cfg).step([(0, ids)])[0]

    a, b, c = run(0), run(0), run(1)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_missing_and_unknown_weights_raise(pair, tmp_path):
    hf, _, cfg = pair
    hf.save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    state = load_file(file)
    name = "model.layers.1.mlp.up_proj.weight"
    if name not in state:  # stored fused (Phi-3)
        name = "model.layers.1.mlp.gate_up_proj.weight"
    save_file({k: v for k, v in state.items() if k != name}, file)
    with pytest.raises(ValueError, match="model.layers.1.mlp.gate_up_proj.weight"):
        load_model(str(tmp_path), cfg, torch.float32, torch.device("cpu"))
    save_file({**state, "model.layers.0.mystery.weight": torch.zeros(2)}, file)
    with pytest.raises(ValueError, match="mystery"):
        load_model(str(tmp_path), cfg, torch.float32, torch.device("cpu"))


def test_unsupported_architecture_and_missing_path_raise(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_config(str(tmp_path / "nope"))
    cfg = LlamaConfig(**TINY)
    cfg.architectures = ["MysteryForCausalLM"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="MysteryForCausalLM"):
        load_hf_config(str(tmp_path))


def test_an_engine_past_the_sliding_window_gives_hfs_tokens(tmp_path):
    """Mistral 7B v0.1's layout, a window of 16: prompts longer than it, prefilled in chunks
    of 8 tokens and decoded past it, give HF's greedy tokens, while the blocks before the
    window go back to the pool."""
    from octavo import LLM, SamplingParams

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(
        MistralConfig(**TINY, head_dim=None, sliding_window=16), attn_implementation="eager"
    )
    randomize(hf, seed=3)
    hf.eval().save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", num_kv_blocks=256, quantization=None,
              max_num_batched_tokens=8, block_size=4)  # fmt: skip
    assert llm.engine.scheduler_config.max_model_len == 256
    prompts = [_prompt(11, 30), _prompt(12, 9)]
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 20)
    # Blocks wholly before the window went back as the requests advanced: at most
    # 16 / 4 + 2 each, where the whole 50 and 29 tokens would take 13 + 8.
    stats = llm.get_stats()
    assert stats["kv_blocks_peak_used"] <= 2 * (16 // 4 + 2)
    assert stats["kv_blocks_out_of_window"] == 0 and stats["kv_blocks_free"] == 256


def test_gemma_norms_hold_one_plus_w_in_float32_in_a_bfloat16_model(tmp_path):
    """1 + w in float32, as HF computes it: in bfloat16 1 + 0.01 would round to 1.0078."""
    hf, _, cfg = _build("gemma3", tmp_path)
    model = load_model(str(tmp_path), cfg, torch.bfloat16, torch.device("cpu"))
    layer, hf_layer = model.model.layers[0], hf.model.layers[0]
    for name in ("input_layernorm", "post_feedforward_layernorm"):
        ours, theirs = getattr(layer, name).weight, getattr(hf_layer, name).weight
        assert ours.dtype == torch.float32
        assert torch.equal(ours, 1 + theirs)  # the checkpoint's w, float32 here
    q_norm = layer.self_attn.q_norm.weight
    assert q_norm.dtype == torch.float32
    assert torch.equal(q_norm, 1 + hf_layer.self_attn.q_norm.weight)
