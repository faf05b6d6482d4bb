"""What completions and chat completions share: the context-length check, running k prompts
as k engine requests with merged outputs, SSE framing, and errors (request_params.py turns a
request into SamplingParams).

Choice numbering follows OpenAI: prompt i with n choices gives choices i*n .. i*n+n-1, and a
choice's number within its prompt is `CompletionOutput.index`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from octavo.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError
from octavo.entrypoints.openai.limits import check_prompt_chars, short_detail
from octavo.entrypoints.openai.metrics import ServerMetrics
from octavo.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, SamplingRequest
from octavo.outputs import RequestOutput
from octavo.sampling_params import SamplingParams

T = TypeVar("T")


class OpenAIError(Exception):
    """An error to send in OpenAI's format with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        # A lone surrogate from the request (a model name, say) cannot be encoded as UTF-8:
        # write it as its escape so the error itself can be sent.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(
            error=ErrorInfo(message=message, type=type, param=param, code=code)
        )


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


def error_from_exception(e: BaseException) -> OpenAIError:
    """Maps what generation can raise to the error the client sees."""
    if isinstance(e, OpenAIError):
        return e
    message = _without_class_names(str(e))
    if isinstance(e, ValueError):  # the engine's checks: their messages open with the field
        if message.startswith(_DOES_NOT_COMPILE):  # the compiler's words may hold the grammar
            message = _DOES_NOT_COMPILE + short_detail(message[len(_DOES_NOT_COMPILE) :])
        first = message.split(" ", 1)[0]
        return OpenAIError(message, param=first if first in _REQUEST_FIELDS else None)
    if isinstance(e, EngineDeadError):
        return OpenAIError(message, 503, "server_error")
    if isinstance(e, EngineStepError):
        return OpenAIError(message, 500, "server_error")
    return OpenAIError(f"internal error: {_without_class_names(repr(e))}", 500, "server_error")


_REQUEST_FIELDS = frozenset(SamplingRequest.model_fields) | {"prompt", "messages"}
_DOES_NOT_COMPILE = "structured_outputs does not compile: "
# An exception's repr, `RuntimeError('text')`: the client gets the text, not our class.
_EXCEPTION_REPR = re.compile(r"\b[A-Z]\w*(?:Error|Exception)\((['\"])(.*?)\1\)")


def _without_class_names(message: str) -> str:
    return _EXCEPTION_REPR.sub(r"\2", message)


@dataclass(frozen=True)
class ChatOptions:
    """How chat replies are read: --tool-call-parser and --reasoning-parser."""

    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None


@dataclass
class ServingContext:
    """What the endpoints need: the engine loop, the model's name and limits, metrics."""

    engine: AsyncEngine
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    chat: ChatOptions = ChatOptions()
    chat_template_override: str | None = None  # --chat-template

    @property
    def chat_template(self) -> str | None:
        """The template chats are rendered with: --chat-template's, else the model's."""
        return self.chat_template_override or getattr(self.tokenizer, "chat_template", None)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                404,
                param="model",
                code="model_not_found",
            )

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """A 400 for a text prompt too long for the context whatever its tokens, before
        the tokenizer spends time on it."""
        try:
            check_prompt_chars(num_chars, self.max_model_len)
        except ValueError as e:
            raise OpenAIError(str(e), param=param) from None

    def check_token_ids(self, prompt_ids: list[int]) -> None:
        """A 400 unless every id is in the model's vocabulary. Checked before any prompt of
        a request reaches the engine, which would refuse that prompt alone: the others
        could already have streamed under a 200."""
        vocab = self.engine.vocab_size
        if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab):  # C, not Python
            bad = next(t for t in prompt_ids if not 0 <= t < vocab)
            message = f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
            raise OpenAIError(message, param="prompt")

    def prompt_tokens_kept(self, req: SamplingRequest) -> int | None:
        """How many prompt tokens vLLM's truncate_prompt_tokens keeps (None: all), so that
        prompts are cut before the context is checked; a bad value is a 400 naming it."""
        if req.truncate_prompt_tokens is None:
            return None
        try:
            params = SamplingParams(truncate_prompt_tokens=req.truncate_prompt_tokens)
        except ValueError as e:
            raise OpenAIError(str(e), param="truncate_prompt_tokens") from None
        return params.prompt_tokens_kept(self.max_model_len)

    def check_context(
        self,
        prompt_ids: list[int],
        max_tokens: int | None,
        param: str = "max_tokens",
        prompt_param: str = "prompt",
    ) -> int:
        """Returns the max_tokens to use (the room left in the context when None).

        Raises OpenAIError (400) when the prompt plus max_tokens exceeds max_model_len, naming
        `param` (the request's field for max_tokens), or `prompt_param` when the prompt
        alone fills the context, whatever max_tokens is."""
        room = self.max_model_len - len(prompt_ids)
        limit = f"This model's maximum context length is {self.max_model_len} tokens. However, "
        if room < 1:  # no max_tokens could help
            raise OpenAIError(
                f"{limit}the prompt has {len(prompt_ids)} tokens, which leaves no room for the "
                "completion. Please reduce the length of the prompt.",
                param=prompt_param,
            )
        if max_tokens is None:
            max_tokens = room
        if max_tokens > room:
            raise OpenAIError(
                f"{limit}you requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} "
                f"in the prompt, {max_tokens} for the completion). Please reduce the length of "
                "the prompt or of the completion.",
                param=param,
            )
        return max_tokens

    async def generate(
        self, prompts: list[list[int]], params: list[SamplingParams], request_id: str
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Runs each prompt as one engine request; yields (prompt index, output) as they come,
        each output what is new since the last (DELTA). Closing the iterator early aborts
        every unfinished request."""
        streams = [
            self._timed(ids, p, f"{request_id}-{i}")
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        async for item in _merge(streams):
            yield item

    async def _timed(
        self, prompt: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        # NOTE: a request that fails is counted as an error by whoever turns the exception
        # into a response, once per HTTP request; here only finished or aborted ones count.
        timer = self.metrics.start_request()
        failed = False
        try:
            async for out in self.engine.generate(prompt, params, request_id):
                timer.observe(out)
                yield out
        except Exception:
            failed = True
            raise
        finally:
            if not failed:
                timer.finish(None if timer.finished else "abort")


async def _merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleaves several async iterators, tagging each item with its iterator's index."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(payload: BaseModel) -> str:
    """One server-sent event. A chunk leaves out `usage` unless it was set: OpenAI sends it
    only with include_usage."""
    unset = "usage" in type(payload).model_fields and "usage" not in payload.model_fields_set
    return f"data: {payload.model_dump_json(exclude={'usage'} if unset else None)}\n\n"


async def start_stream(
    ctx: ServingContext, raw: HTTPRequest, chunks: AsyncIterator[BaseModel]
) -> StreamingResponse:
    """Answers with an SSE stream of `chunks`, ending with `data: [DONE]`.

    The first chunk is awaited before the response starts, so that a request the engine
    rejects still gets its HTTP error; a later failure is sent as an error event."""
    try:
        first: BaseModel | None = await unless_disconnected(raw, anext(chunks))
    except StopAsyncIteration:
        first = None

    async def body() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield sse(first)
                async for chunk in chunks:
                    yield sse(chunk)
        except Exception as e:  # noqa: BLE001 - the headers are out: report in the stream
            ctx.metrics.count_error()
            yield sse(error_from_exception(e).body)
        yield "data: [DONE]\n\n"  # how OpenAI's streams end

    return StreamingResponse(body(), media_type="text/event-stream")


async def unless_disconnected(raw: HTTPRequest, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it (which aborts its engine requests) if the client
    disconnects first; then raises ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


async def _wait_for_disconnect(raw: HTTPRequest) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
