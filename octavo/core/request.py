"""A request as the scheduler and KV cache manager see it: plain Python, no torch."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from octavo.sampling_params import SamplingParams


class GrammarState(Protocol):
    """What core needs of a structured output's grammar (the engine's `Grammar`)."""

    def fork(self) -> GrammarState: ...

    def accept(self, token_id: int) -> bool: ...

    @property
    def is_complete(self) -> bool: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI/vLLM finish reason ("stop", "length", "abort"), None while unfinished."""
        return self._value_ if self in _FINISHED else None


# NOTE: a tuple, not a set: `in` compares by identity first, while hashing an Enum member
# runs Python code. Checked for every running request several times a step.
_FINISHED = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
)


class Request:
    """One sequence being generated.

    NOTE: `all_token_ids` is the prompt followed by the generated tokens, kept as one list
    that only grows (append_output_token), so the KV cache manager can hash full blocks
    without copying. `num_computed_tokens` counts the tokens whose KV is in the cache;
    the scheduler's one rule is to let it catch up with `num_tokens` (plus
    `num_pending_tokens`, sampled by a step still in flight). It counts tokens as computed
    from the moment they are scheduled, as vLLM v1 does.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Tokens that scheduled steps sample for this request, not yet appended: one per
        # step that reaches its last token, from scheduling until Scheduler.update (with
        # async scheduling, the step in flight's and the next one's).
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None  # the stop string or token id that matched
        # n > 1: completion `index` of the request `group_id` (the id the user sees).
        self.group_id = request_id
        self.index = 0
        # Hashes of the full blocks of all_token_ids, filled by the KV cache manager.
        self.block_hashes: list[int] = []
        # Structured outputs: where the output stands in its constraint (it has taken every
        # output token so far); None without one.
        self.grammar: GrammarState | None = None
        # What the model runner was last told of this request (see Scheduler._make_scheduled):
        # the block-id list and its length, and the number of output tokens; None while the
        # runner holds no state for it.
        self.sent_block_ids: list[int] | None = None
        self.num_sent_blocks = 0
        self.num_sent_outputs = 0
        # Whether the sampler reads its output tokens (penalties, bad words): they are sent.
        self.reads_output_tokens = False
        # Speculative decoding: the proposer's guesses of the next tokens, which its next
        # decode step verifies; and the verified tokens of a step beyond its first, which
        # the engine appends one at a time (each may stop the request).
        self.spec_token_ids: list[int] = []
        self.held_token_ids: list[int] = []

    num_prompt_tokens = property(lambda self: len(self.prompt_token_ids))
    num_output_tokens = property(lambda self: len(self.output_token_ids))
    num_tokens = property(lambda self: len(self.all_token_ids))
    is_finished = property(lambda self: self.status in _FINISHED)

    @property
    def awaits_fork(self) -> bool:
        """True until the first token of an n > 1 request, which samples n tokens at once
        and forks into n sequences that share the prompt's blocks."""
        return self.sampling_params.n > 1 and not self.output_token_ids

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
