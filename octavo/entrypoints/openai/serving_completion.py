"""POST /v1/completions: prompts (text or token ids) in, completions out, whole or streamed."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from octavo.entrypoints.openai.choices import (
    ChoiceTracker,
    completion_logprobs,
    prompt_logprobs_field,
)
from octavo.entrypoints.openai.limits import check_num_prompts
from octavo.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from octavo.entrypoints.openai.request_params import reject_unsupported, sampling_params
from octavo.entrypoints.openai.serving import (
    OpenAIError,
    ServingContext,
    start_stream,
    unless_disconnected,
)
from octavo.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from octavo.sampling_params import SamplingParams
from octavo.tokenizer.tokenizer import encode_text


async def create_completion(
    ctx: ServingContext, req: CompletionRequest, raw: HTTPRequest
) -> Response:
    """Validates the request, runs its prompts, and answers with JSON or an SSE stream."""
    # On a thread, which the tokenizer lets run without the GIL: the event loop goes on
    # answering other requests, /health among them, while a large request is prepared.
    prompts, params, echo = await asyncio.to_thread(_prepare, ctx, req)
    request_id = random_id("cmpl")
    outputs = ctx.generate(prompts, params, request_id)
    formatter = _Formatter(ctx, request_id, req, echo)
    if req.stream:
        return await start_stream(ctx, raw, formatter.stream(outputs, ChoiceTracker(req.n)))
    finals: dict[int, RequestOutput] = {}

    async def collect() -> None:
        async for i, out in outputs:  # deltas: join them
            finals[i] = finals[i].add(out) if i in finals else out

    await unless_disconnected(raw, collect())
    tracker = ChoiceTracker(req.n)
    for i in sorted(finals):
        formatter.note(i, finals[i])
    deltas = [d for i in sorted(finals) for d in tracker.update(i, finals[i])]
    response = CompletionResponse(
        id=request_id,
        model=ctx.model_name,
        choices=[formatter.choice(d) for d in sorted(deltas, key=lambda d: d.index)],
        usage=tracker.usage(),
    )
    return JSONResponse(response.model_dump())


def _prepare(
    ctx: ServingContext, req: CompletionRequest
) -> tuple[list[list[int]], list[SamplingParams], list[_Echo] | None]:
    """The request checked and turned into engine input: each prompt's ids and sampling
    parameters, and what `echo` shows; an OpenAIError for anything the request gets wrong."""
    ctx.check_model(req.model)
    if req.best_of is not None and req.best_of < max(req.n, 1):  # OpenAI's and vLLM's rule
        message = f"best_of must be an integer >= 1 and >= n ({req.n}), got {req.best_of}"
        raise OpenAIError(message, param="best_of")
    reject_unsupported(req, suffix=req.suffix, best_of=(req.best_of or 1) > 1)
    prompts = _prompt_ids(ctx, req.prompt, ctx.prompt_tokens_kept(req))
    echo = None
    if req.echo:  # a truncated text prompt is echoed as its ids decode
        echo = _echoes(ctx, req.prompt if req.truncate_prompt_tokens is None else None, prompts)
    # OpenAI's echo with max_tokens 0 answers with the prompt alone. As vLLM does, one token
    # is generated (and left out): the request needs a step to compute the prompt's logits.
    max_tokens = 1 if req.echo and req.max_tokens == 0 else req.max_tokens
    # An echoed prompt comes with log-probs when the completion does (vLLM's rule).
    prompt_logprobs = req.prompt_logprobs
    if req.echo and prompt_logprobs is None:
        prompt_logprobs = req.logprobs
    params = [
        sampling_params(
            req,
            ctx.check_context(ids, max_tokens),
            req.logprobs,
            ctx.engine.vocab_size,
            prompt_logprobs=prompt_logprobs,
        )
        for ids in prompts
    ]
    return prompts, params, echo


@dataclass
class _Echo:
    """A prompt to echo: its text (None for token ids, decoded when first echoed: by then
    the engine has checked them) and ids."""

    text: str | None
    token_ids: list[int]


def _echoes(
    ctx: ServingContext, prompt: str | list | None, prompts: list[list[int]]
) -> list[_Echo]:
    """What `echo` puts in front of each prompt's completions: a text prompt as sent, and
    token ids decoded (every prompt's, when `prompt` is None)."""
    if ctx.tokenizer is None:
        raise OpenAIError("`echo` needs a tokenizer, and this model has none", param="echo")
    texts = [prompt] if isinstance(prompt, str) else prompt  # not empty: _prompt_ids checked
    if texts is None or not isinstance(texts[0], str):
        texts = [None] * len(prompts)  # token ids
    return [_Echo(text, ids) for text, ids in zip(texts, prompts, strict=True)]


def _prompt_ids(
    ctx: ServingContext, prompt: str | list, keep_last: int | None = None
) -> list[list[int]]:
    """One list of token ids per prompt, at most `keep_last` each; text is tokenized as
    `Engine.add_request` does."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError("`prompt` must not be empty", param="prompt")
    try:
        check_num_prompts(len(prompt))
    except ValueError as e:
        raise OpenAIError(str(e), param="prompt") from None
    for p in prompt:  # every prompt, before the tokenizer runs on any
        if isinstance(p, str):
            ctx.check_prompt_chars(len(p))
    result = []
    for p in prompt:
        if isinstance(p, str):
            if ctx.tokenizer is None:
                raise OpenAIError("this model has no tokenizer: send token ids", param="prompt")
            try:
                p = encode_text(ctx.tokenizer, p, add_special_tokens=True, keep_last=keep_last)
            except ValueError as e:
                raise OpenAIError(str(e), param="prompt") from None
        if not p:
            raise OpenAIError("a prompt must have at least one token", param="prompt")
        kept = list(p if keep_last is None else p[-keep_last:])
        ctx.check_token_ids(kept)
        result.append(kept)
    return result


class _Formatter:
    """Builds completion choices and chunks from deltas; with `echo`, a choice's first one
    starts with its prompt."""

    def __init__(
        self, ctx: ServingContext, request_id: str, req: CompletionRequest, echo: list[_Echo] | None
    ) -> None:
        self.chunk = functools.partial(CompletionResponse, id=request_id, model=ctx.model_name)
        self.tokenizer = ctx.tokenizer
        self.req = req
        self.echo = echo
        self.echo_only = req.echo and req.max_tokens == 0
        self.text_offsets: dict[int, int] = {}
        self.started: set[int] = set()  # choices that had a delta
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}  # by prompt index

    def note(self, prompt_index: int, out: RequestOutput) -> None:
        """Keeps a prompt's log-probs, which come with its first output."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = out.prompt_logprobs

    def choice(self, delta: CompletionOutput) -> CompletionChoice:
        text, token_ids, entries = delta.text, delta.token_ids, delta.logprobs
        if self.echo_only:  # the one generated token is left out
            text, token_ids, entries = "", [], None if entries is None else []
        first = delta.index not in self.started
        self.started.add(delta.index)
        prompt_index = delta.index // self.req.n
        if first and self.echo is not None:
            echo = self.echo[prompt_index]
            if echo.text is None:
                echo.text = self.tokenizer.decode(echo.token_ids)
            text, token_ids = echo.text + text, echo.token_ids + token_ids
            if entries is not None:
                scored = self.prompt_logprobs.get(prompt_index)
                entries = (scored or [None] * len(echo.token_ids)) + entries
        logprobs = None
        if entries is not None and self.req.logprobs is not None:
            offset = self.text_offsets.get(delta.index, 0)
            logprobs = completion_logprobs(
                token_ids, entries, self.req.logprobs, offset, self._decode_one
            )
            self.text_offsets[delta.index] = offset + sum(len(t) for t in logprobs.tokens)
        prompt_logprobs = None
        if first and self.req.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_field(self.prompt_logprobs.get(prompt_index))
        return CompletionChoice(
            index=delta.index,
            text=text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            prompt_logprobs=prompt_logprobs,
        )

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def stream(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], tracker: ChoiceTracker
    ) -> AsyncIterator[CompletionResponse]:
        """The chunks of a streamed completion. With include_usage every chunk has `usage`:
        null, and a last one without choices holds the totals."""
        usage = {"usage": None} if self.req.include_usage else {}
        async for prompt_index, out in outputs:
            self.note(prompt_index, out)
            for delta in tracker.update(prompt_index, out):
                yield self.chunk(choices=[self.choice(delta)], **usage)
        if self.req.include_usage:
            yield self.chunk(choices=[], usage=tracker.usage())
