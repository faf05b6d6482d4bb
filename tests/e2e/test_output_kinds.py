"""RequestOutputKind on the embedded model: DELTA outputs hold only what is new and join back
into the CUMULATIVE output; FINAL_ONLY gives one output per request; LLM.generate asks for
final outputs without touching the caller's SamplingParams."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from octavo import RequestOutputKind, SamplingParams
from octavo.engine.async_engine import AsyncEngine

CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
)  # fmt: skip
CASES = {
    # a stop string that the embedded model reaches ("," in its haiku), with log-probs; the
    # longer one, never reached, makes streaming hold back the text's last 6 characters
    "greedy-stop": SamplingParams(temperature=0, max_tokens=40, stop=[" silent", ","], logprobs=2),
    # n > 1: the samples fork, run and finish at different steps
    "seeded-n3": SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=10, logprobs=1),
    "ignore-eos": SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
}


@pytest.fixture(scope="module")
def engine(llm_factory):
    """Without prefix caching, so that a second run computes exactly what the first did."""
    return llm_factory(enable_prefix_caching=False).engine


@pytest.fixture(scope="module")
def prompts(chat_prompt_ids):
    return [chat_prompt_ids[1], chat_prompt_ids[3]]  # a haiku; three prime numbers


def run(engine, prompts, params: SamplingParams, kind: RequestOutputKind) -> dict[str, list]:
    """Every output of each prompt's request, in the order the engine gave them."""
    params = dataclasses.replace(params, output_kind=kind)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    outputs: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def completions(out) -> list[tuple]:
    return [
        (c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason,
         c.stop_reason)
        for c in out.outputs
    ]  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [pytest.param(case, marks=[] if case == "seeded-n3" else pytest.mark.slow) for case in CASES],
)
def test_delta_outputs_join_to_the_cumulative_output(engine, prompts, case):
    params = CASES[case]
    cumulative = list(run(engine, prompts, params, CUMULATIVE).values())
    deltas = list(run(engine, prompts, params, DELTA).values())
    for full, parts in zip(cumulative, deltas, strict=True):
        final = full[-1]
        assert final.finished and parts[-1].finished
        assert not any(p.finished for p in parts[:-1])
        # Each token id is in exactly one delta, and nothing follows a completion's finish.
        ended: set[int] = set()
        for part in parts:
            assert part.prompt_token_ids == final.prompt_token_ids
            for c in part.outputs:
                assert c.index not in ended
                if c.finish_reason is not None:
                    ended.add(c.index)
                if not c.finish_reason:
                    assert c.token_ids or c.text
        assert ended == set(range(params.n))
        joined = parts[0]
        for part in parts[1:]:
            joined = joined.add(part)
        assert completions(joined) == completions(final)
    if case == "greedy-stop":
        assert any(c.stop_reason == "," for full in cumulative for c in full[-1].outputs)


@pytest.mark.slow  # LLM.generate asks for FINAL_ONLY outputs in every test
def test_final_only_gives_one_output_per_request(engine, prompts):
    outputs = run(engine, prompts, CASES["seeded-n3"], FINAL_ONLY)
    cumulative = run(engine, prompts, CASES["seeded-n3"], CUMULATIVE)
    for (only,), full in zip(outputs.values(), cumulative.values(), strict=True):
        assert only.finished and completions(only) == completions(full[-1])
    assert all(len(outs) > 3 for outs in cumulative.values())


def test_an_aborted_delta_request_ends_with_abort(engine, prompts):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, output_kind=DELTA)
    request = engine.add_request(prompts[0], params)
    received = 0
    while received < 3:
        received += sum(len(o.outputs[0].token_ids) for o in engine.step())
    (aborted,) = engine.abort_request(request.request_id)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():  # a step in flight for the aborted request
        assert engine.step() == []
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_llm_generate_leaves_the_callers_params_alone(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=DELTA)
    (out,) = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert params.output_kind is DELTA
    assert len(out.outputs[0].token_ids) == 12  # the whole output, not a delta
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


@pytest.mark.slow
def test_a_consumer_that_falls_behind_gets_the_deltas_joined(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    (expected,) = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    engine = AsyncEngine(llm.engine)

    async def consume() -> list:
        engine.start()
        try:
            received = []
            delta = dataclasses.replace(params, output_kind=DELTA)
            async for out in engine.generate(prompts[0], delta, "slow"):
                received.append(out)
                await asyncio.sleep(0.3)  # the engine runs several steps meanwhile
            return received
        finally:
            await engine.shutdown()

    received = asyncio.run(consume())
    assert any(len(out.outputs[0].token_ids) > 1 for out in received)
    joined = received[0]
    for out in received[1:]:
        joined = joined.add(out)
    assert completions(joined) == completions(expected)
