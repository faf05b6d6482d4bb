"""One step as plain data: what the scheduler hands the model runner.

It holds ids, token ids, counts and parameters, never a `Request` or the KV cache manager's
own lists, so it can be printed, compared, pickled and sent to other processes (tensor
parallel workers get exactly this object). The runner keeps its own state per request:

    first time (or after preemption, or once its params changed at a fork)
        NewRequestData(id, prompt ids, output ids, params)  -> runner state created
    every step it is scheduled
        ScheduledRequest(id, tokens to compute, where, new block ids, ...)
    finished / preempted ids                                 -> runner state dropped
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from octavo.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner holds no state for yet."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before this step (a resumed or forked request)
    sampling_params: SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute `num_new_tokens` tokens, at positions
    `num_computed_tokens ..` of its sequence.

    NOTE: with async scheduling the last new token may be one the previous step is still
    sampling on the device (`input_is_pending`); `token_ids` then holds only the tokens known
    on the host, and the runner takes the pending one from the device.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    # True when this step reaches the request's last token, so it samples the next one.
    sample: bool
    input_is_pending: bool
    # Output tokens before this step's sample, those still on the device included.
    num_output_tokens: int
    # The block table changed from index `block_ids_start` on: its entries from there.
    # ([] and the table's length when nothing changed.)
    block_ids_start: int
    new_block_ids: list[int]
    # Output tokens appended since the runner last saw this request, for requests whose
    # sampling reads them (penalties, bad words); [] for the others.
    new_output_token_ids: list[int] = field(default_factory=list)
    # Speculative decoding: guessed next tokens, computed after `token_ids` in this step;
    # the step samples at each of their positions too and keeps the guesses it agrees with.
    spec_token_ids: list[int] = field(default_factory=list)
    # A model with full and sliding-window layers (core/hybrid_kv.py): the sliding layers'
    # table entries for the same indices as `new_block_ids`; [] for other models.
    new_sliding_block_ids: list[int] = field(default_factory=list)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) + self.input_is_pending + len(self.spec_token_ids)

    @property
    def seq_len(self) -> int:
        return self.num_computed_tokens + len(self.token_ids) + len(self.spec_token_ids)


@dataclass
class GrammarBitmask:
    """Structured outputs' allowed next tokens for a step's constrained requests: row i of
    `bitmask` ([R, ceil(V / 32)] int32 on the host, token t in bit t % 32 of word t // 32)
    belongs to `request_ids[i]`."""

    request_ids: list[str]
    bitmask: object  # a host tensor; core stays free of torch, so it is not named here


@dataclass
class SchedulerOutput:
    """A plain description of one step, passed to the model runner."""

    step_id: int
    new_requests: list[NewRequestData]
    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str] = field(default_factory=list)
    # (source, destination) KV blocks to copy before the forward pass (copy-on-write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Requests finished since the previous step, so runner-side state can be dropped.
    finished_request_ids: list[str] = field(default_factory=list)
    # Whether a live request asked for prompt log-probs: else the runner looks for none.
    scores_prompts: bool = False
    # Scheduled requests with a structured output: their sampling needs a GrammarBitmask,
    # which the engine hands the runner's sample_tokens once their grammars are current.
    structured_request_ids: list[str] = field(default_factory=list)
    # block_copies for the sliding layers' blocks, in a model with two kinds (core/hybrid_kv.py).
    sliding_block_copies: list[tuple[int, int]] = field(default_factory=list)

    @cached_property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    is_empty = property(lambda self: not self.scheduled)
