"""The scheduler: which requests run this step, and how many tokens each computes.

One rule covers prefill, chunked prefill, decode and prefix-cache hits: every request has
`num_computed_tokens` and `num_tokens`, and a step lets computed catch up with total under
two budgets, `max_num_batched_tokens` tokens and `max_num_seqs` sequences. Running requests
go first (oldest first); waiting requests are admitted only if nobody had to be preempted
this step. Beside other requests, a running prompt's chunk takes at most half the token
budget, so that a long prefill lets the others (new ones too) into every step. When the KV
cache runs out of blocks, the newest running request is preempted by recompute: it frees its
blocks and goes back to the front of the waiting queue.

Tokens count as computed once scheduled. With async scheduling the engine schedules step
N+1 while step N runs: a request that samples in step N has a pending token
(`num_pending_tokens`), which step N+1 already takes as input, on the device.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from octavo.config import SchedulerConfig
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.request import Request, RequestStatus
from octavo.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from octavo.core.stop import AcceptTokens, StopChecker, accept_each
from octavo.sampling_params import SamplingParams


class Scheduler:
    """Owns the waiting queue and the running list; plain Python, no torch."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        eos_token_ids: Iterable[int] = (),
        accept_tokens: AcceptTokens = accept_each,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """num_lookahead_tokens: KV slots reserved past a sampling step's tokens, where a
        draft model writes the KV of its guesses."""
        self.config = config
        self.num_lookahead_tokens = num_lookahead_tokens
        self.stops = StopChecker(eos_token_ids, config.max_model_len, accept_tokens)
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        self._scoring_prompts: set[str] = set()  # requests that asked for prompt log-probs
        # Requests that may need their newest token on the host before their next step
        # (see needs_pending_tokens): few, so a step need not ask every running request.
        self._host_token_readers: set[Request] = set()
        # The requests of each step not yet updated, by step id: the output holds only ids,
        # and an id may be reused by a new request before its step is updated.
        self._steps: dict[int, list[Request]] = {}
        self._step_ids = itertools.count()

    # ---- queue management -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.sampling_params.prompt_logprobs is not None:
            self._scoring_prompts.add(request.request_id)
        self._note_host_token_reader(request)

    def _note_host_token_reader(self, request: Request) -> None:
        params = request.sampling_params
        request.reads_output_tokens = params.needs_output_token_ids
        if params.n > 1 or request.reads_output_tokens:
            self._host_token_readers.add(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Removes a request (finished or aborted) and frees its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self._finished_ids.append(request_id)
        self._scoring_prompts.discard(request_id)
        self._host_token_readers.discard(request)
        return request

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = [self.finish_request(rid, RequestStatus.FINISHED_ABORTED) for rid in request_ids]
        return [r for r in aborted if r is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- scheduling -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Picks this step's work. See the module docstring for the rule."""
        budget = self.config.max_num_batched_tokens
        new_requests: list[NewRequestData] = []
        scheduled, preempted, budget = self._schedule_running(budget, new_requests)
        if not preempted:
            scheduled += self._schedule_waiting(budget, new_requests)
        finished, self._finished_ids = self._finished_ids, []
        step_id = next(self._step_ids)
        requests = [self.requests[s.request_id] for s in scheduled]
        if requests:
            self._steps[step_id] = requests
        structured = [r.request_id for r in requests if r.grammar is not None]
        return SchedulerOutput(
            step_id,
            new_requests,
            scheduled,
            preempted,
            self.kv.take_pending_copies(),
            finished,
            bool(self._scoring_prompts),
            structured,
            self.kv.take_pending_sliding_copies(),
        )

    def requests_of(self, so: SchedulerOutput) -> list[Request]:
        """The requests a step scheduled, in its order, until `update` (or `drop_step`)."""
        return self._steps.get(so.step_id, [])

    def drop_step(self, so: SchedulerOutput) -> list[Request]:
        """Forgets a step that will not be updated (it failed); returns its requests."""
        return self._steps.pop(so.step_id, [])

    def _schedule_running(
        self, budget: int, new_requests: list[NewRequestData]
    ) -> tuple[list[ScheduledRequest], list[str], int]:
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        i = 0
        # NOTE: forks (n > 1, beam search) join `running` past max_num_seqs; the step still
        # takes at most that many, the oldest first, and the rest wait for a later step.
        max_seqs = self.config.max_num_seqs
        while i < len(self.running) and budget > 0 and len(scheduled) < max_seqs:
            request = self.running[i]
            total = len(request.all_token_ids) + request.num_pending_tokens
            num_new = min(total - request.num_computed_tokens, budget)
            if num_new > 1 and (self.waiting or len(self.running) > 1):  # leave the others room
                num_new = min(num_new, max(1, self.config.max_num_batched_tokens // 2))
            if num_new == 0 or (
                request.num_pending_tokens and self.stops.finishes_at(request, total)
            ):
                # Caught up and waiting for a token from outside (beam search), or sure to
                # finish with the token in flight: nothing to compute.
                i += 1
                continue
            # Guesses take only budget that the requests after this one do not need.
            others = min(len(self.running) - i - 1, max_seqs - len(scheduled) - 1)
            spec = self._guesses(request, num_new, total, budget - others)
            extra = len(spec) + self._lookahead(request, num_new + len(spec), total)
            if extra and not self.kv.allocate_slots(request, num_new + extra):
                spec = []  # no blocks for the guesses and the lookahead: a plain step
            while not self.kv.allocate_slots(request, num_new + len(spec)):
                victim = self.running.pop()  # newest admitted goes first
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # it preempted itself: nobody after it can run either
            scheduled.append(self._make_scheduled(request, num_new, new_requests, spec))
            budget -= num_new + len(spec)
            i += 1
        return scheduled, preempted, budget

    def _guesses(self, request: Request, num_new: int, total: int, budget: int) -> list[int]:
        """Takes the request's speculative guesses for this step: only if the step samples
        its next token, and no more than the budget left after its `num_new` tokens, nor
        than max_tokens or the context lets it emit (a step emits the guesses it keeps and
        one token more)."""
        spec = request.spec_token_ids
        if not spec:  # the common case, every step: nothing to take
            return spec
        request.spec_token_ids = []
        if request.num_computed_tokens + num_new != total:
            return []
        return spec[: self._num_spec_tokens(request, total, budget - num_new)]

    def _lookahead(self, request: Request, num_new: int, total: int) -> int:
        """Slots a draft model may fill past a step that samples, within the context."""
        end = request.num_computed_tokens + num_new
        if not self.num_lookahead_tokens or end < total:
            return 0
        return max(min(self.num_lookahead_tokens, self.config.max_model_len - end), 0)

    def _num_spec_tokens(self, request: Request, total: int, budget: int) -> int:
        room = min(budget, self.config.max_model_len - total - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - (total - request.num_prompt_tokens) - 1)
        return max(room, 0)

    def _schedule_waiting(
        self, budget: int, new_requests: list[NewRequestData]
    ) -> list[ScheduledRequest]:
        scheduled: list[ScheduledRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending_tokens:
                break  # preempted with a token in flight: admit it once the token is here
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(request, num_new, hit_blocks):
                break  # out of blocks: wait for running requests to finish
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
            self.running.append(request)
            scheduled.append(self._make_scheduled(request, num_new, new_requests))
            budget -= num_new
        return scheduled

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.sent_block_ids = None  # the runner drops its state of a preempted request
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _make_scheduled(
        self,
        request: Request,
        num_new: int,
        new_requests: list[NewRequestData],
        spec_token_ids: list[int] | None = None,
    ) -> ScheduledRequest:
        """Describes the request's share of the step (and the request itself, to a runner
        that holds no state for it) and counts its tokens as computed, guesses included
        (`update` takes back those the step rejects)."""
        start = request.num_computed_tokens
        all_token_ids = request.all_token_ids
        num_known = len(all_token_ids)
        pending = request.num_pending_tokens
        token_ids = all_token_ids[start : start + num_new]
        sample = start + num_new == num_known + pending
        request.num_computed_tokens = start + num_new + len(spec_token_ids or ())
        if sample:
            request.num_pending_tokens = pending + 1
        outputs = request.output_token_ids
        # NOTE: the KV cache manager's list grows in place and is replaced when an entry
        # changes, so the list sent before, if it is the same object, needs only its tail.
        block_ids = self.kv.get_block_ids(request.request_id)
        if request.sent_block_ids is None:
            params = request.sampling_params
            new_requests.append(
                NewRequestData(request.request_id, request.prompt_token_ids, list(outputs), params)
            )
            request.num_sent_outputs = len(outputs)
        blocks_start = request.num_sent_blocks if request.sent_block_ids is block_ids else 0
        new_blocks = block_ids[blocks_start:]
        request.sent_block_ids, request.num_sent_blocks = block_ids, len(block_ids)
        sliding_ids = self.kv.get_sliding_block_ids(request.request_id)
        new_sliding = [] if sliding_ids is None else sliding_ids[blocks_start : len(block_ids)]
        new_outputs: list[int] = []
        if request.reads_output_tokens and request.num_sent_outputs < len(outputs):
            new_outputs = outputs[request.num_sent_outputs :]
            request.num_sent_outputs = len(outputs)
        return ScheduledRequest(
            request.request_id,
            token_ids,
            start,
            sample,
            len(token_ids) < num_new,
            num_known - len(request.prompt_token_ids) + pending,
            blocks_start,
            new_blocks,
            new_outputs,
            spec_token_ids or [],
            new_sliding,
        )

    def needs_pending_tokens(self) -> bool:
        """True if some running request cannot be scheduled before its pending token is on
        the host: the first token of an n > 1 request forks it, and penalties and bad words
        read output tokens on the host. The engine then finishes the step in flight first."""
        return any(
            r.status is RequestStatus.RUNNING
            and r.num_pending_tokens
            and (r.awaits_fork or r.sampling_params.needs_output_token_ids)
            for r in self._host_token_readers
        )

    # ---- after the step ---------------------------------------------------------------

    def update(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[Request]:
        """Appends the step's sampled tokens, forking n > 1 requests at their first token.
        Returns the requests that got a new token, new forks included; the engine then
        decides their stops (`self.stops`) and finishes them. A step that verified guesses
        may give a request several tokens: the first is appended, the others wait in
        `held_token_ids` for the engine, which appends them one at a time (any may stop the
        request); the rejected guesses no longer count as computed.

        NOTE: a request preempted after this step was scheduled still gets its token (it
        was sampled from its whole context); one finished or aborted meanwhile does not.
        """
        updated: list[Request] = []
        requests = self._steps.pop(output.step_id, ())
        for item, request in zip(output.scheduled, requests, strict=True):
            if item.sample:
                request.num_pending_tokens -= 1
            if request.is_finished:
                continue
            tokens = sampled_token_ids.get(item.request_id)
            if not tokens:
                continue
            if request.awaits_fork:
                group = self._fork(request, tokens)
                for member, token in zip(group, tokens, strict=True):
                    member.append_output_token(token)
                updated += group
            else:
                if item.spec_token_ids and request.status is RequestStatus.RUNNING:
                    # The KV of rejected guesses is overwritten by later steps.
                    num_rejected = len(item.spec_token_ids) + 1 - len(tokens)
                    request.num_computed_tokens -= num_rejected
                request.append_output_token(tokens[0])
                request.held_token_ids = tokens[1:]
                updated.append(request)
        return updated

    def _fork(self, parent: Request, tokens: list[int]) -> list[Request]:
        """Splits an n > 1 request into n sequences sharing the prompt's KV blocks; the
        parent becomes completion 0. Returns the n sequences in index order."""
        params = parent.sampling_params
        group = [parent]
        for index in range(1, len(tokens)):
            child = self.fork_request(
                parent, f"{parent.request_id}#{index}", params.for_sample(index)
            )
            child.index = index
            group.append(child)
        parent.sampling_params = params.for_sample(0)
        parent.sent_block_ids = None  # the runner takes it anew, with its new params
        self._host_token_readers.discard(parent)  # n = 1 now: it stays if it reads its tokens
        self._note_host_token_reader(parent)
        return group

    def fork_request(
        self, parent: Request, child_id: str, params: SamplingParams | None = None
    ) -> Request:
        """A copy of a request: same tokens and, if the parent is running, the same computed
        KV with every block shared by ref count (a shared partial block is copied on its
        first write). Used for n > 1 and beam search; the child joins the parent's group."""
        if child_id in self.requests:
            raise ValueError(f"request_id {child_id!r} is already in use")
        params = params or parent.sampling_params
        child = Request(child_id, parent.prompt_token_ids, params, prompt=parent.prompt)
        for token in parent.output_token_ids:
            child.append_output_token(token)
        if parent.grammar is not None:  # it has taken those tokens already
            child.grammar = parent.grammar.fork()
        child.group_id = parent.group_id
        child.num_cached_tokens = parent.num_cached_tokens
        self.requests[child_id] = child
        self._note_host_token_reader(child)
        if parent.status != RequestStatus.RUNNING:
            # A preempted parent holds no blocks: the child recomputes, like its parent will.
            child.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(child)
            return child
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.kv.fork(parent, child)
        self.running.append(child)
        return child
