"""SamplingParams(n=k) on the embedded model: k seeded completions that are reproducible and
differ, sharing the prompt's full KV blocks instead of holding k copies of them."""

from __future__ import annotations

import pytest

from octavo import SamplingParams

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def llm_no_prefix_cache(llm_factory):
    # Without the prefix cache, separate requests for one prompt cannot share its blocks, so
    # any saving below comes from n > 1 sharing alone.
    return llm_factory(enable_prefix_caching=False)


def peak_blocks(llm, prompts, params) -> tuple[int, list]:
    """Peak KV blocks in use while `prompts` run on an idle engine, and the outputs."""
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_total_blocks, "the engine must be idle"
    kv.sharing.peak_blocks_used = 0  # a high-water mark: reset it while nothing is in use
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert kv.num_free_blocks == kv.num_total_blocks, "blocks leaked"
    return kv.sharing.peak_blocks_used, outs


@pytest.mark.slow
def test_n4_outputs_are_seeded_reproducible_and_different(llm, chat_prompt_ids):
    params = SamplingParams(n=4, temperature=0.8, seed=7, max_tokens=8)
    prompt = {"prompt_token_ids": chat_prompt_ids[1]}
    (first,) = llm.generate(prompt, params, use_tqdm=False)
    (again,) = llm.generate(prompt, params, use_tqdm=False)
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    (other_seed,) = llm.generate(prompt, SamplingParams(n=4, temperature=0.8, seed=8,
                                                        max_tokens=8), use_tqdm=False)  # fmt: skip
    assert [c.token_ids for c in other_seed.outputs] != [c.token_ids for c in first.outputs]


@pytest.mark.slow
def test_sample_i_of_a_seeded_n_request_is_the_n1_request_with_seed_plus_i(llm, chat_prompt_ids):
    """vLLM's rule: completion i of n draws with seed + i, so n = 3 with seed 5 gives what
    three n = 1 requests with seeds 5, 6 and 7 give."""
    prompt = {"prompt_token_ids": chat_prompt_ids[1]}
    kwargs = {"temperature": 0.9, "max_tokens": 12, "ignore_eos": True}
    (n3,) = llm.generate(prompt, SamplingParams(n=3, seed=5, **kwargs), use_tqdm=False)
    singles = llm.generate(
        [prompt] * 3, [SamplingParams(seed=s, **kwargs) for s in (5, 6, 7)], use_tqdm=False
    )
    assert [c.token_ids for c in n3.outputs] == [o.outputs[0].token_ids for o in singles]
    assert len({tuple(c.token_ids) for c in n3.outputs}) > 1


@pytest.mark.slow
def test_n4_uses_three_prompt_copies_fewer_blocks(llm_no_prefix_cache, chat_prompt_ids):
    llm = llm_no_prefix_cache
    prompt_ids = chat_prompt_ids[2]
    full_prompt_blocks = len(prompt_ids) // BLOCK_SIZE
    assert full_prompt_blocks >= 1
    stats_before = llm.get_stats()
    shared, (out,) = peak_blocks(
        llm,
        {"prompt_token_ids": prompt_ids},
        SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=12, ignore_eos=True),
    )
    separate, outs = peak_blocks(
        llm,
        [{"prompt_token_ids": prompt_ids}] * 4,
        [SamplingParams(temperature=0.8, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)],
    )
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 12 for c in out.outputs)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert separate - shared >= 3 * full_prompt_blocks, (separate, shared, full_prompt_blocks)
    # The partial last prompt block was shared too, and copied once per writer but the last.
    stats = llm.get_stats()
    if len(prompt_ids) % BLOCK_SIZE:
        assert stats["num_cow_copies"] - stats_before["num_cow_copies"] == 3


@pytest.mark.slow  # an engine of its own
def test_n_above_max_num_seqs_gives_every_completion(llm, llm_factory, chat_prompt_ids):
    """n = 4 with max_num_seqs = 2: the four samples take turns in the steps (no step has
    more sequences than the input buffers hold) and come out as with room for all four."""
    prompt = {"prompt_token_ids": chat_prompt_ids[1]}
    params = SamplingParams(n=4, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    narrow = llm_factory(max_num_seqs=2)
    (out,) = narrow.generate(prompt, params, use_tqdm=False)
    (wide,) = llm.generate(prompt, params, use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [8] * 4
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in wide.outputs]
    kv = narrow.engine.kv
    assert kv.num_free_blocks == kv.num_total_blocks
