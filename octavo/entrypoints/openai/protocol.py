"""The OpenAI API's request and response bodies as pydantic models.

Requests are validated strictly (no "3" for 3, no true for 1); fields OpenAI has that we do
not implement are rejected when set to a value that would change the result, and unknown
fields are ignored, as OpenAI and vLLM do. `ignore_eos` and `min_tokens` are vLLM's extra
fields (sent by clients through `extra_body`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from octavo.sampling_params import MAX_LOGPROBS, MAX_N, MAX_TEMPERATURE


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- errors -------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# ---- requests -----------------------------------------------------------------------------


class NullMeansDefault(BaseModel):
    """A request body in which null, for a field that has a default and cannot be None,
    means that default: OpenAI's spec types such fields "or null", and its clients send
    null for a parameter the caller set to None (`n=None`, `stream=None`), as vLLM accepts.
    Fields that can be None keep their null (completions' `max_tokens`: no limit)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_with_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields

        def keep(name: str, value: Any) -> bool:
            field = fields.get(name)
            if value is not None or field is None or field.is_required():
                return True
            annotation = field.annotation
            return annotation is None or type(None) in getattr(annotation, "__args__", ())

        return {k: v for k, v in data.items() if keep(k, v)}


def limits(default: Any = None, **schema: Any) -> Any:
    """A field's default, and the range the server enforces stated in the OpenAPI document
    (`minimum`, `maximum`, `exclusiveMinimum`, `minItems`, ...). The checks themselves stay
    in SamplingParams and the routes, whose errors name the field and the range."""
    return Field(default, json_schema_extra=schema)


_LOGPROBS = {"minimum": 0, "maximum": MAX_LOGPROBS}


class StreamOptions(NullMeansDefault):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class StrictRequest(BaseModel):
    """What every request body has: strict types, unknown fields ignored, a `model`."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None


class SamplingRequest(NullMeansDefault, StrictRequest):
    """The sampling fields that completions and chat completions share."""

    n: int = limits(1, minimum=1, maximum=MAX_N)
    temperature: float | None = limits(minimum=0, maximum=MAX_TEMPERATURE)
    top_p: float | None = limits(exclusiveMinimum=0, maximum=1)
    top_k: int | None = limits(minimum=-1)  # -1 and 0: no top-k
    min_p: float | None = limits(minimum=0, maximum=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = limits(minimum=-2, maximum=2)
    frequency_penalty: float | None = limits(minimum=-2, maximum=2)
    repetition_penalty: float | None = limits(exclusiveMinimum=0)
    ignore_eos: bool = False
    min_tokens: int | None = limits(minimum=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a str, in JSON) -> bias
    # vLLM's extensions, honoured as vLLM does.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = limits(**_LOGPROBS)
    allowed_token_ids: list[int] | None = limits(minItems=1)
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = limits(minimum=-1)  # -1: max_model_len; not 0
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs (keys of
    # StructuredOutputsParams) and its older guided_* fields; at most one of them.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


_T = TypeVar("_T")
_FailFast = Annotated[_T, Field(fail_fast=True)]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt` is a str, a list of str, a list of token ids, or a list
    of lists of token ids; each prompt gets `n` choices."""

    # Each list stops at its first bad item: a long prompt of token ids is not also checked,
    # one error an id, as a list of str.
    prompt: str | _FailFast[list[str]] | _FailFast[list[int]] | _FailFast[list[list[int]]] = limits(
        ..., minLength=1, minItems=1
    )
    max_tokens: int | None = limits(16, minimum=1)
    logprobs: int | None = limits(**_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = limits(minimum=1)  # and >= n


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]  # OpenAI's
    # A str, or OpenAI's list of content parts ({"type": "text", "text": ...}).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: the conversation is rendered with the model's template."""

    messages: list[ChatMessage] = limits(..., minItems=1)
    max_tokens: int | None = limits(minimum=1)
    max_completion_tokens: int | None = limits(minimum=1)
    logprobs: bool = False
    top_logprobs: int | None = limits(**_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the template
    add_generation_prompt: bool = True  # vLLM's
    continue_final_message: bool = False  # vLLM's


class TokenizeCompletionRequest(StrictRequest):
    """POST /tokenize with a prompt (vLLM's): the ids a completion would run on."""

    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(StrictRequest):
    """POST /tokenize with a conversation (vLLM's): the ids a chat completion would run on."""

    messages: list[ChatMessage] = limits(..., minItems=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of those the chat template writes
    return_token_strs: bool = False


class DetokenizeRequest(StrictRequest):
    """POST /detokenize (vLLM's): token ids to text."""

    tokens: list[int]


# ---- responses ----------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's shape of one entry of `prompt_logprobs`, keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One per prompt token: None for the first, then the prompt's token and the top-k.
PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
    prompt_logprobs: PromptLogprobsField = None  # vLLM's, with its `prompt_logprobs` field


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallItem(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's: what a reasoning parser took apart
    tool_calls: list[ToolCallItem] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobsField = None  # vLLM's, with its `prompt_logprobs` field


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = "function"
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _leave_out_unused(self, handler):
        """reasoning_content and tool_calls appear only in a delta that has them, as in
        OpenAI's chunks."""
        data = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "octavo"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
