"""POST /v1/completions: prompts (text or token ids) in, completions out, whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from octavo.entrypoints.openai.choices import ChoiceDelta, ChoiceTracker, completion_logprobs
from octavo.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from octavo.entrypoints.openai.serving import (
    OpenAIError,
    ServingContext,
    reject_unsupported,
    sampling_params,
    start_stream,
    unless_disconnected,
)
from octavo.model.tokenizer import encode_text
from octavo.outputs import RequestOutput


async def create_completion(
    ctx: ServingContext, req: CompletionRequest, raw: HTTPRequest
) -> Response:
    """Validates the request, runs its prompts, and answers with JSON or an SSE stream."""
    ctx.check_model(req.model)
    if req.best_of is not None and req.best_of < max(req.n, 1):  # OpenAI's and vLLM's rule
        message = f"best_of must be an integer >= 1 and >= n ({req.n}), got {req.best_of}"
        raise OpenAIError(message, param="best_of")
    reject_unsupported(req, echo=req.echo, suffix=req.suffix, best_of=(req.best_of or 1) > 1)
    prompts = _prompt_ids(ctx, req.prompt)
    params = [
        sampling_params(req, ctx.check_context(ids, req.max_tokens), req.logprobs)
        for ids in prompts
    ]
    request_id = random_id("cmpl")
    outputs = ctx.generate(prompts, params, request_id)
    formatter = _Formatter(ctx.model_name, request_id, req)
    if req.stream:
        return await start_stream(ctx, raw, formatter.stream(outputs, ChoiceTracker(req.n)))
    finals: dict[int, RequestOutput] = {}

    async def collect() -> None:
        async for i, out in outputs:  # deltas: join them
            finals[i] = finals[i].add(out) if i in finals else out

    await unless_disconnected(raw, collect())
    tracker = ChoiceTracker(req.n)
    deltas = [d for i in sorted(finals) for d in tracker.update(i, finals[i])]
    response = CompletionResponse(
        id=request_id,
        model=ctx.model_name,
        choices=[formatter.choice(d) for d in sorted(deltas, key=lambda d: d.index)],
        usage=tracker.usage(),
    )
    return JSONResponse(response.model_dump())


def _prompt_ids(ctx: ServingContext, prompt: str | list) -> list[list[int]]:
    """One list of token ids per prompt; text is tokenized as `Engine.add_request` does."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError("`prompt` must not be empty", param="prompt")
    result = []
    for p in prompt:
        if isinstance(p, str):
            if ctx.tokenizer is None:
                raise OpenAIError("this model has no tokenizer: send token ids", param="prompt")
            try:
                p = encode_text(ctx.tokenizer, p, add_special_tokens=True)
            except ValueError as e:
                raise OpenAIError(str(e), param="prompt") from None
        if not p:
            raise OpenAIError("a prompt must have at least one token", param="prompt")
        result.append(list(p))
    return result


class _Formatter:
    """Builds completion choices and chunks from deltas."""

    def __init__(self, model: str, request_id: str, req: CompletionRequest) -> None:
        self.model = model
        self.request_id = request_id
        self.req = req
        self.text_offsets: dict[int, int] = {}

    def choice(self, delta: ChoiceDelta) -> CompletionChoice:
        logprobs = None
        if delta.logprobs is not None and self.req.logprobs is not None:
            offset = self.text_offsets.get(delta.index, 0)
            logprobs = completion_logprobs(
                delta.token_ids, delta.logprobs, self.req.logprobs, offset
            )
            self.text_offsets[delta.index] = offset + sum(len(t) for t in logprobs.tokens)
        return CompletionChoice(
            index=delta.index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )

    async def stream(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], tracker: ChoiceTracker
    ) -> AsyncIterator[CompletionResponse]:
        """The chunks of a streamed completion. With include_usage every chunk has `usage`:
        null, and a last one without choices holds the totals."""
        usage = {"usage": None} if self.req.include_usage else {}
        async for prompt_index, out in outputs:
            for delta in tracker.update(prompt_index, out):
                yield CompletionResponse(
                    id=self.request_id, model=self.model, choices=[self.choice(delta)], **usage
                )
        if self.req.include_usage:
            yield CompletionResponse(
                id=self.request_id, model=self.model, choices=[], usage=tracker.usage()
            )
