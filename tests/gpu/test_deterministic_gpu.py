"""deterministic=True on the GPU: one request's tokens and log-probs are the same bits alone,
in batches of 1..255 other random requests, with its prompt in small chunks, behind a prefix
hit, and through preemptions; seeded sampling too. Dummy Qwen3-0.6B weights (the bundled
config). Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TOKENS = 48


def _llm(**options):
    from octavo import LLM

    base = {"load_format": "dummy", "max_model_len": 2048, "gpu_memory_utilization": 0.25,
            "deterministic": True}  # fmt: skip
    return LLM("qwen3-0.6b", **(base | options))


def _others(count: int, seed: int, longest: int = 700) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(1, 150000) for _ in range(rng.randint(5, longest))]}
        for _ in range(count)
    ]


def _run(llm, target, batch: list[dict], params, at: int = 0):
    """The target's (token ids, log-probs of each token) with `batch` around it."""
    from octavo import SamplingParams

    prompts = batch[:at] + [target] + batch[at:]
    rng = random.Random(len(batch))
    others = [SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(1, 64),
                             ignore_eos=True) for _ in batch]  # fmt: skip
    outs = llm.generate(prompts, others[:at] + [params] + others[at:], use_tqdm=False)
    out = outs[at].outputs[0]
    return out.token_ids, [[(t, lp.logprob) for t, lp in sorted(d.items())] for d in out.logprobs]


@pytest.fixture(scope="module")
def target():
    rng = random.Random(1)
    # Past the shortest span (runner/deterministic.MIN_SPLIT): its decode steps merge spans.
    return {"prompt_token_ids": [rng.randrange(1, 150000) for _ in range(600)]}


@pytest.fixture(scope="module")
def llm():
    engine = _llm()
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("seeded", [False, True])
def test_a_request_is_the_same_bits_in_any_batch(llm, target, seeded):
    from octavo import SamplingParams

    params = SamplingParams(temperature=1.0 if seeded else 0.0, seed=7 if seeded else None,
                            max_tokens=TOKENS, ignore_eos=True, logprobs=3)  # fmt: skip
    alone = _run(llm, target, [], params)
    for size in [1, 7, 31, 100, 255]:
        got = _run(llm, target, _others(size, size), params, at=size // 2)
        assert got == alone, size
    assert llm.get_stats()["batch_invariant"] is True


def test_a_prefix_hit_gives_the_same_bits(llm, target):
    from octavo import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=3)
    first = _run(llm, target, [], params)
    hits = llm.get_stats()["prefix_cache_hits"]
    again = _run(llm, target, _others(3, 99), params)
    assert llm.get_stats()["prefix_cache_hits"] > hits
    assert again == first


def test_chunks_and_preemption_give_the_same_bits(llm, target):
    from octavo import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=3)
    reference = _run(llm, target, [], params)
    chunked = _llm(max_num_batched_tokens=64, enable_prefix_caching=False, num_kv_blocks=1024)
    assert _run(chunked, target, _others(5, 5), params, at=2) == reference
    chunked.shutdown()
    # 80 blocks of 16: the batch cannot all fit, so the newest are preempted and recomputed.
    small = _llm(num_kv_blocks=80, enable_prefix_caching=False, max_model_len=1024)
    assert _run(small, target, _others(12, 12, longest=300), params, at=6) == reference
    assert small.get_stats()["num_preemptions"] > 0
    small.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_give_a_request_the_same_bits_in_any_batch(target):
    from octavo import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=3)
    llm = _llm(tensor_parallel_size=2, enable_prefix_caching=False)
    try:
        alone = _run(llm, target, [], params)
        for size in [1, 31, 255]:
            assert _run(llm, target, _others(size, size), params, at=size // 3) == alone, size
    finally:
        llm.shutdown()
