"""POST /v1/chat/completions: a conversation, rendered with the model's chat template, in;
the assistant's reply out, whole or streamed."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from octavo.entrypoints.openai.chat_tools import (
    ReplyPlan,
    ReplyStream,
    constraint,
    plan_reply,
    read_reply,
)
from octavo.entrypoints.openai.choices import (
    ChoiceTracker,
    chat_logprobs,
    prompt_logprobs_field,
)
from octavo.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
    TokenizeChatRequest,
    random_id,
)
from octavo.entrypoints.openai.request_params import reject_unsupported, sampling_params
from octavo.entrypoints.openai.serving import (
    OpenAIError,
    ServingContext,
    start_stream,
    unless_disconnected,
)
from octavo.outputs import CompletionOutput, RequestOutput
from octavo.sampling_params import SamplingParams
from octavo.tokenizer.tokenizer import apply_chat_template


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, raw: HTTPRequest
) -> Response:
    """Validates the request, renders the conversation, and answers with JSON or SSE."""
    # On a thread, as rendering and tokenizing a long conversation take a while: the event
    # loop goes on answering other requests, /health among them.
    prompt, params, plan = await asyncio.to_thread(_prepare, ctx, req)
    request_id = random_id("chatcmpl")
    outputs = ctx.generate([prompt], [params], request_id)
    formatter = _Formatter(ctx.model_name, request_id, params.logprobs, plan)
    if req.stream:
        chunks = formatter.stream(outputs, ChoiceTracker(req.n), req.include_usage)
        return await start_stream(ctx, raw, chunks)
    final: list[RequestOutput] = []

    async def collect() -> None:
        async for _, out in outputs:  # deltas: join them
            final[:] = [final[0].add(out) if final else out]

    await unless_disconnected(raw, collect())
    tracker = ChoiceTracker(req.n)
    deltas = sorted(tracker.update(0, final[0]), key=lambda d: d.index)
    messages = [read_reply(plan, d.text) for d in deltas]
    response = ChatCompletionResponse(
        id=request_id,
        model=ctx.model_name,
        choices=[
            ChatChoice(
                index=d.index,
                message=message,
                logprobs=formatter.logprobs(d),
                finish_reason=_finish_reason(d.finish_reason, bool(message.tool_calls)),
                stop_reason=d.stop_reason,
            )
            for d, message in zip(deltas, messages, strict=True)
        ],
        usage=tracker.usage(),
        prompt_logprobs=prompt_logprobs_field(final[0].prompt_logprobs),
    )
    return JSONResponse(response.model_dump())


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended after calling tools."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def _prepare(
    ctx: ServingContext, req: ChatCompletionRequest
) -> tuple[list[int], SamplingParams, ReplyPlan]:
    """The request checked and turned into engine input: the prompt's ids, the sampling
    parameters and how its replies are read; an OpenAIError for anything the request gets
    wrong."""
    ctx.check_model(req.model)
    reject_unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError("`top_logprobs` needs `logprobs` set to true", param="top_logprobs")
    plan = plan_reply(ctx.chat, req, ctx.chat_template)
    prompt = render_conversation(ctx, req, tools=plan.tools, template_kwargs=plan.template_kwargs)
    keep = ctx.prompt_tokens_kept(req)
    if keep is not None:  # the rendering adds no special tokens
        prompt = prompt[-keep:]
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    aliases = {"logprobs": "top_logprobs"}  # errors name the request's fields
    max_tokens, param = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        aliases["max_tokens"] = param
    max_tokens = ctx.check_context(prompt, max_tokens, param, prompt_param="messages")
    vocab = ctx.engine.vocab_size
    params = sampling_params(req, max_tokens, num_logprobs, vocab, aliases, req.prompt_logprobs)
    params.structured_outputs = constraint(plan, req, params.structured_outputs)
    return prompt, params, plan


def render_conversation(
    ctx: ServingContext,
    req: ChatCompletionRequest | TokenizeChatRequest,
    add_special_tokens: bool = False,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The request's messages through the chat template, as token ids; a 400 naming the
    field for flags that contradict each other, text too long for the context, or messages
    the template refuses. Slow for a long conversation: call it on a thread."""
    if req.add_generation_prompt and req.continue_final_message:
        message = "`continue_final_message` needs `add_generation_prompt` set to false"
        raise OpenAIError(message, param="continue_final_message")
    messages = [message_dict(m) for m in req.messages]
    ctx.check_prompt_chars(sum(len(m["content"]) for m in messages), param="messages")
    try:
        return apply_chat_template(
            ctx.tokenizer,
            messages,
            req.add_generation_prompt,
            req.continue_final_message,
            add_special_tokens=add_special_tokens,
            tools=tools,
            template_kwargs=template_kwargs,
            chat_template=ctx.chat_template_override,
        )
    except ValueError as e:
        raise OpenAIError(str(e), param="messages") from e


def message_dict(message: ChatMessage) -> dict:
    """OpenAI's message -> what the chat template reads: role and content as a str."""
    content = message.content
    if content is None:
        if message.role != "assistant":  # only an assistant turn may come without content
            raise OpenAIError(f"a {message.role!r} message needs `content`", param="messages")
        content = ""
    elif isinstance(content, list):
        parts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(
                    "only text content parts ({'type': 'text', 'text': ...}) are supported",
                    param="messages",
                )
            parts.append(part["text"])
        content = "".join(parts)
    result = {"role": message.role, "content": content}
    if message.name is not None:
        result["name"] = message.name
    extra = message.model_extra or {}
    if extra.get("tool_calls"):
        result["tool_calls"] = _template_tool_calls(extra["tool_calls"])
    if isinstance(extra.get("tool_call_id"), str):
        result["tool_call_id"] = extra["tool_call_id"]
    return result


def _template_tool_calls(calls: object) -> list[dict]:
    """An assistant message's tool_calls as chat templates read them: each call's
    arguments as an object (OpenAI sends them as JSON text), as transformers has them."""
    if not isinstance(calls, list):
        raise OpenAIError("a message's `tool_calls` must be a list", param="messages")
    result = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise OpenAIError(
                'each of a message\'s `tool_calls` needs {"function": {"name": ..., '
                '"arguments": ...}}', param="messages",
            )  # fmt: skip
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise OpenAIError(
                    f"the arguments of tool call {function['name']!r} are not JSON",
                    param="messages",
                ) from None
        result.append({**call, "function": {**function, "arguments": arguments}})
    return result


class _Formatter:
    """Builds chat choices and chunks from deltas."""

    def __init__(
        self, model: str, request_id: str, num_logprobs: int | None, plan: ReplyPlan
    ) -> None:
        self.chunk = functools.partial(ChatCompletionChunk, id=request_id, model=model)
        self.num_logprobs = num_logprobs
        self.plan = plan
        self.plain = plan.tool_format is None and plan.reasoning is None
        self.readers: dict[int, ReplyStream] = {}  # per choice

    def logprobs(self, delta: CompletionOutput):
        if delta.logprobs is None or self.num_logprobs is None:
            return None
        return chat_logprobs(delta.token_ids, delta.logprobs, self.num_logprobs)

    def chunk_choice(self, delta: CompletionOutput) -> ChatChunkChoice:
        finish_reason = delta.finish_reason
        if self.plain:
            message = DeltaMessage(content=delta.text)
        else:
            reader = self.readers.setdefault(delta.index, ReplyStream(self.plan))
            message = reader.feed(delta.text, finish_reason is not None)
            finish_reason = _finish_reason(finish_reason, reader.made_calls)
        return ChatChunkChoice(
            index=delta.index,
            delta=message,
            logprobs=self.logprobs(delta),
            finish_reason=finish_reason,
            stop_reason=delta.stop_reason,
        )

    async def stream(
        self,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        tracker: ChoiceTracker,
        include_usage: bool,
    ) -> AsyncIterator[ChatCompletionChunk]:
        """The chunks of a streamed reply. Each choice opens with a chunk holding only the
        role, sent with the engine's first output (as OpenAI and vLLM send it); then its
        text. With include_usage every chunk has `usage`: null, and a last one without
        choices holds the totals."""
        usage = {"usage": None} if include_usage else {}
        opened = False
        async for prompt_index, out in outputs:
            if not opened:
                opened = True
                for index in range(tracker.n):
                    role = DeltaMessage(role="assistant", content="")
                    yield self.chunk(choices=[ChatChunkChoice(index=index, delta=role)], **usage)
            for delta in tracker.update(prompt_index, out):
                yield self.chunk(choices=[self.chunk_choice(delta)], **usage)
        if include_usage:
            yield self.chunk(choices=[], usage=tracker.usage())
