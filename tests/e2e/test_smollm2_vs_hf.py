"""The embedded SmolLM2-135M-Instruct GGUF gives HF transformers' greedy tokens, token for
token, with HF loading (and dequantizing) the same GGUF file itself.

HF scores the engine's tokens in one forward pass per prompt rather than generating its own
one step at a time: the same check (HF's argmax after every prefix must be the engine's next
token), without HF's per-step overhead on the CPU."""

from __future__ import annotations

import pytest
from model_utils import eos_ids, hf_greedy_choices

from octavo import SamplingParams

NUM_TOKENS = 32


@pytest.mark.slow  # loads HF's model; tests/unit compares the model itself with HF
def test_greedy_tokens_match_hf_on_chat_prompts(llm, hf_model, chat_prompt_ids):
    assert len(chat_prompt_ids) >= 8
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompt_ids], params, use_tqdm=False)
    for ids, out in zip(chat_prompt_ids, outs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == NUM_TOKENS
        # min_tokens bans EOS for every token here, as HF's min_new_tokens would.
        assert tokens == hf_greedy_choices(hf_model, ids, tokens, eos_ids(hf_model))
