"""A completion or chat request's fields as SamplingParams (vLLM's and OpenAI's names, with
OpenAI's defaults), and the fields octavo refuses; a bad value is an OpenAIError naming it."""

from __future__ import annotations

import math
import re
from typing import Any

from octavo.entrypoints.openai.limits import check_constraint, parse_token_id
from octavo.entrypoints.openai.protocol import SamplingRequest
from octavo.entrypoints.openai.serving import OpenAIError
from octavo.sampling_params import (
    MAX_LOGIT_BIAS,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)


def sampling_params(
    req: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    aliases: dict[str, str] | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Builds SamplingParams from the request's fields; SamplingParams validates them, and its
    ValueError becomes a 400 that names the field: by the request's own name for it where
    `aliases` gives one (chat's `top_logprobs` for `logprobs`, say). Token ids outside
    [0, vocab_size) are refused here, naming their field."""
    for name in ("stop_token_ids", "allowed_token_ids"):
        _check_in_vocab(name, getattr(req, name) or (), vocab_size)
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        # What is new in each step: a step's message from the engine process stays small,
        # whatever the lengths so far (choices.py turns deltas into chunks).
        "output_kind": RequestOutputKind.DELTA,
    }
    for name in (  # the request's fields of the same name, where set
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop",
        "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "ignore_eos",
        "include_stop_str_in_output", "skip_special_tokens",
    ):  # fmt: skip
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    if req.logit_bias:
        fields["logit_bias"] = _logit_bias(req.logit_bias, vocab_size)
    fields["structured_outputs"] = structured_outputs(req)
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        message, param = str(e), _field_named_in(str(e), fields)
        if param is not None and aliases and param in aliases:
            message = re.sub(rf"\b{param}\b", aliases[param], message, count=1)
            param = aliases[param]
        raise OpenAIError(message, param=param) from e


def structured_outputs(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's one structured-output constraint, from OpenAI's response_format
    (json_object, or json_schema's schema), vLLM's structured_outputs or its guided_json /
    guided_regex / guided_choice / guided_grammar; None for none. Two at once, or a bad one,
    is a 400 that names the field."""
    given: list[tuple[str, dict[str, Any]]] = []  # (request field, StructuredOutputsParams)
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                message = "`response_format.json_schema.schema` must be a JSON schema object"
                raise OpenAIError(message, param="response_format")
            given.append(("response_format", {"json": schema}))
        elif kind != "text":
            allowed = "text, json_object or json_schema"
            message = f"`response_format.type` must be {allowed}, got {kind!r}"
            raise OpenAIError(message, param="response_format")
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
        if getattr(req, name) is not None:
            given.append((name, {key: getattr(req, name)}))
    if not given:
        return None
    if len(given) > 1:
        fields = ", ".join(f"`{name}`" for name, _ in given)
        message = f"give one structured output constraint, not {fields}"
        raise OpenAIError(message, param=given[1][0])
    param, spec = given[0]
    try:
        check_constraint(spec)
        return StructuredOutputsParams(**spec)
    except (TypeError, ValueError) as e:
        raise OpenAIError(str(e), param=param) from None


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias: token ids in decimal as JSON keys; each bias clamped to
    [-100, 100], as vLLM does."""
    result = {}
    for key, value in bias.items():
        token_id = parse_token_id(key)
        if token_id is None:
            message = f"logit_bias keys must be token ids in decimal digits, got {_shown(key)}"
            raise OpenAIError(message, param="logit_bias")
        _check_in_vocab("logit_bias", [token_id], vocab_size)
        if math.isnan(value):
            message = f"logit_bias for {_shown(key)} is not a number"
            raise OpenAIError(message, param="logit_bias")
        result[token_id] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
    return result


def _check_in_vocab(name: str, token_ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        message = f"{name} names token id {bad}, outside the vocabulary [0, {vocab_size})"
        raise OpenAIError(message, param=name)


def _shown(text: str, limit: int = 40) -> str:
    """`text` quoted for an error message, cut to `limit` characters."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _field_named_in(message: str, fields: dict[str, Any]) -> str | None:
    words = message.replace("=", " ").replace(":", " ").split()
    return next((w for w in words if w in fields), None)


def reject_unsupported(req: SamplingRequest, **settings: Any) -> None:
    """400 for OpenAI fields we accept but do not implement, when set to a non-default
    (the endpoint's own `settings`); for vLLM's `prompt_logprobs` with `stream`, which only
    whole responses carry; and for `stream_options` without `stream`, as OpenAI and vLLM
    answer."""
    for name, value in settings.items():
        if value:
            raise OpenAIError(f"`{name}` is not supported by this server", param=name)
    if req.stream and req.prompt_logprobs is not None:
        message = "`prompt_logprobs` needs `stream` set to false"
        raise OpenAIError(message, param="prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("`stream_options` needs `stream` set to true", param="stream_options")
