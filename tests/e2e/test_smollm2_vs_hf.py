"""The embedded SmolLM2-135M-Instruct GGUF gives HF transformers' greedy tokens, token for
token, with HF loading (and dequantizing) the same GGUF file itself."""

from __future__ import annotations

import pytest
import torch

from octavo import SamplingParams

NUM_TOKENS = 32


@pytest.mark.slow  # HF's generate on the CPU; tests/unit compares the model itself with HF
def test_greedy_tokens_match_hf_on_chat_prompts(llm, hf_model, chat_prompt_ids):
    assert len(chat_prompt_ids) >= 8
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompt_ids], params, use_tqdm=False)
    for ids, out in zip(chat_prompt_ids, outs, strict=True):
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NUM_TOKENS,
                min_new_tokens=NUM_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist()
