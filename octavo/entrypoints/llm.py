"""The offline API: LLM(...).generate / .chat, as in vLLM."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from tqdm.auto import tqdm

from octavo.engine.beam_search import BeamSearchParams, beam_search
from octavo.engine.builder import build_engine
from octavo.engine.gc_heap import frozen_gc_heap
from octavo.outputs import BeamSearchOutput, RequestOutput
from octavo.sampling_params import RequestOutputKind, SamplingParams
from octavo.tokenizer.tokenizer import apply_chat_template

PromptType = str | dict[str, Any] | list[int]
Conversation = list[dict[str, Any]]


class LLM:
    """An engine for offline batched generation.

    `LLM()` loads the embedded SmolLM2-135M-Instruct; the README's table lists every option.
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.engine = build_engine(model, **options)
        self._request_ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any (they also stop when this process
        exits)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates completions for all prompts and returns them in input order.

        prompts: a str, a list of str, a list of {"prompt_token_ids": [...]}, or a list of
            token-id lists.
        sampling_params: one for all prompts, or one per prompt (default SamplingParams()).
        Raises ValueError for a bad prompt or parameters before anything runs.
        """
        prompt_list = _normalize_prompts(prompts)
        params = _normalize_params(sampling_params, len(prompt_list))
        ids = self._add_all(prompt_list, params)
        return self._run(ids, params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them, then
        generates. A conversation is a list of {"role": ..., "content": ...}.
        `continue_final_message` (with add_generation_prompt=False) has the model continue
        the last message instead of starting a new turn, as in vLLM. `tools` (OpenAI's
        function definitions) and `chat_template_kwargs` (e.g. {"enable_thinking": False})
        go to the template (`chat_template`, else the model's); the text comes back as the
        model wrote it."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template, and this model has none")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of conversations or messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [
            apply_chat_template(
                tokenizer,
                conv,
                add_generation_prompt,
                continue_final_message,
                tools=tools,
                template_kwargs=chat_template_kwargs,
                chat_template=chat_template,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)  # lists of token ids

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search (HF transformers' selection rules, vLLM's API), all prompts batched
        in the same steps; the beams of a prompt share KV blocks copy-on-write.

        prompts: as in generate. Returns one BeamSearchOutput per prompt, in input order,
        its sequences best first. Raises ValueError for bad prompts or params.
        """
        prompt_inputs = [_prompt_input(p) for p in _normalize_prompts(prompts)]
        prefix = f"llm-{next(self._request_ids)}"
        with frozen_gc_heap():
            return beam_search(self.engine, prompt_inputs, params, use_tqdm, id_prefix=prefix)

    def get_stats(self) -> dict[str, int | float | str]:
        """Engine counters: num_preemptions, prefix_cache_queries / prefix_cache_hits
        (tokens), kv_blocks_total / kv_blocks_free, and throughput counters; kv_cache_dtype."""
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix not in use, as vLLM's `LLM.reset_prefix_cache`; True if
        the prefix cache is now empty."""
        return self.engine.reset_prefix_cache()

    def _add_all(self, prompts: list[PromptType], params: list[SamplingParams]) -> list[str]:
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id = f"llm-{next(self._request_ids)}"
                self.engine.add_request(_prompt_input(prompt), p, request_id)
                ids.append(request_id)
        except ValueError:
            self.engine.abort_request(ids)  # all or nothing: drop what was queued
            raise
        return ids

    def _run(
        self, request_ids: list[str], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _TokenProgress(request_ids, params, disable=not use_tqdm)
        first_token = self.engine.stats.num_generated_tokens
        try:
            with frozen_gc_heap():
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        finished[out.request_id] = out
                        bar.finish_request(out)
                    bar.show(self.engine.stats.num_generated_tokens - first_token)
        except BaseException:
            self.engine.abort_request([rid for rid in request_ids if rid not in finished])
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]


class _TokenProgress:
    """generate()'s progress bar: output tokens against their budget (n * max_tokens per
    request, less what a request leaves unused when it stops early), the requests done
    beside it, and tqdm's live rate in tok/s. Without a max_tokens there is no total."""

    def __init__(self, request_ids: list[str], params: list[SamplingParams], disable: bool):
        self.budgets = {
            rid: None if p.max_tokens is None else p.n * p.max_tokens
            for rid, p in zip(request_ids, params, strict=True)
        }
        total = None if None in self.budgets.values() else sum(self.budgets.values())
        self.num_done = 0
        self.bar = tqdm(total=total, desc="Generating", unit="tok", disable=disable)
        self._set_postfix()

    def finish_request(self, out: RequestOutput) -> None:
        self.num_done += 1
        budget = self.budgets.get(out.request_id)
        if self.bar.total is not None and budget is not None:
            generated = sum(len(c.token_ids) for c in out.outputs)
            self.bar.total -= max(0, budget - generated)
        self._set_postfix()

    def show(self, num_tokens: int) -> None:
        """Moves the bar to `num_tokens` generated so far."""
        if self.bar.total is not None and self.num_done == len(self.budgets):
            self.bar.total = num_tokens  # all done: whatever was counted is the whole
        self.bar.update(num_tokens - self.bar.n)

    def close(self) -> None:
        self.bar.close()

    def _set_postfix(self) -> None:
        self.bar.set_postfix_str(f"requests {self.num_done}/{len(self.budgets)}", refresh=False)


def _normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(p, int) for p in prompts):
        raise ValueError('pass token ids as {"prompt_token_ids": [...]}, not a bare list of int')
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise ValueError("prompts must be a str, a list of str, or a list of dicts")
    # A list of token-id lists, as vLLM's users pass them: each one prompt's ids.
    return [{"prompt_token_ids": p} if _is_ids(p) else p for p in prompts]


def _is_ids(prompt: object) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)


def _normalize_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt, each asking for its final output only (as vLLM's LLM
    does: no output is made for a request until it finishes). The caller's are not changed."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        params = [params] * n
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
        raise ValueError(
            f"sampling_params must be SamplingParams or a list of them, got {type(params).__name__}"
        )
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
    final: dict[int, SamplingParams] = {}  # one copy per distinct object
    for p in params:
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
        if id(p) not in final:
            final[id(p)] = copy.copy(p)  # the engine validates it again as it takes it
            final[id(p)].output_kind = RequestOutputKind.FINAL_ONLY
    return [final[id(p)] for p in params]


def _prompt_input(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):  # a str here would be taken as text
                raise ValueError(
                    f"prompt_token_ids must be a list of int, got {type(ids).__name__}"
                )
            return ids
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError('a dict prompt needs "prompt_token_ids" (or "prompt")')
    raise ValueError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
