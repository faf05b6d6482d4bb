"""Gemma 2 and Gemma 3 from GGUF files written as llama.cpp's converter writes them (norm
weights stored as 1 + w, Gemma's norm names, sliding layers every other one / all but every
sixth, the local rope base 10,000, the soft caps in the metadata): the logits and greedy
tokens of the HF model they were written from."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from model_utils import TINY, PagedRunner, eos_ids, hf_greedy, hf_logits, rel_err
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

from octavo.checkpoint.hf_config import load_hf_config
from octavo.checkpoint.loader import load_model

CPU = torch.device("cpu")
LAYERS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
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
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(GLOBAL_BASE)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(WINDOW)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for name, w in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        data = w.float().numpy().copy()
        if name.endswith("norm.weight"):  # the converter's + 1
            data = data + np.float32(1.0)
        writer.add_tensor(_gguf_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
