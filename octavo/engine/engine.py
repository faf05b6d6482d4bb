"""The engine: add requests, step, get outputs. Everything else hangs off this loop.

    add_request -> Scheduler.schedule -> ModelRunner.execute -> Scheduler.update
                -> detokenize, stop strings -> RequestOutput
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from octavo.config import CacheConfig, SchedulerConfig
from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.engine.kv_cache_manager import KVCacheManager
from octavo.engine.request import Request, RequestStatus
from octavo.engine.scheduler import Scheduler
from octavo.outputs import CompletionOutput, Logprob, RequestOutput
from octavo.runner.model_runner import ModelRunner, ModelRunnerOutput
from octavo.sampling_params import SamplingParams


@dataclass
class _OutputState:
    """What the engine adds to a request on its way out: text and log-probs."""

    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    text_sent: int = 0


@dataclass
class EngineStats:
    num_steps: int = 0
    num_tokens_computed: int = 0
    num_generated_tokens: int = 0
    requests_by_outcome: dict[str, int] = field(default_factory=dict)


class Engine:
    """Drives one model: owns the runner, the KV cache manager and the scheduler.

    Not thread-safe: one caller steps it (LLM.generate, or the server's engine loop).
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        num_kv_blocks: int,
        eos_token_ids: list[int],
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.vocab_size = runner.vocab_size
        self.eos_token_ids = eos_token_ids
        runner.eos_token_ids = eos_token_ids
        runner.allocate_kv_cache(num_kv_blocks)
        self.kv = KVCacheManager(
            num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(scheduler_config, self.kv, eos_token_ids)
        self.stats = EngineStats()
        self._states: dict[str, _OutputState] = {}
        self._ids = itertools.count()

    # ---- requests ---------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> Request:
        """Tokenizes and validates a prompt, then queues it. Raises ValueError for a bad
        prompt or parameters; the engine is untouched then."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params, prompt=text)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        wants_logprobs = params.logprobs is not None
        self._states[request_id] = _OutputState(
            detok, [] if wants_logprobs else None, 0.0 if wants_logprobs else None
        )
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Aborts requests (unknown ids are ignored); their KV blocks are freed at once."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        aborted = self.scheduler.abort_requests(ids)
        outputs = [self._make_output(r) for r in aborted]
        for request in aborted:
            self._finish_bookkeeping(request)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids instead")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise ValueError("a prompt must be a str or a list of int token ids")

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        max_len = self.scheduler_config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_model_len={max_len}"
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns an output for each request that got a
        token (finished ones marked finished)."""
        so = self.scheduler.schedule()
        if so.is_empty:
            return []
        try:
            result = self.runner.execute(so)
        except Exception:
            # NOTE: blocks registered in the prefix cache this step may hold garbage now.
            self.abort_request([s.request_id for s in so.scheduled])
            self.kv.reset_prefix_cache()
            raise
        self.stats.num_steps += 1
        self.stats.num_tokens_computed += so.num_batched_tokens
        updated = self.scheduler.update(so, result.sampled_token_ids)
        self.stats.num_generated_tokens += len(updated)
        outputs = []
        for request in updated:
            self._process_token(request, result)
            outputs.append(self._make_output(request))
            if request.is_finished:
                self._finish_bookkeeping(request)
        return outputs

    def _process_token(self, request: Request, result: ModelRunnerOutput) -> None:
        state = self._states[request.request_id]
        token = request.output_token_ids[-1]
        entries = result.logprobs.get(request.request_id)
        if state.logprobs is not None and entries is not None:
            state.logprobs.append(
                {t: Logprob(lp, rank, self._decode_one(t)) for t, lp, rank in entries}
            )
            state.cumulative_logprob += entries[0][1]
        if state.detokenizer is None:
            return
        stop = state.detokenizer.update([token])
        if stop is not None and not request.is_finished:
            request.stop_reason = stop
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _make_output(self, request: Request) -> RequestOutput:
        state = self._states[request.request_id]
        finished = request.is_finished
        text = ""
        if state.detokenizer is not None:
            text = state.detokenizer.get_next_output_text(finished, delta=False)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=state.logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _finish_bookkeeping(self, request: Request) -> None:
        self._states.pop(request.request_id, None)
        reason = request.status.finish_reason or "unknown"
        by_outcome = self.stats.requests_by_outcome
        by_outcome[reason] = by_outcome.get(reason, 0) + 1

    # ---- stats ------------------------------------------------------------------------

    def get_stats(self) -> dict[str, int | float]:
        """Counters for users and metrics: preemptions, prefix-cache queries and hits (in
        tokens), KV blocks, queue lengths and throughput counters."""
        return {
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "kv_blocks_total": self.kv.num_total_blocks,
            "kv_blocks_free": self.kv.num_free_blocks,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_steps": self.stats.num_steps,
            "num_tokens_computed": self.stats.num_tokens_computed,
            "num_generated_tokens": self.stats.num_generated_tokens,
        }
