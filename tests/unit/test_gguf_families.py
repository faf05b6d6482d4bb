"""Gemma 2, Gemma 3 and Phi-3 from GGUF files written as llama.cpp's converter writes them
(Gemma: norm weights stored as 1 + w, its norm names, sliding layers every other one / all
but every sixth, the local rope base 10,000, the soft caps in the metadata; Phi-3: fused
projections, longrope's factor tensors): the logits and greedy tokens of the HF model they
were written from."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from model_utils import TINY, PagedRunner, eos_ids, hf_greedy, hf_logits, random_hf_model, rel_err
from test_gguf_loader import _HF_TO_GGUF as HF_TO_GGUF
from test_gguf_loader import write_gguf
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

from octavo.checkpoint.hf_config import load_hf_config
from octavo.checkpoint.loader import load_model

CPU = torch.device("cpu")
# Gemma's norms around both sub-blocks, by llama.cpp's names.
LAYERS = HF_TO_GGUF | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
WINDOW, GLOBAL_BASE = 6, 1e6
CONFIGS = {
    # llama.cpp's layout: layer 5 of 6 full, the rest sliding (base 10,000); full layers at
    # the file's rope base; query scale 1 / sqrt(head_dim)
    "gemma3": lambda: Gemma3TextConfig(
        **(TINY | {"num_hidden_layers": 6}), head_dim=24, query_pre_attn_scalar=24,
        sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": GLOBAL_BASE},
        },
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
    "gemma2": lambda: Gemma2Config(
        **TINY, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, rope_theta=GLOBAL_BASE,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{LAYERS[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight"}[hf_name]  # fmt: skip


def _write(path, arch: str, hf, cfg) -> None:
    def gemma_keys(writer: gguf.GGUFWriter) -> None:
        writer.add_sliding_window(WINDOW)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)

    tensors = {}
    for name, w in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        data = w.float().numpy().copy()
        if name.endswith("norm.weight"):  # the converter's + 1
            data = data + np.float32(1.0)
        tensors[_gguf_name(name)] = (data, gguf.GGMLQuantizationType.F32)
    write_gguf(path, arch, cfg, tensors, gemma_keys, rope_base=GLOBAL_BASE)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_gemma_gguf_gives_the_logits_and_tokens_of_its_hf_original(arch, tmp_path):
    torch.manual_seed(0)
    cfg = CONFIGS[arch]()
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((0.2 if "norm" in name else 0.15) * torch.randn(p.shape, generator=gen))
    hf.eval()
    path = tmp_path / f"{arch}.gguf"
    _write(path, arch, hf, cfg)
    ours_cfg = load_hf_config(str(path))
    assert ours_cfg.architectures == [type(hf).__name__]
    ours = load_model(str(path), ours_cfg, torch.float32, CPU)
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    (logits,) = PagedRunner(ours, ours_cfg).step([(0, ids)])
    assert rel_err(logits, hf_logits(hf, ids)) < 1e-4  # a prompt past the window
    prompt = ids[:9]
    assert PagedRunner(ours, ours_cfg).greedy(0, prompt, 10, eos_ids(hf)) == hf_greedy(
        hf, prompt, 10
    )


def test_phi3_gguf_with_longrope_gives_the_logits_of_its_hf_original(tmp_path):
    """Phi-3 as llama.cpp's converter writes it: q/k/v fused in `attn_qkv`, gate and up in
    `ffn_up`, longrope's factors as `rope_factors_long` / `rope_factors_short` tensors."""
    from transformers import Phi3Config

    rope = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.3 * i for i in range(8)]}  # fmt: skip
    cfg = Phi3Config(**TINY, original_max_position_embeddings=16, rope_scaling=rope,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    hf = random_hf_model(cfg, seed=2)
    names = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # fmt: skip

    def longrope(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        writer.add_rope_scaling_orig_ctx_len(16)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))

    base = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    tensors = {}
    for name, w in hf.state_dict().items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{layer}.{names[module]}.{kind}"
        else:
            name = base[name]
        tensors[name] = (w.float().numpy().copy(), gguf.GGMLQuantizationType.F32)
    path = tmp_path / "phi3.gguf"
    write_gguf(path, "phi3", cfg, tensors, longrope)  # fmt: skip
    ours_cfg = load_hf_config(str(path))
    assert ours_cfg.architectures == ["Phi3ForCausalLM"]
    ours = load_model(str(path), ours_cfg, torch.float32, CPU)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    (logits,) = PagedRunner(ours, ours_cfg).step([(0, ids)])
    assert rel_err(logits, hf_logits(hf, ids)) < 1e-4  # within the original 16: short factors
