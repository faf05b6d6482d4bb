"""On the GPU, Gemma 3, Gemma 2 and Mistral with random weights: the sampled tokens' log-probs
are within bf16 tolerance of HF transformers' float32 ones (test_e2e_gpu's rule), over
prompts and outputs longer than the sliding window, through CUDA graphs; Gemma's sliding
layers keep their blocks in a pool of their own. Run through the device tool; skipped without
CUDA."""

from __future__ import annotations

import random

import pytest
import torch
from test_e2e_gpu import assert_logprobs_match_hf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

WINDOW, NUM_TOKENS = 64, 48
SHAPE = {
    "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
    "max_position_embeddings": 2048, "sliding_window": WINDOW,
}  # fmt: skip


def _config(arch: str):
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig

    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if arch == "gemma3":
        kinds = ["sliding_attention"] * 3 + ["full_attention"]
        return Gemma3TextConfig(**SHAPE, **ids, query_pre_attn_scalar=128, layer_types=kinds)
    if arch == "gemma2":
        return Gemma2Config(**SHAPE, **ids, query_pre_attn_scalar=128,
                            attn_logit_softcapping=50.0, final_logit_softcapping=30.0)  # fmt: skip
    return MistralConfig(**SHAPE, **ids)


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "mistral"])
def test_sliding_window_families_log_probs_match_hf(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from octavo import LLM, SamplingParams

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2 if "embed" in name else 0.02)
    model.save_pretrained(tmp_path)
    rng = random.Random(1)
    prompts = [[rng.randint(3, 4000) for _ in range(rng.randint(20, 300))] for _ in range(8)]
    llm = LLM(str(tmp_path), max_model_len=1024, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.get_stats()
    assert llm.engine.runner.graph_runner is not None
    if arch != "mistral":  # full and sliding layers: two pools, the sliding one smaller
        assert 0 < stats["kv_sliding_blocks_total"] < stats["kv_blocks_total"]
    del llm
    torch.cuda.empty_cache()
    assert_logprobs_match_hf(str(tmp_path), prompts, [o.outputs[0] for o in outs])
