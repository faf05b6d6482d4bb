"""Helpers for the tests that share the session's engines (tests/e2e/conftest.py)."""

from __future__ import annotations

from contextlib import contextmanager

from octavo import SamplingParams

# The tests' KV cache budget, for engines not sized by num_kv_blocks: it holds the model's whole
# context (8192 tokens), so max_model_len is the model's as with the CPU's default of 1 GiB, and
# each of the session's engines holds far less memory.
KV_CACHE_MEMORY = 384 << 20

# The greedy run that engine configurations are compared on: long enough for 14 KV blocks to
# run out under the eight chat prompts, so that requests are preempted and recomputed.
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts_of(ids_list):
    return [{"prompt_token_ids": ids} for ids in ids_list]


@contextmanager
def scheduling(llm, overlap: bool):
    """Switches an idle engine between async and synchronous stepping: the engine reads the
    flag at each step, so a shared engine serves both (a new engine costs a model load and a
    KV cache)."""
    engine = llm.engine
    assert not engine.has_unfinished_requests(), "switch an idle engine only"
    before, engine.async_scheduling = engine.async_scheduling, overlap
    try:
        yield llm
    finally:
        engine.async_scheduling = before
