"""Speculative decoding's engine side: who guesses, for which requests, and how it went.

Before each step the `Speculator` asks its proposer to guess the next tokens of every
decoding request (`Request.spec_token_ids`). The scheduler lets the step compute them after
the request's last token, the runner samples at each of those positions and keeps the
samples up to the first that differs from its guess (runner/outputs.py's `_keep_verified`),
and the engine appends what was kept one token at a time, so that a stop ends it exactly
where decoding without speculation would.

A proposer is anything with `propose(requests, k)` returning one list of at most k guessed
token ids per request (and, if it has one, `observe(result)` of each step). `NgramProposer`
(prompt lookup) runs on the host; `DraftModelProposer` hands on the guesses a draft model
made in the runner after the step (runner/draft.py). An EAGLE-style head or a
multi-token-prediction layer would guess in the runner the same way.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

from octavo.config import SpeculativeConfig
from octavo.core.request import Request, RequestStatus
from octavo.core.sched_output import SchedulerOutput
from octavo.core.scheduler import Scheduler
from octavo.runner.outputs import ModelRunnerOutput

# A request whose guesses all fail, or that gets none, sits out this many steps per miss in
# a row (up to the cap) before it guesses again, so that a text with nothing to copy costs
# ~nothing; a step in which every running request sits out does not speculate at all (it
# need not wait for the step in flight).
_BACKOFF_CAP = 8


class Proposer(Protocol):
    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        """At most k guessed next tokens for each request (a list may be empty)."""
        ...


class NgramProposer:
    """Prompt lookup: the request's last n tokens, n from `max_n` down to `min_n`, are looked
    for earlier in its prompt and output; the tokens after their latest earlier occurrence
    are the guess.

    Each request's n-grams are indexed as its tokens come (a dict per n from the n tokens
    to where they last started), so a lookup costs the same at any length.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._index: weakref.WeakKeyDictionary[Request, _NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        guesses = []
        for request in requests:
            index = self._index.get(request)
            if index is None:
                index = self._index[request] = _NgramIndex(self.min_n, self.max_n)
            guesses.append(index.lookup(request.all_token_ids, k))
        return guesses

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """The guess for one sequence, indexed from scratch."""
        return _NgramIndex(self.min_n, self.max_n).lookup(token_ids, k)


class _NgramIndex:
    """Where each n-gram of a growing sequence last started, for n in [min_n, max_n],
    over the n-grams that end before the sequence's last token."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self.starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.end = 0  # n-grams ending at or before this index are in

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        length = len(token_ids)
        for n in self.sizes:
            starts = self.starts[n]
            for start in range(max(self.end - n + 1, 0), length - n):
                starts[tuple(token_ids[start : start + n])] = start
        self.end = max(self.end, length - 1)
        for n in self.sizes:
            if n < length:
                start = self.starts[n].get(tuple(token_ids[length - n :]))
                if start is not None:
                    return token_ids[start + n : start + n + k]
        return []


class DraftModelProposer:
    """The guesses a draft model made in the runner after the last step
    (`ModelRunnerOutput.draft_token_ids`, runner/draft.py)."""

    def __init__(self) -> None:
        self.latest: dict[str, list[int]] = {}

    def observe(self, result: ModelRunnerOutput) -> None:
        self.latest = result.draft_token_ids

    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        return [self.latest.get(r.request_id, [])[:k] for r in requests]


@dataclass
class SpecStats:
    """What speculation did: guesses verified and kept, in all and by position (position
    i: the (i + 1)-th guess of a step), and the steps of a request that verified any."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, int | float | list[int]]:
        mean = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_accepted_per_position": list(self.accepted_per_position),
            "spec_mean_accepted_length": mean,
        }


class Speculator:
    """The engine's speculation: asks the proposer for the requests that decode next step,
    and counts what their steps kept."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        if proposer is None and config.method == "draft_model":
            proposer = DraftModelProposer()
        self.proposer = proposer or NgramProposer(
            config.prompt_lookup_min, config.prompt_lookup_max
        )
        # KV slots the scheduler reserves past a sampling step, for a draft model's guesses.
        self.num_lookahead_tokens = self.k if config.method == "draft_model" else 0
        self.stats = SpecStats(accepted_per_position=[0] * self.k)
        # request -> (misses in a row, steps left to sit out); gone with it
        self._backoff: weakref.WeakKeyDictionary[Request, tuple[int, int]] = (
            weakref.WeakKeyDictionary()
        )
        self._sitting_out: set[str] = set()  # this step's, by request id

    def active(self, scheduler: Scheduler) -> bool:
        """Whether the next step speculates: some request runs, no more than
        `disable_by_batch_size` of them, and not all sit out. Called once a step: each
        request sitting out has a step fewer to wait."""
        limit = self.config.disable_by_batch_size
        running = scheduler.running
        if not running or (limit is not None and len(running) > limit):
            return False
        self._sitting_out.clear()
        for request in running:
            misses, wait = self._backoff.get(request, (0, 0))
            if wait:
                self._backoff[request] = (misses, wait - 1)
                self._sitting_out.add(request.request_id)
        return len(self._sitting_out) < len(running)

    def propose(self, running: list[Request]) -> None:
        """Sets the guesses of each running request whose next step samples its next token
        from one known token (a decode step)."""
        asking = [r for r in running if self._may_guess(r)]
        if not asking:
            return
        for request, guesses in zip(asking, self.proposer.propose(asking, self.k), strict=True):
            guesses = list(guesses[: self.k])
            if guesses and request.grammar is not None:  # what the grammar refuses is never kept
                del guesses[request.grammar.valid_prefix(guesses) :]
            request.spec_token_ids = guesses
            if not guesses:
                self._missed(request)

    def _may_guess(self, request: Request) -> bool:
        """A decoding request, unless it is an n > 1 request before it forks, or sits out
        after a miss (`active` decides who does, each step)."""
        return not (
            request.status is not RequestStatus.RUNNING
            or request.num_computed_tokens != request.num_tokens - 1
            or request.num_pending_tokens
            or request.awaits_fork
            or request.request_id in self._sitting_out
        )

    def _missed(self, request: Request) -> None:
        """Guesses that all failed, or none found: sit out one step more than last time."""
        misses = self._backoff.get(request, (0, 0))[0] + 1
        self._backoff[request] = (misses, min(misses, _BACKOFF_CAP))

    def record(
        self, so: SchedulerOutput, requests: list[Request], result: ModelRunnerOutput
    ) -> None:
        """Counts a step's verified guesses (`requests`: the step's, in its order) and sets
        the back-off of requests whose guesses all failed; hands the proposer the result."""
        observe = getattr(self.proposer, "observe", None)
        if observe is not None:
            observe(result)
        sampled = result.sampled_token_ids
        for item, request in zip(so.scheduled, requests, strict=True):
            tokens = sampled.get(item.request_id)
            if not item.spec_token_ids or not tokens:
                continue
            accepted = len(tokens) - 1
            stats = self.stats
            stats.num_drafts += 1
            stats.num_draft_tokens += len(item.spec_token_ids)
            stats.num_accepted_tokens += accepted
            for position in range(accepted):
                stats.accepted_per_position[position] += 1
            if accepted:
                self._backoff.pop(request, None)
            else:
                self._missed(request)
