"""The engine: add requests, step, get outputs. Everything else hangs off this loop.

    add_request -> Scheduler.schedule -> ModelRunner.execute -> Scheduler.update
                -> detokenize, stop strings -> RequestOutput

With async scheduling (the default on CUDA) a step overlaps the host with the device:

    host:    schedule N+1 | launch N+1 | wait for N, update N, outputs of N | schedule N+2 ...
    device:  ... step N ...............| step N+1 ..........................| step N+2 ...

Step N+1 is scheduled before step N's tokens reach the host; its decode inputs are those
tokens, read on the device. A request that step N finishes still runs in step N+1 unless
its length limit was known in advance; that extra token is dropped. A step that speculates
(engine/speculative.py) guesses from the newest tokens, so it waits for step N first.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Iterable

from octavo.config import CacheConfig, SchedulerConfig
from octavo.core.hybrid_kv import kv_cache_manager
from octavo.core.request import Request, RequestStatus
from octavo.core.sched_output import SchedulerOutput
from octavo.core.scheduler import Scheduler
from octavo.engine.driven import DrivenSequences
from octavo.engine.engine_stats import EngineStats, engine_stats
from octavo.engine.output_processor import OutputProcessor
from octavo.engine.prompts import check_prompt_ids, request_id_list, tokenize_prompt
from octavo.engine.speculative import Speculator
from octavo.engine.structured_output import (
    Grammar,
    GrammarBitmaskBuilder,
    GrammarCompiler,
    accept_tokens,
)
from octavo.outputs import RequestOutput
from octavo.runner.interface import Runner
from octavo.runner.outputs import ModelRunnerOutput, PendingOutput
from octavo.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from octavo.tokenizer.tokenizer import encode_text


class Engine(DrivenSequences):
    """Drives one model: owns the runner, the KV cache manager and the scheduler.

    Not thread-safe: one caller steps it (LLM.generate, or the server's engine loop).
    """

    def __init__(
        self,
        runner: Runner,
        tokenizer,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        num_kv_blocks: int,
        eos_token_ids: list[int],
        async_scheduling: bool = False,
        compute_mode: tuple[object, bool] | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """compute_mode: the (torch) dtype of the forward's products, and whether a token's
        result is independent of the batch (kernels/cpu.compute_mode); by default the
        runner's dtype, and no. speculator: speculative decoding's guesses, made from the
        newest tokens on the host (a step that speculates waits for the one in flight)."""
        self.speculator = speculator
        self.runner = runner
        self.compute_dtype, self.batch_invariant = compute_mode or (runner.dtype, False)
        self.tokenizer = tokenizer
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.vocab_size = runner.vocab_size
        self.kv = kv_cache_manager(num_kv_blocks, cache_config, scheduler_config)
        sliding, caches = getattr(self.kv, "sliding", None), getattr(runner, "kv_caches", None)
        if sliding is not None and caches:  # the runner sized its sliding caches the same way
            assert min(c.shape[1] for c in caches) == sliding.num_total_blocks + 1
        lookahead = 0 if speculator is None else speculator.num_lookahead_tokens
        self.scheduler = Scheduler(
            scheduler_config, self.kv, eos_token_ids, accept_tokens, lookahead
        )
        self.stats = EngineStats()
        self.outputs = OutputProcessor(tokenizer)
        self.async_scheduling = async_scheduling
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # built with the first constraint
        self._bitmasks = GrammarBitmaskBuilder(self.vocab_size, runner.pin_host_memory)

    # ---- requests ---------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        max_logprobs: int = MAX_LOGPROBS,
    ) -> Request:
        """Tokenizes and validates a prompt, then queues it. Raises ValueError for a bad
        prompt or parameters; the engine is untouched then. `max_logprobs`: the most top
        log-probs the request may ask for (beam search asks for more than users may)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        # The request's own copy, as in vLLM: the caller may change or reuse theirs. validate()
        # (again: a field may have been assigned since construction) rebuilds its lists.
        params = copy.copy(params)
        params.validate(max_logprobs)
        max_model_len = self.scheduler_config.max_model_len
        text, token_ids = tokenize_prompt(
            self.tokenizer, prompt, params.prompt_tokens_kept(max_model_len)
        )
        check_prompt_ids(token_ids, max_model_len, self.vocab_size)
        if (params.stop or params.bad_words) and self.tokenizer is None:
            field = "stop strings" if params.stop else "bad_words"
            raise ValueError(f"{field} need a tokenizer, and this model has none")
        if params.bad_words:
            encode = functools.partial(encode_text, self.tokenizer, what="bad_words")
            params.encode_bad_words(encode, self.vocab_size)
        params.set_eos_token_ids(self.scheduler.stops.eos_token_ids)
        params.check_token_ids(self.vocab_size)
        grammar = self._compile_grammar(params)
        request_id = str(next(self._ids)) if request_id is None else request_id
        self._check_new_id(request_id, params.n)
        request = Request(request_id, token_ids, params, prompt=text)
        request.grammar = grammar
        self.outputs.add(request)
        self.scheduler.add_request(request)
        return request

    def _compile_grammar(self, params: SamplingParams) -> Grammar | None:
        """The request's structured-output constraint, compiled; None without one."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer, and this model has none")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars.compile(params.structured_outputs)

    def _check_new_id(self, request_id: object, n: int) -> None:
        """ValueError unless `request_id` is a str that no request, group or sample in the
        engine uses or will use: an n > 1 request `q` names its samples `q#1`, `q#2`, ..."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        out = self.outputs
        taken = request_id in self.scheduler.requests or out.has_sequence(request_id)
        taken = taken or out.has_group(request_id)
        base, _, index = request_id.rpartition("#")
        if not taken and index.isdecimal() and index == str(int(index)) and out.has_group(base):
            n_base = max(m.sampling_params.n for m in out.members(base))  # before it forks
            taken = 1 <= int(index) < n_base  # the id of a sample not forked yet
        if taken or any(out.has_sequence(f"{request_id}#{i}") for i in range(1, n)):
            raise ValueError(f"request_id {request_id!r} is already in use")

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Aborts requests by the ids add_request returned (unknown ids are ignored), with
        all their sequences; their KV blocks are freed at once."""
        outputs = []
        for group_id in request_id_list(request_ids):
            members = self.outputs.members(group_id)
            self.scheduler.abort_requests([m.request_id for m in members])
            if members:
                outputs.append(self.outputs.make_output(group_id))
        return outputs

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished (a step in flight for finished requests only
        is finished by the next step() or dropped)."""
        return self.scheduler.has_unfinished_requests()

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step and returns an output for each request that got a token (finished
        ones marked finished), as its `output_kind` asks: FINAL_ONLY requests only once
        they finish.

        With async scheduling the outputs are those of the previous step, while this one
        runs on the device; a step with nothing new to schedule just finishes the one in
        flight.
        """
        speculates = self.speculator is not None and self.speculator.active(self.scheduler)
        if not self.async_scheduling:
            if speculates:
                self.speculator.propose(self.scheduler.running)
            so = self.scheduler.schedule()
            if so.is_empty:
                return []
            return self._finish(so, self._launch(so, grammars_current=True))
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and (speculates or self.scheduler.needs_pending_tokens()):
            in_flight, self._in_flight = self._in_flight, None  # finished once, even if it fails
            outputs = self._finish(*in_flight)
        if speculates:
            self.speculator.propose(self.scheduler.running)
        so = self.scheduler.schedule()
        grammars_current = self._in_flight is None
        launched = None if so.is_empty else (so, self._launch(so, grammars_current))
        held = launched is not None and so.structured_request_ids and not grammars_current
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            try:
                taken = self._take_tokens(*in_flight)
            except Exception:
                if launched is not None:  # it may read the failed step's tokens: drop it
                    self._fail(launched[0])
                raise
            if held:
                # The grammars have taken the finished step's tokens: sample the launched
                # step, while its forward pass runs, before making the finished step's text.
                try:
                    self._sample_held(so)
                except Exception:
                    # The tokens are appended but have no text or output yet: abort their
                    # requests, so that none finishes without an output or runs on with a
                    # gap in its text.
                    self.abort_request(list(dict.fromkeys(r.group_id for r in taken[1])))
                    raise
            outputs += self._make_outputs(*taken)
        self._in_flight = launched
        return outputs

    def _launch(self, so: SchedulerOutput, grammars_current: bool) -> PendingOutput:
        """Queues a step on the runner (its forward pass), then its sampling: at once, under
        its structured outputs' bitmask if it has any, when the grammars have taken every
        earlier token; else the step is held, and `_sample_held` samples it later."""
        try:
            pending = self.runner.execute_async(so)
            if not so.structured_request_ids:
                self.runner.sample_tokens(None)
            elif grammars_current:
                self.runner.sample_tokens(self._grammar_bitmask(so))
            return pending
        except Exception:
            self._fail(so)
            raise

    def _sample_held(self, so: SchedulerOutput) -> None:
        try:
            self.runner.sample_tokens(self._grammar_bitmask(so))
        except Exception:
            self._fail(so)
            raise

    def _grammar_bitmask(self, so: SchedulerOutput):
        requests = self.scheduler.requests
        ids = so.structured_request_ids
        grammars = [requests[request_id].grammar for request_id in ids]
        guesses = None
        if self.speculator is not None:  # a mask for each guess too
            spec = {s.request_id: s.spec_token_ids for s in so.scheduled if s.spec_token_ids}
            guesses = [spec.get(request_id, []) for request_id in ids]
        return self._bitmasks.build(ids, grammars, guesses)

    def _fail(self, so: SchedulerOutput) -> None:
        # NOTE: blocks registered in the prefix cache this step may hold garbage now. A held
        # step exists only between its launch and its sampling in one step(): when anything
        # fails there, it is never sampled.
        self.runner.cancel_held()
        requests = self.scheduler.drop_step(so)
        self.abort_request(list({r.group_id: None for r in requests}))
        self.kv.reset_prefix_cache()

    def _finish(self, so: SchedulerOutput, pending: PendingOutput) -> list[RequestOutput]:
        """Waits for a launched step's tokens, appends them, decides stops, makes outputs."""
        return self._make_outputs(*self._take_tokens(so, pending))

    def _take_tokens(
        self, so: SchedulerOutput, pending: PendingOutput
    ) -> tuple[ModelRunnerOutput, list[Request], list[RequestStatus | None]]:
        """Waits for a launched step's tokens and appends them; feeds the structured
        outputs' grammars. Returns the result, the requests that got a token, and the
        status each token's own rules give it (see StopChecker)."""
        try:
            result = pending.result()
        except Exception:
            self._fail(so)
            raise
        self.stats.num_steps += 1
        self.stats.num_tokens_computed += so.num_batched_tokens
        if result.prompt_logprobs:
            # The scheduled request itself: an id may have been reused meanwhile.
            for item, request in zip(so.scheduled, self.scheduler.requests_of(so), strict=True):
                found = result.prompt_logprobs.get(item.request_id)
                if found is not None and not request.is_finished:
                    self.outputs.process_prompt_logprobs(request, *found)
        if self.speculator is not None:
            self.speculator.record(so, self.scheduler.requests_of(so), result)
        updated = self.scheduler.update(so, result.sampled_token_ids)
        statuses = self.scheduler.stops.check_tokens(updated)
        return result, updated, statuses

    def _make_outputs(
        self,
        result: ModelRunnerOutput,
        updated: list[Request],
        statuses: list[RequestStatus | None],
    ) -> list[RequestOutput]:
        """Text and stop strings of the new tokens; finishes the requests that stop.

        A step that verified speculative guesses may give a request several tokens: the
        scheduler appended the first, and each later one is appended and checked in a round
        of its own (`position`), so that nothing after a stop is taken."""
        groups: dict[str, RequestOutputKind] = {}
        position = 0
        while updated:
            self._process_tokens(result, updated, statuses, position, groups)
            updated = [r for r in updated if r.held_token_ids and not r.is_finished]
            for request in updated:
                request.append_output_token(request.held_token_ids.pop(0))
            statuses = self.scheduler.stops.check_tokens(updated)
            position += 1
        return [
            self.outputs.make_output(group_id)
            for group_id, kind in groups.items()
            if kind is not RequestOutputKind.FINAL_ONLY or self.outputs.is_finished(group_id)
        ]

    def _process_tokens(
        self,
        result: ModelRunnerOutput,
        updated: list[Request],
        statuses: list[RequestStatus | None],
        position: int,
        groups: dict[str, RequestOutputKind],
    ) -> None:
        """The text, log-probs and stop strings of each request's newest token, which is its
        `position`-th of the step; notes in `groups` whose output to make."""
        self.stats.num_generated_tokens += len(updated)
        found = result.logprobs  # request or group id -> log-prob entries
        check_text = self.scheduler.stops.check_text
        for request, status in zip(updated, statuses, strict=True):
            if request.is_finished:
                request.held_token_ids = []
                continue  # aborted meanwhile
            rid, gid = request.request_id, request.group_id
            logprobs = (found.get(rid) or found.get(gid)) if found else None
            if logprobs and (position or request.held_token_ids):  # one per token
                logprobs = logprobs[position : position + 1]
            stop = self.outputs.process_token(request, logprobs, status)
            status = check_text(request, status, stop)
            if status is not None:
                self.scheduler.finish_request(request.request_id, status)
            kind = request.sampling_params.output_kind
            if status is not None or kind is not RequestOutputKind.FINAL_ONLY:
                groups[request.group_id] = kind  # a FINAL_ONLY group ends with a member

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any; the engine cannot step afterwards."""
        self.runner.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block not in use; True if the prefix cache is now empty."""
        return self.kv.reset_prefix_cache()

    def release_kv_memory(self) -> int:
        """Where the KV cache is in host memory (the CPU): forgets the prefix cache's unused
        blocks and gives every free block's memory back to the system, for an engine that
        went idle (engine_loop.IdleRelease). Returns the bytes given back (0 where unknown)."""
        if self.runner.device.type != "cpu":
            return 0
        self.kv.reset_prefix_cache()
        return self.runner.release_kv_blocks(self.kv.free_block_ids())

    @property
    def eos_token_ids(self) -> list[int]:
        """The model's EOS ids (the stop rules own them)."""
        return list(self.scheduler.stops.eos_token_ids)

    # ---- stats ------------------------------------------------------------------------

    def get_stats(self) -> dict[str, int | float | str | list]:
        """Counters for users and metrics (engine/engine_stats.py lists them)."""
        return engine_stats(self)
