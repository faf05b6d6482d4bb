"""Bad input through the Python APIs (LLM, Engine, AsyncEngine): a ValueError that names the
problem, never another exception, and the engine goes on with every block free. Each case
here was found failing by a review (session 16); the server's cases are in test_server.py."""

from __future__ import annotations

import asyncio

import pytest

from octavo import BeamSearchParams, SamplingParams
from octavo.engine.async_engine import AsyncEngine, EngineStepError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _all_free(engine) -> bool:
    stats = engine.get_stats()
    idle = stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    return idle and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def _still_generates(llm) -> None:
    (out,) = llm.generate("Hello", GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert _all_free(llm.engine)


def test_a_lone_surrogate_is_a_value_error(llm):
    """JSON may carry "\\ud800"; the tokenizer cannot take it (it raised TypeError)."""
    with pytest.raises(ValueError, match="surrogate"):
        llm.generate("\ud800 hi", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\].*surrogate at character 3"):
        llm.chat([{"role": "user", "content": "hi \udfff"}], GREEDY, use_tqdm=False)
    _still_generates(llm)


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", 100_000), ("logprobs", -1), ("stop_token_ids", [None]), ("n", "2"),
     ("n", 0), ("max_tokens", 0), ("temperature", float("nan")), ("prompt_logprobs", 21),
     ("logit_bias", {1: 1000.0}), ("logit_bias", {1: float("nan")}), ("logit_bias", {10**6: 1.0}),
     ("allowed_token_ids", [49152]), ("allowed_token_ids", [])],
)  # fmt: skip
def test_params_changed_after_construction_are_checked_when_added(llm, field, value):
    """They crashed the step (and the requests batched with it) or passed silently."""
    engine = llm.engine
    running = engine.add_request("Hello", SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    bad = SamplingParams(max_tokens=4)
    setattr(bad, field, value)
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        engine.add_request("Hi", bad)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in outputs if o.finished] == [
        (running.request_id, 3)
    ]
    assert _all_free(engine)


@pytest.mark.parametrize(
    ("field", "value"),
    [("beam_width", 0), ("beam_width", 10**6), ("max_tokens", -1), ("length_penalty", "x")],
)
def test_beam_params_changed_after_construction_are_checked(llm, field, value):
    """They gave no sequences, ran anyway, raised TypeError, or named another field."""
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        llm.beam_search(["Hi"], params)
    _still_generates(llm)


def test_wrong_kinds_of_params_and_prompts_are_value_errors(llm):
    for params in (BeamSearchParams(beam_width=2, max_tokens=4), 3, {"max_tokens": 4}):
        with pytest.raises(ValueError, match="sampling_params must be"):
            llm.generate("Hi", params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids must be a list"):
        llm.generate({"prompt_token_ids": "abc"}, GREEDY, use_tqdm=False)  # not taken as text
    ids = [llm.get_tokenizer().encode(p) for p in ("Hi", "Bye")]
    as_lists = llm.generate(ids, GREEDY, use_tqdm=False)  # a list of token-id lists, as vLLM's
    as_dicts = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in as_lists] == [o.outputs[0].token_ids for o in as_dicts]
    assert [o.prompt_token_ids for o in as_lists] == ids
    both = llm.generate(["Hi", "Bye"], (p for p in [GREEDY, GREEDY]), use_tqdm=False)
    assert len(both) == 2  # any iterable of SamplingParams, as before
    _still_generates(llm)


def test_request_ids_that_a_group_or_its_samples_use_are_refused(llm):
    engine = llm.engine
    two = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=6, ignore_eos=True)
    try:
        engine.add_request("Hi", GREEDY, "q#1")
        with pytest.raises(ValueError, match="already in use"):  # its samples would be q#1
            engine.add_request("Hi", two, "q")
        engine.add_request("Hi", two, "p")
        with pytest.raises(ValueError, match="already in use"):  # p's second sample, unforked
            engine.add_request("Hi", GREEDY, "p#1")
        engine.add_request("Hi", GREEDY, "p#0")  # no sample is named so (the first is p)
        engine.abort_request({"p#0": None}.keys())  # any iterable of ids
        while engine.outputs.members("p")[0].num_output_tokens < 2:
            engine.step()
        engine.abort_request("q#1")
        with pytest.raises(ValueError, match="already in use"):  # the group p is still live
            engine.add_request("Bye", GREEDY, "p")
        for bad in (5, ["x"]):
            with pytest.raises(ValueError, match="request_id must be a str"):
                engine.add_request("Hi", GREEDY, bad)
        with pytest.raises(ValueError, match="request_ids must be"):
            engine.abort_request(5)
        while engine.has_unfinished_requests():
            engine.step()
        assert len(engine.outputs.members("p")) == 0  # finished, and forgotten
    finally:
        engine.abort_request(["q#1", "p", "q"])
        while engine.has_unfinished_requests():
            engine.step()
    _still_generates(llm)


def test_an_extreme_length_penalty_ties_instead_of_raising(llm):
    for penalty in (1100.0, -1100.0, 1e308, -1e308):
        params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=penalty)
        (out,) = llm.beam_search(["The capital of France is"], params)
        assert len(out.sequences) == 2
    assert _all_free(llm.engine)


def test_async_engine_survives_bad_prompts_and_failures_to_add(llm, monkeypatch):
    engine = AsyncEngine(llm.engine)
    add = llm.engine.add_request

    def add_or_fail(prompt, params, request_id=None):
        if prompt == "boom":
            raise RuntimeError("a bug while adding")
        return add(prompt, params, request_id)

    monkeypatch.setattr(llm.engine, "add_request", add_or_fail)

    async def run() -> list:
        engine.start()
        try:
            with pytest.raises(ValueError, match="surrogate"):
                async for _ in engine.generate("\ud800", GREEDY, "a"):
                    pass
            with pytest.raises(EngineStepError, match="a bug while adding"):
                async for _ in engine.generate("boom", GREEDY, "b"):
                    pass
            with pytest.raises(ValueError, match="sampling_params must be"):
                async for _ in engine.generate("Hi", None, "c"):
                    pass
            return [out async for out in engine.generate("Hi", GREEDY, "c")]  # "c" is free
        finally:
            await engine.shutdown()

    outputs = asyncio.run(run())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
    monkeypatch.undo()
    assert _all_free(llm.engine)


def test_async_abort_ends_the_callers_stream_with_reason_abort(llm):
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run() -> list:
        engine.start()
        try:
            received = []

            async def consume() -> None:
                async for out in engine.generate("Hello", params, "long"):
                    received.append(out)
                    if len(received) == 2:
                        engine.abort(["long"])

            await asyncio.wait_for(consume(), timeout=60)  # it hung before
            return received
        finally:
            await engine.shutdown()

    received = asyncio.run(run())
    last = received[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert len(last.outputs[0].token_ids) < 200
    assert _all_free(llm.engine)


def test_min_tokens_with_only_stop_tokens_allowed_is_a_value_error(llm):
    """Every allowed token is EOS, which min_tokens bans: the row would have no token left
    (it sampled token 0, outside the allowed ids)."""
    eos = llm.engine.eos_token_ids[0]
    params = SamplingParams(max_tokens=3, min_tokens=2, allowed_token_ids=[eos])
    with pytest.raises(ValueError, match="^allowed_token_ids holds only .*min_tokens"):
        llm.generate("Hi", params, use_tqdm=False)
    params.ignore_eos = True  # then EOS is not banned, and may be sampled
    (out,) = llm.generate("Hi", params, use_tqdm=False)
    assert out.outputs[0].token_ids == [eos] * 3
    _still_generates(llm)


def test_allowed_tokens_that_logit_bias_bans_are_a_value_error(llm):
    params = SamplingParams(max_tokens=3, allowed_token_ids=[100, 101],
                            logit_bias={100: float("-inf"), 101: -1e30})  # fmt: skip
    with pytest.raises(ValueError, match="^allowed_token_ids holds only tokens that logit_bias"):
        llm.generate("Hi", params, use_tqdm=False)
    _still_generates(llm)


def test_allowed_tokens_that_bad_words_ban_are_a_value_error(llm):
    """A one-token bad word is banned everywhere: allowed_token_ids of nothing else leave no
    token to sample (the sampler would emit token 0, outside them)."""
    tok = llm.get_tokenizer()
    the = [tok.encode(w, add_special_tokens=False)[0] for w in ("the", " the")]
    params = SamplingParams(max_tokens=3, allowed_token_ids=the, bad_words=["the"])
    with pytest.raises(ValueError, match="^allowed_token_ids holds only .*bad_words"):
        llm.generate("Hi", params, use_tqdm=False)
    params.allowed_token_ids = [*the, 11]
    (out,) = llm.generate("Hi", params, use_tqdm=False)
    assert out.outputs[0].token_ids == [11] * 3
    _still_generates(llm)


def test_the_engine_keeps_its_own_copy_of_a_requests_params(llm):
    """Changing or reusing the caller's SamplingParams after add_request changes nothing
    for the request (it changed a running request's bias, or half of it)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0})
    (ref,) = llm.generate("Hello", params, use_tqdm=False)
    params.top_k = -1
    engine.add_request("Hello", params, request_id="mine")
    assert params.top_k == -1  # the caller's object is not normalized behind its back
    engine.step()
    params.logit_bias, params.max_tokens = None, 2
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (final,) = [o for o in outputs if o.finished]
    assert final.outputs[0].token_ids == ref.outputs[0].token_ids == [42] * 6
