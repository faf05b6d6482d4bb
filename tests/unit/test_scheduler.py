"""Scheduler: budgets, chunking, mixing decode with prefill, preemption order, stops."""

from __future__ import annotations

import functools

import pytest

from octavo.config import SchedulerConfig
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.request import Request, RequestStatus
from octavo.core.scheduler import Scheduler
from octavo.core.stop import StopChecker
from octavo.sampling_params import SamplingParams, StructuredOutputsParams

BS = 4
EOS = 0


def make(num_blocks=64, max_num_seqs=8, max_tokens_step=32, max_model_len=64, caching=True):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    cfg = SchedulerConfig(max_num_seqs, max_tokens_step, max_model_len)
    return Scheduler(cfg, kv, eos_token_ids=[EOS])


def req(rid: str, n: int, start: int = 100, **params) -> Request:
    params.setdefault("max_tokens", 50)
    return Request(rid, list(range(start, start + n)), SamplingParams(**params))


def update(s: Scheduler, out, tokens: dict[str, list[int]]):
    """Appends a step's tokens and finishes the requests they stop, as the engine does."""
    updated = s.update(out, tokens)
    for request, status in zip(updated, s.stops.check_tokens(updated), strict=True):
        if status is not None:
            s.finish_request(request.request_id, status)
    return updated


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    update(s, out, {x.request_id: [token] for x in out.scheduled if x.sample})
    return out


def shape(out):
    return [
        (x.request_id, x.num_computed_tokens, x.num_new_tokens, x.sample) for x in out.scheduled
    ]


def test_token_budget_chunks_the_last_prompt():
    s = make(max_tokens_step=32)
    for rid, n in [("a", 10), ("b", 20), ("c", 30)]:
        s.add_request(req(rid, n, start=100 * (ord(rid) - 96)))
    out = step(s)
    assert shape(out) == [("a", 0, 10, True), ("b", 0, 20, True), ("c", 0, 2, False)]
    # Next steps mix two decodes with c's prompt, in chunks of half the budget beside them.
    out = step(s)
    assert shape(out) == [("a", 10, 1, True), ("b", 20, 1, True), ("c", 2, 16, False)]
    out = step(s)
    assert shape(out) == [("a", 11, 1, True), ("b", 21, 1, True), ("c", 18, 12, True)]
    assert s.requests["c"].output_token_ids == [7]


def test_a_long_prefill_leaves_half_the_budget_to_waiting_requests():
    """A running prompt takes the whole budget alone, half of it beside another request: the
    newcomer runs in the next step and in every step after, not after the whole prompt."""
    s = make(max_tokens_step=32, max_model_len=128)
    s.add_request(req("long", 100))
    assert shape(step(s)) == [("long", 0, 32, False)]
    s.add_request(req("short", 3, start=500))
    assert shape(step(s)) == [("long", 32, 16, False), ("short", 0, 3, True)]
    assert shape(step(s)) == [("long", 48, 16, False), ("short", 3, 1, True)]


def test_max_num_seqs_limits_admission():
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 3, start=10 * ord(rid)))
    out = step(s)
    assert [x.request_id for x in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_block_tables_cover_the_scheduled_tokens():
    s = make()
    s.add_request(req("a", 9))
    out = s.schedule()
    first = out.scheduled[0]
    assert first.block_ids_start == 0 and len(first.new_block_ids) == 3  # ceil(9 / 4)
    assert len(set(first.new_block_ids)) == 3
    update(s, out, {"a": [7]})
    # Decode into the third block: no change to send. The 13th token needs a fourth.
    for _ in range(3):
        item = step(s).scheduled[0]
        assert (item.block_ids_start, item.new_block_ids) == (3, [])
    item = step(s).scheduled[0]
    assert item.block_ids_start == 3 and len(item.new_block_ids) == 1
    assert s.kv.get_block_ids("a") == first.new_block_ids + item.new_block_ids


def test_preemption_takes_the_newest_and_requeues_it_first():
    # 6 blocks of 4 tokens; three requests of 8 tokens use 2 blocks each, so the first
    # decode step needs a 3rd block for each and somebody must go.
    s = make(num_blocks=6)
    for rid in "abc":
        s.add_request(req(rid, 8, start=10 * ord(rid)))
    step(s)
    assert s.kv.num_free_blocks == 0
    out = step(s)
    assert out.preempted_request_ids == ["c"]
    assert [x.request_id for x in out.scheduled] == ["a", "b"]
    c = s.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert list(s.waiting) == [c]
    assert c.output_token_ids == [7]  # generated tokens survive; they are recomputed later
    assert s.num_preemptions == 1


def test_preempted_request_resumes_with_prompt_and_outputs():
    s = make(num_blocks=6, caching=False)
    for rid in "abc":
        s.add_request(req(rid, 8, start=10 * ord(rid), max_tokens=2))
    step(s)
    step(s)  # c preempted; a and b finish (max_tokens=2)
    assert set(s.requests) == {"c"}
    out = step(s)
    assert shape(out) == [("c", 0, 9, True)]  # 8 prompt tokens + 1 generated, recomputed
    assert s.requests == {}  # second token reached max_tokens


def test_waiting_requests_are_not_admitted_in_a_step_that_preempted():
    s = make(num_blocks=6)
    for rid in "abc":
        s.add_request(req(rid, 8, start=10 * ord(rid)))
    step(s)
    s.add_request(req("d", 1, start=500))
    out = step(s)
    assert out.preempted_request_ids and "d" not in [x.request_id for x in out.scheduled]


def test_prefix_hit_skips_cached_tokens():
    s = make()
    s.add_request(req("a", 10, start=100))
    step(s)
    s.add_request(req("b", 10, start=100))  # same prompt: 2 full blocks cached
    out = s.schedule()
    b = [x for x in out.scheduled if x.request_id == "b"][0]
    assert (b.num_computed_tokens, b.num_new_tokens) == (8, 2)
    assert s.requests["b"].num_cached_tokens == 8


def test_abort_frees_blocks_and_drops_request():
    s = make(num_blocks=16, caching=False)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10, start=300))
    step(s)
    free_before = s.kv.num_free_blocks
    s.abort_requests(["a", "missing"])
    assert s.kv.num_free_blocks == free_before + 3
    assert "a" not in s.requests
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["b"]
    assert out.finished_request_ids == ["a"]


def test_abort_of_waiting_request():
    s = make()
    s.add_request(req("a", 5))
    s.abort_requests(["a"])
    assert not s.waiting and not s.has_unfinished_requests()


@pytest.mark.parametrize(
    "params, tokens, expected_len, status",
    [
        ({"max_tokens": 3}, [5, 6, 7, 8], 3, RequestStatus.FINISHED_LENGTH),
        ({}, [5, EOS, 6], 2, RequestStatus.FINISHED_STOPPED),
        (
            {"ignore_eos": True, "max_tokens": 3},
            [EOS, EOS, EOS, EOS],
            3,
            RequestStatus.FINISHED_LENGTH,
        ),
        ({"stop_token_ids": [9]}, [5, 9, 6], 2, RequestStatus.FINISHED_STOPPED),
        ({"min_tokens": 3}, [EOS, EOS, EOS, EOS], 3, RequestStatus.FINISHED_STOPPED),
    ],
)
def test_token_stop_rules(params, tokens, expected_len, status):
    s = make()
    r = req("a", 4, **params)
    s.add_request(r)
    for t in tokens:
        if r.is_finished:
            break
        step(s, token=t)
    assert r.num_output_tokens == expected_len
    assert r.status == status


def test_max_model_len_stops_generation():
    s = make(max_model_len=12)
    r = req("a", 10, max_tokens=100)
    s.add_request(r)
    for _ in range(5):
        step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 12


def test_duplicate_request_id_rejected():
    s = make()
    s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(req("a", 3))


# ---- async scheduling: the next step is scheduled before the last one's tokens arrive ----


def test_async_step_takes_the_pending_token_as_input():
    s = make()
    s.add_request(req("a", 6))
    first = s.schedule()  # prefill, samples token 6
    assert shape(first) == [("a", 0, 6, True)]
    second = s.schedule()  # scheduled before first's token is on the host
    (item,) = second.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.sample) == (6, 1, True)
    assert item.input_is_pending and item.token_ids == []
    update(s, first, {"a": [7]})
    update(s, second, {"a": [8]})
    request = s.requests["a"]
    assert request.output_token_ids == [7, 8]
    assert (request.num_computed_tokens, request.num_pending_tokens) == (7, 0)
    third = s.schedule()  # in sync again: the input is known
    assert third.scheduled[0].token_ids == [8] and not third.scheduled[0].input_is_pending


def test_async_does_not_schedule_a_request_its_pending_token_finishes():
    s = make()
    s.add_request(req("a", 5, max_tokens=2))
    first = s.schedule()
    second = s.schedule()
    assert [x.request_id for x in second.scheduled] == ["a"]  # its 2nd token: not known done
    assert s.schedule().is_empty  # the 2nd token, in flight, is its last
    update(s, first, {"a": [7]})
    update(s, second, {"a": [8]})
    assert s.requests.get("a") is None and s.kv.num_free_blocks == 64


def test_async_preempted_request_keeps_its_pending_token():
    # 4 blocks of 4: a and b fill them; b is preempted when a needs a block.
    s = make(num_blocks=4)
    s.add_request(req("a", 8, start=100))
    s.add_request(req("b", 7, start=200))
    first = s.schedule()
    assert [x.request_id for x in first.scheduled] == ["a", "b"]
    second = s.schedule()  # a's 9th token needs a third block: b (newest) is preempted
    assert second.preempted_request_ids == ["b"]
    assert [x.request_id for x in second.scheduled] == ["a"]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_pending_tokens == 1
    third = s.schedule()  # b may not come back while its token is in flight
    assert [x.request_id for x in third.scheduled] == ["a"]
    update(s, first, {"a": [7], "b": [9]})
    assert b.output_token_ids == [9] and b.num_pending_tokens == 0
    update(s, second, {"a": [8]})
    update(s, third, {"a": [10]})
    assert s.requests["a"].output_token_ids == [7, 8, 10]
    assert b.all_token_ids == list(range(200, 207)) + [9] and b.num_computed_tokens == 0


def test_async_aborted_request_drops_its_in_flight_token():
    s = make()
    s.add_request(req("a", 6))
    s.add_request(req("b", 6, start=200))
    first = s.schedule()
    s.abort_requests(["a"])
    update(s, first, {"a": [7], "b": [8]})
    assert "a" not in s.requests and s.requests["b"].output_token_ids == [8]


def test_needs_pending_tokens_for_forks_and_penalties():
    s = make()
    s.add_request(Request("a", list(range(6)), SamplingParams(n=2, temperature=1.0)))
    s.schedule()
    assert s.needs_pending_tokens()  # the fork happens when the first tokens arrive
    s2 = make()
    s2.add_request(req("b", 6, presence_penalty=1.0))
    s2.schedule()
    assert s2.needs_pending_tokens()
    s3 = make()
    s3.add_request(req("c", 6, temperature=0.7, seed=3, logprobs=2))
    s3.schedule()
    assert not s3.needs_pending_tokens()


@pytest.mark.parametrize(("penalty", "readers"), [(0.0, set()), (1.0, {"a", "a#1"})])
def test_forked_samples_are_asked_for_pending_tokens_only_if_they_read_them(penalty, readers):
    """After the fork every sample has n = 1: only penalties keep them (parent included)
    among the requests whose pending tokens the scheduler must wait for."""
    s = make()
    params = SamplingParams(n=2, temperature=1.0, presence_penalty=penalty, max_tokens=9)
    s.add_request(Request("a", list(range(6)), params))
    out = s.schedule()
    update(s, out, {"a": [7, 8]})
    assert {r.request_id for r in s._host_token_readers} == readers
    assert s.needs_pending_tokens() is False  # nothing in flight after the update
    s.schedule()
    assert s.needs_pending_tokens() is bool(readers)


@pytest.mark.parametrize(
    ("words", "needs"),
    [({"cat": [1], " cat": [2]}, False), ({"big dog": [3, 4], " big dog": [5, 4]}, True)],
)
def test_needs_pending_tokens_for_bad_words_of_several_tokens(words, needs):
    """A one-token bad word is banned whatever came before; a longer one matches its
    start against the output, so the token in flight must be on the host first."""
    s = make()
    request = req("a", 6, bad_words=[w for w in words if not w.startswith(" ")])
    request.sampling_params.encode_bad_words(words.__getitem__, vocab_size=10)
    s.add_request(request)
    s.schedule()
    assert s.needs_pending_tokens() is needs


def test_structured_outputs_do_not_wait_for_pending_tokens():
    """Their steps sample late instead (ModelRunner.sample_tokens), so scheduling goes on."""
    s = make()
    s.add_request(req("a", 6, structured_outputs=StructuredOutputsParams(choice=["x"])))
    s.schedule()
    assert not s.needs_pending_tokens()


def test_forks_past_max_num_seqs_take_turns():
    """An n = 4 request forks into 4 sequences at its first token, past max_num_seqs = 2: a
    step still takes at most 2 of them, the oldest first, and the others wait their turn."""
    s = make(max_num_seqs=2)
    s.add_request(Request("a", list(range(6)), SamplingParams(n=4, temperature=1.0, max_tokens=3)))
    first = s.schedule()
    update(s, first, {"a": [7, 8, 9, 10]})  # the first token of each sample: the fork
    group = list(s.running)
    assert len(group) == 4
    turns = []
    while s.has_unfinished_requests():
        out = step(s)
        assert len(out.scheduled) <= 2
        turns.append([x.request_id for x in out.scheduled])
    assert turns[0] == ["a", "a#1"]
    assert {rid for turn in turns for rid in turn} == {"a", "a#1", "a#2", "a#3"}
    assert [len(r.output_token_ids) for r in group] == [3] * 4


def test_token_status_is_the_rule_beam_search_and_requests_share():
    """StopChecker.token_status, which beam search asks of each candidate and `check` of each
    request's newest token: EOS (unless ignored) and stop ids from min_tokens on, then
    max_tokens, then the context limit; it names the stop id that matched."""
    stops = StopChecker([EOS, EOS], max_model_len=10)
    assert stops.eos_token_ids == (EOS,)  # each id once: beam search counts them
    rule = functools.partial(stops.token_status, ignore_eos=False, max_tokens=5)
    assert rule(EOS, 1, 3) == (RequestStatus.FINISHED_STOPPED, None)
    assert rule(EOS, 1, 3, min_tokens=2) == (None, None)
    assert rule(4, 2, 3, stop_token_ids=(4,)) == (RequestStatus.FINISHED_STOPPED, 4)
    assert rule(2, 5, 3) == (RequestStatus.FINISHED_LENGTH, None)
    assert rule(2, 4, 6) == (RequestStatus.FINISHED_LENGTH, None)  # 6 + 4 = max_model_len
    assert rule(2, 4, 5) == (None, None)
    assert stops.token_status(EOS, 1, 3, ignore_eos=True, max_tokens=None) == (None, None)


def test_all_stop_token_ids_hold_the_engines_eos_unless_ignored():
    params = SamplingParams(stop_token_ids=[5])
    assert params.all_stop_token_ids == {5}  # no engine has set the EOS ids yet
    params.set_eos_token_ids((EOS,))
    assert params.all_stop_token_ids == {5, EOS}
    params.ignore_eos = True
    assert params.all_stop_token_ids == {5}
