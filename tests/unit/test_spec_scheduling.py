"""Speculative decoding without a model: the n-gram proposer, the scheduler's verify steps
(slots for the guesses, limits, taking back the rejected), the runner's verification rule
and the options."""

from __future__ import annotations

import pytest
from test_scheduler import make, req

from octavo.config import SpeculativeConfig
from octavo.engine.speculative import NgramProposer, Speculator
from octavo.runner.outputs import ModelRunnerOutput, _keep_verified


def test_ngram_takes_the_longest_suffix_match_and_its_latest_occurrence():
    proposer = NgramProposer(min_n=2, max_n=3)
    # "1 2 3" occurs at 0 and 5; the latest earlier occurrence (5) is followed by 9 9.
    tokens = [1, 2, 3, 4, 4, 1, 2, 3, 9, 9, 7, 1, 2, 3]
    assert proposer.lookup(tokens, 4) == [9, 9, 7, 1]
    # only a 2-gram matches: "5 3" at 0 -> 8
    assert proposer.lookup([5, 3, 8, 0, 6, 5, 3], 2) == [8, 0]
    assert proposer.lookup([1, 2, 3, 4, 5], 3) == []  # nothing repeats
    assert proposer.lookup([1, 1], 3) == []  # too short for a 2-gram before the suffix
    assert proposer.lookup([7, 7, 7], 3) == [7]  # the match may run into the suffix


def test_a_verify_step_computes_the_guesses_and_takes_back_the_rejected():
    s = make(max_tokens_step=32)
    r = req("a", 6)
    s.add_request(r)
    out = s.schedule()
    s.update(out, {"a": [50]})  # prefill, first output
    r.spec_token_ids = [51, 52, 53]
    out = s.schedule()
    (item,) = out.scheduled
    assert (item.token_ids, item.spec_token_ids, item.num_new_tokens) == ([50], [51, 52, 53], 4)
    assert r.num_computed_tokens == 10 and r.spec_token_ids == []
    # the model agreed with 51, then sampled 60 in 52's place
    assert s.update(out, {"a": [51, 60]}) == [r]
    assert r.output_token_ids == [50, 51] and r.held_token_ids == [60]
    assert r.num_computed_tokens == 8  # 6 prompt + 50 + 51; 60 is computed next step


def test_guesses_stop_at_max_tokens_the_context_and_the_budget():
    s = make(max_tokens_step=32, max_model_len=16)
    a, b = req("a", 6, max_tokens=4), req("b", 10, start=300)
    for r in (a, b):
        s.add_request(r)
    out = s.schedule()
    s.update(out, {"a": [1], "b": [2]})
    a.spec_token_ids = b.spec_token_ids = [5, 5, 5, 5, 5]
    out = s.schedule()
    guesses = {x.request_id: len(x.spec_token_ids) for x in out.scheduled}
    # a: 1 output, 4 allowed -> the step may emit 3 -> 2 guesses; b: 11 tokens of 16 -> 4
    assert guesses == {"a": 2, "b": 4}
    s = make(max_tokens_step=3)
    r = req("c", 2)
    s.add_request(r)
    s.update(s.schedule(), {"c": [1]})
    r.spec_token_ids = [5, 5, 5, 5]
    (item,) = s.schedule().scheduled
    assert len(item.spec_token_ids) == 2  # 3 tokens of budget: the last known and 2 guesses


def test_guesses_wait_for_a_prompt_to_finish_and_fall_back_when_blocks_run_out():
    s = make(max_tokens_step=4)
    r = req("a", 10)
    s.add_request(r)
    r.spec_token_ids = [1, 2]  # a prompt chunk that does not sample verifies nothing
    (item,) = s.schedule().scheduled
    assert (item.spec_token_ids, item.sample) == ([], False)
    s = make(num_blocks=2, max_tokens_step=32)  # 8 slots
    r = req("b", 7)
    s.add_request(r)
    s.update(s.schedule(), {"b": [1]})
    r.spec_token_ids = [2, 3, 4]
    (item,) = s.schedule().scheduled
    assert item.spec_token_ids == [] and item.num_new_tokens == 1  # no block for them


def test_a_prefix_block_is_cached_only_once_its_tokens_are_known():
    s = make(max_tokens_step=32)
    r = req("a", 3)
    s.add_request(r)
    s.update(s.schedule(), {"a": [1]})  # 4 tokens: block 0 full of known tokens
    r.spec_token_ids = [2, 3, 4, 5]
    out = s.schedule()  # computes positions 3..7, only 4 of them known
    assert s.kv._num_cached_blocks["a"] == 1
    s.update(out, {"a": [9]})  # every guess rejected
    assert r.num_computed_tokens == 4 and s.kv._num_cached_blocks["a"] == 1


def _output(tokens, logprobs=None):
    result = ModelRunnerOutput({"a": list(tokens)})
    if logprobs is not None:
        result.logprobs["a"] = list(logprobs)
    return result


@pytest.mark.parametrize(
    ("sampled", "kept"),
    [
        ([4, 5, 6, 7], [4, 5, 6, 7]),  # every guess held: the last sample follows them
        ([4, 5, 9, 7], [4, 5, 9]),  # the third row disagreed: its sample replaces the guess
        ([8, 5, 6, 7], [8]),
    ],
)
def test_the_samples_are_kept_up_to_the_first_that_differs_from_its_guess(sampled, kept):
    result = _output(sampled, logprobs=[[(t, -1.0, 1)] for t in sampled])
    _keep_verified(result, "a", [4, 5, 6])
    assert result.sampled_token_ids["a"] == kept
    assert [e[0][0] for e in result.logprobs["a"]] == kept


def test_speculator_asks_for_decoding_requests_only_and_backs_off():
    class Fixed:
        def __init__(self):
            self.asked = []

        def propose(self, requests, k):
            self.asked.append([r.request_id for r in requests])
            return [[9] * (k + 2) for _ in requests]

    proposer = Fixed()
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=2), proposer)
    s = make()
    a, b = req("a", 4), req("b", 40, start=300)
    for r in (a, b):
        s.add_request(r)
    s.update(s.schedule(), {"a": [1]})  # b's prompt takes two steps
    assert speculator.active(s)
    speculator.propose(s.running)
    assert proposer.asked == [["a"]] and a.spec_token_ids == [9, 9]  # at most k
    out = s.schedule()
    speculator.record(out, s.requests_of(out), ModelRunnerOutput({"a": [3], "b": [4]}))
    assert speculator.stats.as_dict()["spec_draft_tokens"] == 2
    s.update(out, {"a": [3], "b": [4]})
    assert speculator.active(s)  # a's guesses all failed: it sits out one step
    speculator.propose(s.running)
    assert proposer.asked[-1] == ["b"]
    assert speculator.active(s)
    speculator.propose(s.running)
    assert proposer.asked[-1] == ["a", "b"]


def test_requests_that_find_nothing_sit_out_and_a_step_of_them_does_not_speculate():
    """Lookups that find nothing back off as failed guesses do (1, 2, 3 ... steps), and a
    step in which every running request sits out is not a speculating one."""

    class Nothing:
        def __init__(self):
            self.asked = 0

        def propose(self, requests, k):
            self.asked += 1
            return [[] for _ in requests]

    proposer = Nothing()
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=2), proposer)
    s = make()
    a = req("a", 4)
    s.add_request(a)
    s.update(s.schedule(), {"a": [1]})
    pattern = []
    for _ in range(9):
        active = speculator.active(s)
        if active:
            speculator.propose(s.running)
        pattern.append(active)
        s.update(s.schedule(), {"a": [2]})
    # asked, sit 1, asked, sit 2, asked, sit 3 ...
    assert pattern == [True, False, True, False, False, True, False, False, False]
    assert proposer.asked == 3


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"method": "medusa"}', "method must be one of"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be a positive"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min=5 exceeds"),
        ('{"lookahead": 3}', r"unknown field\(s\) \['lookahead'\]"),
        ("{not json", "not valid JSON"),
        ("[4]", "must be a dict"),
        ('{"method": "draft_model"}', 'needs a "model"'),
    ],
)
def test_bad_speculative_configs_are_value_errors(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_guesses_never_take_the_budget_of_other_requests_decode():
    s = make(max_tokens_step=6, max_model_len=64)
    requests = [req(rid, 3, start=100 * i) for i, rid in enumerate("abcd", start=1)]
    for r in requests:
        s.add_request(r)
    for _ in range(2):  # prefill in two steps of 6 tokens
        out = s.schedule()
        s.update(out, {x.request_id: [1] for x in out.scheduled if x.sample})
    for r in requests:
        r.spec_token_ids = [5, 5, 5]
    out = s.schedule()
    # 6 tokens for 4 decodes: 2 to spare, both for a's guesses; everyone decodes
    assert {x.request_id: len(x.spec_token_ids) for x in out.scheduled} == {
        "a": 2,
        "b": 0,
        "c": 0,
        "d": 0,
    }
