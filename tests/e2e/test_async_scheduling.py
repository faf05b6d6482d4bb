"""Async scheduling (step N+1 scheduled and launched before step N's tokens reach the host)
gives exactly the outputs of the synchronous engine, on the embedded model. It is the default
on CUDA; here it runs on the CPU, where the same engine logic executes step by step."""

from __future__ import annotations

import pytest
from engine_utils import GREEDY, prompts_of, scheduling

from octavo import SamplingParams, StructuredOutputsParams

MIXED = [
    SamplingParams(temperature=0, max_tokens=16),  # may stop at EOS
    SamplingParams(temperature=0.9, top_p=0.8, seed=11, max_tokens=8),
    SamplingParams(temperature=1.2, top_k=5, seed=12, max_tokens=8, min_tokens=4),
    SamplingParams(temperature=0.7, min_p=0.1, seed=13, max_tokens=6, logprobs=2),
    SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=6),
    SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5, max_tokens=6),
    SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=6),
    SamplingParams(temperature=0, max_tokens=40, stop=[".", "\n"]),
]


def summary(outputs):
    """What a completion says, without its log-prob values (see `logprob_values`)."""
    return [
        [
            (
                c.token_ids,
                c.text,
                c.finish_reason,
                c.stop_reason,
                None if c.logprobs is None else [sorted(d) for d in c.logprobs],
            )
            for c in o.outputs
        ]
        for o in outputs
    ]


def logprob_values(outputs) -> list[float]:
    values = []
    for o in outputs:
        for c in o.outputs:
            if c.logprobs is not None:
                values.append(c.cumulative_logprob)
                values += [d[t].logprob for d in c.logprobs for t in sorted(d)]
    return values


def assert_same(outs, ref) -> None:
    """Tokens, text and reasons exactly; log-probs to 1e-4, since a batch of another shape
    may round float32 matmuls differently on the CPU."""
    assert summary(outs) == summary(ref)
    assert logprob_values(outs) == pytest.approx(logprob_values(ref), abs=1e-4)


def generate_both(llm, prompts, params):
    with scheduling(llm, False):
        ref = llm.generate(prompts, params, use_tqdm=False)
    with scheduling(llm, True):
        outs = llm.generate(prompts, params, use_tqdm=False)
    return ref, outs


# The engines of test_engine_behaviour.py: preemption, preemption with caching, chunking.
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="plain"),
        pytest.param({"num_kv_blocks": 14, "enable_prefix_caching": False}, id="preempt",
                     marks=pytest.mark.slow),
        pytest.param({"num_kv_blocks": 14}, id="preempt-cached", marks=pytest.mark.slow),
        pytest.param({"max_num_batched_tokens": 7, "enable_prefix_caching": False},
                     id="chunked", marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_async_greedy_equals_sync(llm_factory, chat_prompt_ids, greedy_reference, options):
    """The synchronous engine's greedy outputs are the same under every one of these options
    (test_engine_behaviour.py): the reference run stands for each."""
    llm = llm_factory(**options)
    preemptions = llm.get_stats()["num_preemptions"]
    with scheduling(llm, True):
        outs = llm.generate(prompts_of(chat_prompt_ids), GREEDY, use_tqdm=False)
    assert_same(outs, greedy_reference)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if "num_kv_blocks" in options:
        assert stats["num_preemptions"] > preemptions


@pytest.mark.slow
def test_async_mixed_sampling_equals_sync(llm, chat_prompt_ids):
    """Seeds, penalties (which wait for the tokens on the host), n > 1 (which forks when
    its first tokens arrive), logprobs, min_tokens, EOS and stop strings."""
    ref, outs = generate_both(llm, prompts_of(chat_prompt_ids), MIXED)
    assert_same(outs, ref)
    assert {o.outputs[0].finish_reason for o in outs} >= {"stop", "length"}
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_async_abort_in_flight_frees_blocks_and_spares_the_rest(
    llm, chat_prompt_ids, greedy_reference
):
    ref = greedy_reference[:3]
    engine = llm.engine
    finished = {}
    with scheduling(llm, True):
        for i, ids in enumerate(chat_prompt_ids[:4]):
            engine.add_request(ids, GREEDY, f"abort-{i}")
        for step in range(200):
            outputs = engine.step()
            if step == 3:  # step 3 is in flight for all four
                outputs += engine.abort_request("abort-3")
            for out in outputs:
                if out.finished:
                    finished[out.request_id] = out
            if not engine.has_unfinished_requests():
                break
    assert finished["abort-3"].outputs[0].finish_reason == "abort"
    assert_same([finished[f"abort-{i}"] for i in range(3)], ref)
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_async_failed_step_aborts_its_requests_and_the_engine_goes_on(
    llm, chat_prompt_ids, greedy_reference, monkeypatch
):
    from octavo.runner.outputs import PendingOutput

    engine = llm.engine
    with scheduling(llm, True):
        engine.add_request(chat_prompt_ids[0], GREEDY, "fail-0")
        engine.step()  # prefill launched
        real = PendingOutput.result

        def broken(self):
            raise RuntimeError("device fault")

        monkeypatch.setattr(PendingOutput, "result", broken)
        with pytest.raises(RuntimeError, match="device fault"):
            engine.step()
        monkeypatch.setattr(PendingOutput, "result", real)
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    with scheduling(llm, True):
        outs = llm.generate(prompts_of(chat_prompt_ids[:2]), GREEDY, use_tqdm=False)
    assert_same(outs, greedy_reference[:2])


PENALIZED = SamplingParams(temperature=0, presence_penalty=0.5, max_tokens=8, ignore_eos=True)


@pytest.mark.slow  # a regression test of one failure's path
def test_a_step_that_failed_while_finished_early_is_not_finished_again(
    llm, chat_prompt_ids, greedy_reference, monkeypatch
):
    """A request with a penalty needs its tokens on the host, so the step in flight is
    finished before the next is scheduled. When that failed, the step stayed in flight, and
    the next step() finished it again: its failure aborted an innocent request launched
    meanwhile."""
    from octavo.runner.outputs import PendingOutput

    engine = llm.engine
    ref = greedy_reference[1:2]
    with scheduling(llm, True):
        engine.add_request(chat_prompt_ids[0], PENALIZED, "early-0")
        engine.step()  # its prefill in flight
        failing = engine._in_flight[1]
        real = PendingOutput.result

        def result(self):
            if self is failing:
                raise RuntimeError("device fault")
            return real(self)

        monkeypatch.setattr(PendingOutput, "result", result)
        with pytest.raises(RuntimeError, match="device fault"):
            engine.step()
        engine.add_request(chat_prompt_ids[1], GREEDY, "early-1")  # innocent
        finished = {}
        while engine.has_unfinished_requests():
            finished |= {o.request_id: o for o in engine.step() if o.finished}
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert list(finished) == ["early-1"]
    assert_same([finished["early-1"]], ref)
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


# A constraint that cannot complete within these tests' lengths: its requests' steps are held
# for their grammar bitmask when launched with a step in flight (ModelRunner.sample_tokens).
HELD = StructuredOutputsParams(regex="[a-z ]{300}")


def fail_held_sampling(monkeypatch, engine, error: Exception, only=None) -> None:
    """Makes the sampling of held steps (the engine's `_sample_held`, after the step in
    flight has taken its tokens) raise `error`, only that of `only`'s PendingOutput if
    given."""
    real_sample, real_held = type(engine.runner).sample_tokens, engine._sample_held
    holding = []

    def sample_held(so):
        holding.append(so)
        try:
            return real_held(so)
        finally:
            holding.pop()

    def sample_tokens(runner, bitmask):
        if holding and (only is None or runner._unsampled[0] is only()):
            raise error
        return real_sample(runner, bitmask)

    monkeypatch.setattr(engine, "_sample_held", sample_held)
    monkeypatch.setattr(type(engine.runner), "sample_tokens", sample_tokens)


@pytest.mark.slow  # a regression test of one failure's path
def test_a_failed_sample_of_the_next_step_releases_the_requests_that_finished(
    llm, chat_prompt_ids, monkeypatch
):
    """A step with a structured output samples after the step in flight has taken its
    tokens; when that sampling failed, a request that had just finished made no output and
    its id stayed in use for good."""
    engine = llm.engine
    with scheduling(llm, True):
        short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        held = SamplingParams(temperature=0, max_tokens=20, structured_outputs=HELD)
        engine.add_request(chat_prompt_ids[0], short, "sample-0")
        engine.add_request(chat_prompt_ids[1], held, "sample-1")
        engine.step()
        engine.step()  # sample-0's last token is sampled in the step now in flight
        fail_held_sampling(monkeypatch, engine, RuntimeError("mask fault"))
        with pytest.raises(RuntimeError, match="mask fault"):
            engine.step()
        monkeypatch.undo()
        assert engine.outputs.members("sample-0") == []
        assert not engine.has_unfinished_requests()
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
        engine.add_request(chat_prompt_ids[0], short, "sample-0")  # the id is free again
        engine.abort_request("sample-0")
        # The failed step's held sampling is dropped with it: structured steps run on.
        held = SamplingParams(temperature=0, max_tokens=3, structured_outputs=HELD)
        for i in range(2):
            engine.add_request(chat_prompt_ids[i], held, f"after-{i}")
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        finished += [o for o in engine.step() if o.finished]
        assert sorted(len(o.outputs[0].token_ids) for o in finished) == [3, 3]


@pytest.mark.slow  # a regression test of one failure's path
def test_a_failed_sample_spares_a_request_that_reused_an_aborted_id(
    llm_factory, chat_prompt_ids, monkeypatch
):
    """Only the step in flight's own requests are released: not a waiting request that
    took the id of one aborted while that step ran."""
    llm = llm_factory(max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    held = SamplingParams(temperature=0, max_tokens=10, structured_outputs=HELD)
    with scheduling(llm, True):
        for i, request_id in enumerate(["reuse-0", "reuse-a", "reuse-1"]):
            engine.add_request(chat_prompt_ids[i], held if i == 0 else params, request_id)
        engine.step()
        engine.step()  # reuse-a decodes in the step in flight; reuse-1 waits
        engine.abort_request("reuse-a")
        engine.add_request(chat_prompt_ids[3], params, "reuse-a")  # waits behind reuse-1
        fail_held_sampling(monkeypatch, engine, ZeroDivisionError())
        with pytest.raises(ZeroDivisionError):
            engine.step()
        monkeypatch.undo()
        assert not engine.scheduler.requests["reuse-a"].is_finished
        finished = {}
        while engine.has_unfinished_requests():
            finished |= {o.request_id: o for o in engine.step() if o.finished}
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert len(finished["reuse-a"].outputs[0].token_ids) == 10
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


@pytest.mark.slow  # a regression test of one failure's path
def test_a_failed_sample_aborts_a_request_preempted_in_its_step(
    llm_factory, chat_prompt_ids, monkeypatch
):
    """A request of the step in flight that the next schedule preempts gets its token, and
    no text for it if the next step's sampling fails: it is aborted, not run on with a gap
    in its text."""
    llm = llm_factory(num_kv_blocks=14, enable_prefix_caching=False)
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=HELD)
    victims, target = [], []
    real_schedule, real_launch = engine.scheduler.schedule, engine._launch

    def schedule():
        so = real_schedule()
        if not victims and engine._in_flight is not None and not so.is_empty:
            sampled = {s.request_id for s in engine._in_flight[0].scheduled if s.sample}
            victims.extend(r for r in so.preempted_request_ids if r in sampled)
        return so

    def launch(so, grammars_current):
        pending = real_launch(so, grammars_current)
        if victims and not target:
            target.append(pending)
        return pending

    with scheduling(llm, True):
        for i, prompt in enumerate(chat_prompt_ids[:4]):
            engine.add_request(prompt, params, f"gap-{i}")
        monkeypatch.setattr(engine.scheduler, "schedule", schedule)
        monkeypatch.setattr(engine, "_launch", launch)
        fail_held_sampling(
            monkeypatch, engine, RuntimeError("mask fault"), lambda: target[0] if target else None
        )
        finished = {}
        with pytest.raises(RuntimeError, match="mask fault"):
            while True:
                finished |= {o.request_id: o for o in engine.step() if o.finished}
        monkeypatch.undo()
        assert victims and all(v not in engine.scheduler.requests for v in victims)
        while engine.has_unfinished_requests():
            finished |= {o.request_id: o for o in engine.step() if o.finished}
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert not set(victims) & set(finished)
    for out in finished.values():  # every text is its tokens' text
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids)
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
