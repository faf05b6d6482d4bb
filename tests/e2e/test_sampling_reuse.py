"""The model runner reuses a steady decode batch's sampling metadata from step to step
(ModelRunner._sampling_metadata): the tokens are the same as when every step builds its own,
while rows finish, newcomers take their places, and the others move up. Structured outputs
reuse it too; only their grammars' masks are made each step."""

from __future__ import annotations

import pytest

from octavo import SamplingParams, StructuredOutputsParams
from octavo.runner.sampler import Sampler
from octavo.runner.sampling_metadata import SamplingMetadata


def params(temperature: float, max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, **kwargs)


# Grammars whose masks change from token to token, so that a stale mask samples otherwise.
LETTERS, DIGITS = (
    StructuredOutputsParams(regex="(x[a-z])+"),
    StructuredOutputsParams(regex="(a[0-9])+"),
)

# Greedy and random rows with filters and log-probs that finish at different steps. Each
# finish lets the next of LATER in at once, so the batch keeps its size while its rows change:
# a row that inherited another row's metadata would sample at the wrong temperature.
FIRST = [
    params(0, 5),
    params(1.5, 14),
    params(0.8, 9, top_k=5),
    params(0, 11, logprobs=2),
    params(1.0, 30, top_p=0.7),  # then a steady batch
    params(2.0, 7, min_p=0.05),
    params(1.4, 24, seed=7),  # its noise follows its number of outputs: renewed each step
    params(1.2, 12, structured_outputs=LETTERS),  # its mask follows its tokens: made each step
]
LATER = [
    params(1.3, 8),
    params(0, 6),
    params(1.1, 5, seed=3),
    params(0, 10, structured_outputs=DIGITS),
]


class BanRecorder(Sampler):
    """A sampler that notes each call's (row, token id) bans (min_tokens, bad words)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.bans: list[list[tuple[int, int]]] = []

    def __call__(self, logits, md):
        banned = [] if md.banned is None else list(zip(*(t.tolist() for t in md.banned)))
        self.bans.append(sorted(banned))
        return super().__call__(logits, md)


def run(
    llm, prompt_ids, monkeypatch, reuse: bool, first=FIRST, later=LATER
) -> tuple[list, int, list]:
    """Each request's token ids, how many times the run built sampling metadata, and the
    bans of each sampling call."""
    builds = []
    real_build = SamplingMetadata.build.__func__

    def counted(cls, *args, **kwargs):
        builds.append(1)
        return real_build(cls, *args, **kwargs)

    engine = llm.engine
    queue = list(enumerate(first + later))
    tokens = {}

    def admit() -> None:
        i, p = queue.pop(0)
        engine.add_request(prompt_ids[i % len(prompt_ids)], p, f"reuse-{i}")

    with monkeypatch.context() as patch:
        patch.setattr(SamplingMetadata, "build", classmethod(counted))
        if not reuse:
            patch.setattr(SamplingParams, "samples_from_settings_alone", lambda p, n: False)
        # The same random stream, and prompts computed in full, for each run.
        sampler = BanRecorder(seed=0)
        patch.setattr(engine.runner, "sampler", sampler)
        engine.kv.reset_prefix_cache()
        for _ in first:
            admit()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
                    if queue:
                        admit()
    return [tokens[f"reuse-{i}"] for i in range(len(first + later))], len(builds), sampler.bans


@pytest.mark.slow  # twelve requests twice, up to 30 tokens each
def test_reused_sampling_metadata_samples_as_metadata_built_each_step(
    llm, chat_prompt_ids, monkeypatch
):
    ref, builds_each_step, _ = run(llm, chat_prompt_ids, monkeypatch, reuse=False)
    tokens, builds, _ = run(llm, chat_prompt_ids, monkeypatch, reuse=True)
    assert tokens == ref
    for t, p in zip(tokens, FIRST + LATER, strict=True):  # a grammar may end at an EOS
        assert len(t) == p.max_tokens or p.structured_outputs and 0 < len(t) < p.max_tokens
    # a build for each step in which the batch changed, not for every step
    assert builds_each_step >= 30
    assert builds <= builds_each_step // 2


def test_rows_that_read_their_tokens_build_metadata_each_step(llm, chat_prompt_ids, monkeypatch):
    p = params(0.9, 6, repetition_penalty=1.2)
    tokens, builds, _ = run(llm, chat_prompt_ids, monkeypatch, True, first=[p, p], later=[])
    assert [len(t) for t in tokens] == [6, 6]
    assert builds >= 6


@pytest.mark.slow
def test_min_tokens_rows_reuse_their_metadata_once_past_it(llm, chat_prompt_ids, monkeypatch):
    """A stop id is banned until min_tokens: the metadata is built each step until then, and
    reused after, sampling as metadata built each step does."""
    first = [
        params(0.8, 16, min_tokens=5, stop_token_ids=[12345]),
        params(0, 16, min_tokens=3, stop_token_ids=[12345]),
    ]
    ref, builds_each_step, ref_bans = run(llm, chat_prompt_ids, monkeypatch, False, first, [])
    tokens, builds, bans = run(llm, chat_prompt_ids, monkeypatch, True, first, [])
    assert tokens == ref and [len(t) for t in tokens] == [16, 16]
    # The stop id is never sampled, so compare the bans themselves: row 0 for its first 5
    # tokens, row 1 for its first 3, then none.
    assert bans == ref_bans == [[(0, 12345), (1, 12345)]] * 3 + [[(0, 12345)]] * 2 + [[]] * 11
    assert builds_each_step == 16
    assert builds == 6  # before the 1st to the 6th token: then 5 outputs, min_tokens reached
