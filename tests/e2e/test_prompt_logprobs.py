"""SamplingParams.prompt_logprobs on the embedded model: the log-prob of each prompt token
as HF transformers computes it from the same GGUF file, and the same whether the prompt is
prefilled whole or in chunks, found in the prefix cache, preempted, or asked for with n > 1
and as deltas."""

from __future__ import annotations

import pytest
import torch
from engine_utils import scheduling

from octavo import SamplingParams
from octavo.sampling_params import RequestOutputKind

K = 3
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=K)


def prompts_of(ids_list):
    return [{"prompt_token_ids": ids} for ids in ids_list]


def flat(prompt_logprobs) -> list[tuple[int, int, float]]:
    """(token, rank, log-prob) of every entry, position by position."""
    return [
        (t, lp.rank, lp.logprob) for entry in prompt_logprobs[1:] for t, lp in sorted(entry.items())
    ]


def assert_same(a, b) -> None:
    """Same tokens; log-probs, and so ranks, equal up to float32 batch effects (a rank in
    the thousands may move by a few near-tied tokens)."""
    assert [t for t, *_ in flat(a)] == [t for t, *_ in flat(b)]
    assert [v for *_, v in flat(a)] == pytest.approx([v for *_, v in flat(b)], abs=1e-4)
    for (_, ra, _), (_, rb, _) in zip(flat(a), flat(b), strict=True):
        assert abs(ra - rb) <= max(2, ra // 100), (ra, rb)


@pytest.fixture(scope="module")
def reference(llm_factory, chat_prompt_ids):
    """Prompt log-probs with no prefix caching, ample KV cache and no chunking."""
    llm = llm_factory(enable_prefix_caching=False)
    return [o.prompt_logprobs for o in llm.generate(prompts_of(chat_prompt_ids), PARAMS,
                                                    use_tqdm=False)]  # fmt: skip


@pytest.mark.slow  # loads HF's model; the tests below compare the engine with itself
def test_prompt_logprobs_match_hf(reference, hf_model, chat_prompt_ids, llm):
    tok = llm.get_tokenizer()
    for ids, found in zip(chat_prompt_ids[:4], reference, strict=False):
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [P, V]
        assert len(found) == len(ids) and found[0] is None
        for position in range(1, len(ids)):
            entry, row, token = found[position], ref[position - 1], ids[position]
            assert len(entry) in (K, K + 1) and token in entry
            for t, lp in entry.items():
                assert lp.logprob == pytest.approx(row[t].item(), abs=1e-3)
                assert lp.decoded_token == tok.decode([t])
            value = row[token].item()  # its rank, allowing for near ties
            lo, hi = (int((row > value + d).sum()) + 1 for d in (1e-3, -1e-3))
            assert lo <= entry[token].rank <= hi
            best = next(t for t, lp in entry.items() if lp.rank == 1)
            first, second = row.topk(2).values.tolist()
            assert best == row.argmax().item() or first - second < 1e-3


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"max_num_batched_tokens": 7, "enable_prefix_caching": False},
                     id="chunked", marks=pytest.mark.slow),
        pytest.param({"num_kv_blocks": 14, "enable_prefix_caching": False},
                     id="preempted", marks=pytest.mark.slow),
        pytest.param({}, id="prefix-cached"),
    ],
)  # fmt: skip
def test_chunks_preemption_and_prefix_cache_do_not_change_them(
    llm_factory, chat_prompt_ids, reference, options
):
    llm = llm_factory(**options)
    before = llm.get_stats()
    if not options:  # the prompts in the prefix cache
        llm.generate(prompts_of(chat_prompt_ids), SamplingParams(max_tokens=1), use_tqdm=False)
    params = PARAMS.clone()
    if "num_kv_blocks" in options:
        params.max_tokens = 16  # enough for 14 blocks to run out, and preempt recomputed prompts
    outs = llm.generate(prompts_of(chat_prompt_ids), params, use_tqdm=False)
    for out, ref in zip(outs, reference, strict=True):
        assert_same(out.prompt_logprobs, ref)
    stats = llm.get_stats()
    if "num_kv_blocks" in options:
        assert stats["num_preemptions"] > before["num_preemptions"]
    if not options:  # the prompts were cached, and were not read from the cache
        assert stats["prefix_cache_hits"] > before["prefix_cache_hits"]
        assert all(o.num_cached_tokens == 0 for o in outs)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_n_gt_1_and_deltas_carry_them_once(llm, chat_prompt_ids, reference):
    params = SamplingParams(n=2, temperature=1, seed=0, max_tokens=4, prompt_logprobs=K)
    (whole,) = llm.generate(prompts_of(chat_prompt_ids[:1]), params, use_tqdm=False)
    assert len(whole.outputs) == 2
    assert_same(whole.prompt_logprobs, reference[0])

    params.output_kind = RequestOutputKind.DELTA
    engine = llm.engine
    engine.add_request(chat_prompt_ids[0], params, request_id="delta")
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(deltas) > 1 and carrying == deltas[:1]
    assert_same(carrying[0].prompt_logprobs, reference[0])


def test_without_prompt_logprobs_there_are_none(llm, chat_prompt_ids):
    (out,) = llm.generate(prompts_of(chat_prompt_ids[:1]), SamplingParams(max_tokens=2),
                          use_tqdm=False)  # fmt: skip
    assert out.prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_are_value_errors(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_an_aborted_requests_scores_never_reach_a_request_that_reuses_its_id(llm):
    """With async scheduling the aborted request's prefill is still in flight when a new
    request takes its id: the new one gets its own prompt's log-probs only."""
    engine = llm.engine
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0)
    with scheduling(llm, True):
        engine.add_request(list(range(100, 140)), params, "r")
        engine.step()
        engine.abort_request("r")
        engine.add_request([500, 501, 502, 503, 504, 505], params, "r")
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
    (final,) = [o for o in outputs if o.finished]
    assert len(final.prompt_logprobs) == 6
    assert [next(iter(entry)) for entry in final.prompt_logprobs[1:]] == [501, 502, 503, 504, 505]
    assert not engine.outputs._prompt_logprobs and not engine.outputs._groups
