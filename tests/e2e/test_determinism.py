"""A request's tokens and log-probs do not depend on what runs beside it, on the CPU by default:
alone or in a batch, preempted or not, its prompt prefilled whole or in chunks, its prefix
computed or found in the cache; on the default path (the embedded GGUF kept quantized) and in
float32. And the default path answers as the float32 path does."""

from __future__ import annotations

import random

import pytest
from conftest import CHAT_PROMPTS
from engine_utils import prompts_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octavo import BeamSearchParams, SamplingParams

MORE_PROMPTS = [
    "Name a famous painting.",
    "What colour is the sky on a clear day?",
    "Suggest a title for a mystery novel.",
    "Why do leaves change colour in autumn?",
    "What is the boiling point of water?",
    "Describe a cat in five words.",
    "How many legs does a spider have?",
    "Recommend a board game for four players.",
]
PATHS = {"gguf": "auto", "float32": None}  # the default path, and quantization="none"


def greedy(max_tokens: int, logprobs: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def results(outputs) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    """Each completion's tokens and every log-prob it reported, as exact floats."""
    return [
        (c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs])
        for o in outputs
        for c in o.outputs
    ]


@pytest.fixture(scope="module")
def prompt_ids(llm):
    from octavo.tokenizer.tokenizer import apply_chat_template

    tok = llm.get_tokenizer()
    chats = CHAT_PROMPTS + MORE_PROMPTS
    return [apply_chat_template(tok, [{"role": "user", "content": p}]) for p in chats]


def alone(llm, prompts, params) -> list:
    return [results(llm.generate(prompts_of([p]), params, use_tqdm=False))[0] for p in prompts]


def _check_table(llm_factory, prompts, quantization, max_tokens, kv_blocks=10):
    """The issue's table: alone, in one batch, preempted (a cache of `kv_blocks` blocks), in
    32-token prefill chunks and from the prefix cache, each bitwise the same."""
    params = greedy(max_tokens)
    llm = llm_factory(quantization=quantization, enable_prefix_caching=False)
    want = alone(llm, prompts, params)
    assert results(llm.generate(prompts_of(prompts), params, use_tqdm=False)) == want

    small = llm_factory(
        quantization=quantization, num_kv_blocks=kv_blocks, enable_prefix_caching=False
    )
    before = small.get_stats()["num_preemptions"]
    assert results(small.generate(prompts_of(prompts), params, use_tqdm=False)) == want
    assert small.get_stats()["num_preemptions"] > before

    chunked = llm_factory(quantization=quantization, max_num_batched_tokens=32)
    assert results(chunked.generate(prompts_of(prompts), params, use_tqdm=False)) == want
    hits = chunked.get_stats()["prefix_cache_hits"]
    assert results(chunked.generate(prompts_of(prompts), params, use_tqdm=False)) == want
    assert chunked.get_stats()["prefix_cache_hits"] > hits


@pytest.mark.parametrize("path", PATHS)
def test_batch_preemption_chunks_and_prefix_hits_change_nothing(llm_factory, prompt_ids, path):
    _check_table(llm_factory, prompt_ids[:6], PATHS[path], 12)


def test_default_path_answers_as_float32(llm_factory, prompt_ids):
    """Greedy tokens of the default path equal float32's on 16 questions, or part where
    float32's two best tokens are within 1e-3 nats (a tie no float rounding can settle)."""
    quantized = llm_factory(quantization="auto")
    plain = llm_factory(quantization=None)
    got = results(quantized.generate(prompts_of(prompt_ids), greedy(32), use_tqdm=False))
    want = results(plain.generate(prompts_of(prompt_ids), greedy(32, 2), use_tqdm=False))
    for (tokens, _), (float_tokens, float_logprobs) in zip(got, want, strict=True):
        if tokens == float_tokens:
            continue
        first = next(i for i, (a, b) in enumerate(zip(tokens, float_tokens)) if a != b)
        best = sorted((lp for _, lp in float_logprobs[first]), reverse=True)
        assert best[0] - best[1] < 1e-3, (first, tokens, float_tokens)


def test_the_readme_chat_command_answers_paris(llm_factory):
    llm = llm_factory(quantization="auto")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_seeded_parallel_samples_are_the_same_alone_and_in_a_batch(llm_factory, prompt_ids):
    """n = 3 samples with a seed, alone and beside other requests: the same tokens and
    log-probs (the sampler draws from each request's own generator)."""
    llm = llm_factory(quantization="auto")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=3, max_tokens=10, logprobs=1)
    want = results(llm.generate(prompts_of(prompt_ids[:1]), params, use_tqdm=False))
    others = [SamplingParams(temperature=0.7, seed=i, max_tokens=6 + i) for i in range(4)]
    outs = llm.generate(prompts_of(prompt_ids[:5]), [params, *others], use_tqdm=False)
    assert results(outs[:1]) == want


def test_beam_search_is_the_same_alone_and_in_a_batch(llm_factory, prompt_ids):
    llm = llm_factory(quantization="auto")
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    want = llm.beam_search([{"prompt_token_ids": prompt_ids[0]}], params)[0]
    both = llm.beam_search([{"prompt_token_ids": p} for p in prompt_ids[:3]], params)[0]
    assert [(s.tokens, s.cum_logprob) for s in both.sequences] == [
        (s.tokens, s.cum_logprob) for s in want.sequences
    ]


@pytest.mark.slow  # an engine per drawn configuration (each kept for the session)
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(sorted(PATHS)),
    chunk=st.sampled_from([16, 48, 8192]),
    blocks=st.sampled_from([12, 24, None]),
    others=st.lists(st.tuples(st.integers(1, 80), st.integers(1, 14)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_a_request_is_the_same_whatever_runs_beside_it(
    llm_factory, prompt_ids, path, chunk, blocks, others, seed
):
    """One request among random others (random token prompts of 1-80 tokens, 1-14 new tokens
    each, in a random order) under a drawn prefill chunk and KV budget: its tokens and
    log-probs equal its run alone on an ample engine."""
    rng = random.Random(seed)
    target = rng.choice(prompt_ids)
    params = greedy(10)
    want = alone(llm_factory(quantization=PATHS[path]), [target], params)[0]
    options = {"quantization": PATHS[path], "max_num_batched_tokens": max(chunk, 64)}
    if chunk < 64:
        options["max_num_batched_tokens"] = chunk
    if blocks is not None:
        options["num_kv_blocks"] = blocks
    llm = llm_factory(**options)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n, _ in others]
    batch = [*prompts_of(prompts), {"prompt_token_ids": target}]
    sampling = [greedy(m) for _, m in others] + [params]
    order = list(range(len(batch)))
    rng.shuffle(order)
    outs = llm.generate([batch[i] for i in order], [sampling[i] for i in order], use_tqdm=False)
    assert results([outs[order.index(len(batch) - 1)]]) == [want]


def test_stats_say_what_the_forward_computes_in(llm_factory):
    default = llm_factory(quantization="auto").get_stats()
    assert (default["compute_dtype"], default["batch_invariant"]) == ("float32", True)
    fp8_kv = llm_factory(kv_cache_dtype="fp8").get_stats()  # torch's attention reads it
    assert (fp8_kv["compute_dtype"], fp8_kv["batch_invariant"]) == ("float32", False)
