"""A random Qwen3-MoE (a dense layer among sparse ones, top-4 of 16 experts, renormalized) on
the GPU: the fused kernels inside CUDA graphs give log-probs within bf16 tolerance of HF
transformers' float32 ones, and a load histogram that counts each real token's k experts
once. (Graph against eager is checked bit for bit per layer in test_fused_moe.py; end to end
a step's row count picks the kernels' path and tiles, and a routing decision that flips on
a rounding moves the log-probs further than a dense model's near ties.) Skipped without
CUDA."""

from __future__ import annotations

import random

import pytest
import torch
from test_e2e_gpu import NUM_TOKENS, assert_logprobs_match_hf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=256, mlp_only_layers=[0],
        norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2 if "embed" in name or "lm_head" in name else 0.04)
    path = tmp_path_factory.mktemp("qwen3-moe")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randint(0, 4000) for _ in range(rng.randint(10, 200))] for _ in range(12)]


def _run(moe_dir, prompts, **options):
    from octavo import LLM, SamplingParams

    llm = LLM(moe_dir, max_model_len=1024, **options)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.get_stats()
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0] for o in outs], stats


def test_moe_logprobs_match_hf_in_graphs(moe_dir, prompts):
    outs, stats = _run(moe_dir, prompts)
    assert_logprobs_match_hf(moe_dir, prompts, outs)
    # Every real token (prompts, and each generated one but the last; at most one more step
    # a request) is routed to 4 experts in each of the 3 sparse layers. Padding rows of the
    # graphs (12 requests run in a batch of 16) would add 4 rows a step.
    tokens = sum(len(p) + NUM_TOKENS - 1 for p in prompts)
    routed = sum(stats["moe_expert_tokens"])
    assert tokens * 12 <= routed <= (tokens + len(prompts)) * 12, (routed, tokens * 12)
