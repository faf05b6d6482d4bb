"""The scheduler: which requests run this step, and how many tokens each computes.

One rule covers prefill, chunked prefill, decode and prefix-cache hits: every request has
`num_computed_tokens` and `num_tokens`, and a step lets computed catch up with total under
two budgets, `max_num_batched_tokens` tokens and `max_num_seqs` sequences. Running
requests go first (oldest first); waiting requests are admitted only if nobody had to be
preempted this step. When the KV cache runs out of blocks, the newest running request is
preempted by recompute: it frees its blocks and goes back to the front of the waiting queue.

Tokens count as computed once scheduled. With async scheduling the engine schedules step
N+1 while step N runs: a request that samples in step N has a pending token
(`num_pending_tokens`), which step N+1 already takes as input, on the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

from octavo.config import SchedulerConfig
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.request import Request, RequestStatus
from octavo.engine.structured_output import accept_tokens
from octavo.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute `num_new_tokens` tokens, which sit at positions
    `num_computed_tokens ..` of its sequence, into the blocks `block_ids`.

    NOTE: with async scheduling the last new token may be one that the previous step is
    still sampling on the device (`input_is_pending`); `token_ids` then holds only the
    tokens known on the host, and the runner takes the pending one from the device.
    `block_ids` is the KV cache manager's live list: read it before the next schedule().
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    # True when this step reaches the request's last token, so it samples the next one.
    sample: bool
    request: Request = field(repr=False)
    input_is_pending: bool = False

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) + int(self.input_is_pending)

    @property
    def seq_len(self) -> int:
        return self.num_computed_tokens + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """A plain description of one step, passed to the model runner."""

    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str] = field(default_factory=list)
    # (source, destination) KV blocks to copy before the forward pass (copy-on-write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Requests finished since the previous step, so runner-side state can be dropped.
    finished_request_ids: list[str] = field(default_factory=list)
    # Whether a live request asked for prompt log-probs: else the runner looks for none.
    scores_prompts: bool = False

    @cached_property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue and the running list; plain Python, no torch."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
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
        if params.n > 1 or params.needs_output_token_ids:
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

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- scheduling -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Picks this step's work. See the module docstring for the rule."""
        budget = self.config.max_num_batched_tokens
        scheduled, preempted, budget = self._schedule_running(budget)
        if not preempted:
            scheduled += self._schedule_waiting(budget)
        finished, self._finished_ids = self._finished_ids, []
        copies = self.kv.take_pending_copies()
        return SchedulerOutput(scheduled, preempted, copies, finished, bool(self._scoring_prompts))

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledRequest], list[str], int]:
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
            if num_new == 0 or (request.num_pending_tokens and self._finishes_at(request, total)):
                # Caught up and waiting for a token from outside (beam search), or sure to
                # finish with the token in flight: nothing to compute.
                i += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()  # newest admitted goes first
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # it preempted itself: nobody after it can run either
            scheduled.append(self._make_scheduled(request, num_new))
            budget -= num_new
            i += 1
        return scheduled, preempted, budget

    def _schedule_waiting(self, budget: int) -> list[ScheduledRequest]:
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
            scheduled.append(self._make_scheduled(request, num_new))
            budget -= num_new
        return scheduled

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _make_scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        """Describes the request's share of the step and counts its tokens as computed."""
        start = request.num_computed_tokens
        token_ids = request.all_token_ids[start : start + num_new]
        sample = start + num_new == len(request.all_token_ids) + request.num_pending_tokens
        request.num_computed_tokens = start + num_new
        if sample:
            request.num_pending_tokens += 1
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            num_computed_tokens=start,
            block_ids=self.kv.get_block_ids(request.request_id),
            sample=sample,
            request=request,
            input_is_pending=len(token_ids) < num_new,
        )

    def _finishes_at(self, request: Request, num_tokens: int) -> bool:
        """True if the request surely finishes once it has `num_tokens` tokens (max_tokens
        or the context limit). Asked with its pending tokens counted: another step for it
        would compute a token nobody reads."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and num_tokens - len(request.prompt_token_ids) >= max_tokens:
            return True
        return num_tokens >= self.config.max_model_len

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
        """Appends the step's sampled tokens (forking n > 1 requests at their first token)
        and applies the token-level stop rules. Returns the requests that got a new token,
        new forks and finished ones included.

        NOTE: a request preempted after this step was scheduled still gets its token (it
        was sampled from its whole context); one finished or aborted meanwhile does not.
        """
        updated: list[Request] = []
        constrained: list[tuple[Request, int]] = []  # (request, token) for its grammar
        for item in output.scheduled:
            request = item.request
            if item.sample:
                request.num_pending_tokens -= 1
            if request.is_finished:
                continue
            tokens = sampled_token_ids.get(item.request_id)
            if not tokens:
                continue
            group = self._fork(request, tokens) if request.awaits_fork else [request]
            for member, token in zip(group, tokens, strict=True):
                member.append_output_token(token)
                updated.append(member)
                status = self.check_stop(member)
                if status is not None:
                    self.finish_request(member.request_id, status)
                elif member.grammar is not None:
                    constrained.append((member, token))
        if constrained:
            self._advance_grammars(constrained)
        return updated

    def _advance_grammars(self, constrained: list[tuple[Request, int]]) -> None:
        """Feeds structured outputs' grammars their new tokens: a request stops once its
        grammar is complete (only EOS could follow), and is aborted if the grammar refuses
        the token (the sampler's mask allowed only tokens it takes, so that is a bug)."""
        accepted = accept_tokens([r.grammar for r, _ in constrained], [t for _, t in constrained])
        for (request, _), ok in zip(constrained, accepted, strict=True):
            if not ok:
                self.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
            elif request.grammar.is_complete:
                self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

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
        child = Request(
            child_id,
            parent.prompt_token_ids,
            params or parent.sampling_params,
            prompt=parent.prompt,
            arrival_time=parent.arrival_time,
        )
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

    def check_stop(self, request: Request) -> RequestStatus | None:
        """EOS, stop token ids, max_tokens and the context limit (stop strings need text
        and are checked by the engine's detokenizer)."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        last = request.output_token_ids[-1]
        if num_output >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self._finishes_at(request, len(request.all_token_ids)):
            return RequestStatus.FINISHED_LENGTH
        return None
