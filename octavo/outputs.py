"""What LLM.generate and LLM.beam_search return: vLLM's RequestOutput, CompletionOutput and
BeamSearchOutput.

RequestOutput and its parts pickle as their constructors' positional arguments
(`__reduce__`) rather than as dicts of their fields, which is cheaper both ways: `octavo
serve`'s engine process sends every step's outputs through a pipe (see docs/PERFORMANCE.md).
NOTE: a new field must be added to `__reduce__` too, and to the positional calls in
engine/output_processor.py (tests/unit/test_outputs.py checks both).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token, its rank under the model's distribution
    (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None

    def __reduce__(self):
        return type(self), (self.logprob, self.rank, self.decoded_token)


# One dict per generated token: the sampled token and the top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing predicts it), then a dict of the
# prompt's token and the top-k alternatives at that position.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self):
        return type(self), (
            self.index, self.text, self.token_ids, self.cumulative_logprob, self.logprobs,
            self.finish_reason, self.stop_reason,
        )  # fmt: skip


@dataclass
class RequestOutput:
    """The outputs of one request, in the order the prompts were given."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs; a DELTA request gets them in its first output.
    prompt_logprobs: PromptLogprobs | None = None

    def __reduce__(self):
        return type(self), (
            self.request_id, self.prompt, self.prompt_token_ids, self.outputs, self.finished,
            self.num_cached_tokens, self.prompt_logprobs,
        )  # fmt: skip

    def add(self, later: RequestOutput) -> RequestOutput:
        """Folds a later delta output (RequestOutputKind.DELTA) of the same request into this
        one, in place: each completion's text, token ids and log-probs are appended, and its
        latest state kept. `later` is left as it was. Returns self."""
        by_index = {c.index: c for c in self.outputs}
        for new in later.outputs:
            old = by_index.get(new.index)
            if old is None:
                by_index[new.index] = copy.copy(new)  # later joins change the copy, not `later`
                self.outputs.append(by_index[new.index])
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if old.logprobs is not None and new.logprobs is not None:
                old.logprobs = old.logprobs + new.logprobs
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        return self


@dataclass
class BeamSearchSequence:
    """One finished hypothesis (vLLM's shape). `tokens` is the prompt then the generated
    tokens (a final EOS included); `logprobs` has one dict per generated token, the top-K
    candidates of that step; `score` is HF's length-penalized score the outputs are
    sorted by."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    score: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best hypotheses of one prompt, best first (at most beam_width of them)."""

    sequences: list[BeamSearchSequence]
