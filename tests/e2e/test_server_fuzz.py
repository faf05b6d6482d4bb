"""A bounded fuzz run of the server: hypothesis draws request bodies whose fields are either
plausible values or any JSON at all, and every response must be one the server documents:
no 5xx, a status the route's OpenAPI entry lists, and a body (or each streamed event) that
parses as its model.

The app runs on the session's embedded engine through FastAPI's TestClient. Every body
asks for at most 8 tokens a choice (and n <= 3), so that the run stays within seconds.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octavo.entrypoints.openai.api_server import build_app
from octavo.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    TokenizeResponse,
)

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152

_leaf = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False) | st.text(max_size=12)
)  # fmt: skip
ANY_JSON = st.recursive(
    _leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)  # fmt: skip
TOKEN_ID = st.integers(-2, VOCAB + 2)
TEXT_PARTS = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=9)}))
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]),
     "content": st.text(max_size=30) | TEXT_PARTS},
    optional={"name": st.text(max_size=5)},
)  # fmt: skip
SMALL = st.integers(-1, 8)  # a length that keeps the run short
MAX_TOKENS = st.integers(1, 8)
# Hypothesis leans to the first of a sampled list (and to 0 among integers): False first.
ONE_IN_FIVE = st.sampled_from([False, False, False, False, True])
ONE_IN_THREE = st.sampled_from([False, False, True])
PLAUSIBLE = {
    "model": st.sampled_from([MODEL, MODEL, MODEL, "gpt-17"]),
    "prompt": st.text(max_size=40) | st.lists(TOKEN_ID, min_size=1, max_size=6)
    | st.lists(st.text(max_size=10), max_size=3),
    "text:prompt": st.text(max_size=40),
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "tokens": st.lists(TOKEN_ID, max_size=6),
    "n": st.integers(0, 3),
    "best_of": st.integers(-1, 3),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-1, 60),
    "min_p": st.floats(-0.5, 1.5), "seed": st.integers(-(2**64), 2**64),
    "logprobs": st.integers(-1, 6), "top_logprobs": st.integers(-1, 25),
    "prompt_logprobs": st.integers(-1, 25), "echo": st.booleans(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "stop_token_ids": st.lists(TOKEN_ID, max_size=3),
    "allowed_token_ids": st.lists(TOKEN_ID, max_size=3),
    "logit_bias": st.dictionaries(st.integers(-2, VOCAB).map(str) | st.text(max_size=4),
                                  st.floats(-200, 200), max_size=3),
    "min_tokens": SMALL, "ignore_eos": st.booleans(), "truncate_prompt_tokens": SMALL,
    "guided_regex": st.sampled_from(["[ab]+", "(", "a{1,3}"]),
    "guided_choice": st.lists(st.text(max_size=6), max_size=3),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}
    ),
    "chat:logprobs": st.booleans(), "add_special_tokens": st.booleans(),
    "return_token_strs": st.booleans(), "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
}  # fmt: skip
ROUTES = {  # path -> (its fields, the whole response's model, a streamed event's model)
    "/v1/completions": (
        ["prompt", "model", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed",
         "logprobs", "prompt_logprobs", "echo", "stream", "stream_options", "stop",
         "stop_token_ids", "allowed_token_ids", "logit_bias", "min_tokens", "ignore_eos",
         "truncate_prompt_tokens", "guided_regex", "guided_choice", "response_format"],
        CompletionResponse, CompletionResponse,
    ),
    "/v1/chat/completions": (
        ["messages", "model", "n", "temperature", "top_k", "seed", "chat:logprobs", "top_logprobs",
         "stream", "stream_options", "stop", "logit_bias", "ignore_eos", "guided_regex",
         "response_format", "add_generation_prompt", "continue_final_message"],
        ChatCompletionResponse, ChatCompletionChunk,
    ),
    "/tokenize": (
        ["text:prompt", "messages", "model", "add_special_tokens", "return_token_strs",
         "add_generation_prompt", "continue_final_message"],
        TokenizeResponse, None,
    ),
    "/detokenize": (["tokens", "model"], DetokenizeResponse, None),
}  # fmt: skip


@st.composite
def requests(draw) -> tuple[str, dict]:
    """(path, body): the route's first field (its prompt), and a fifth of the others, from
    plausible values (mostly valid); in a third of the bodies one field holds any JSON. The
    length fields are always small."""
    path = draw(st.sampled_from(list(ROUTES)))
    fields = ROUTES[path][0]
    names = [fields[0], *(name for name in fields[1:] if draw(ONE_IN_FIVE))]
    body = {_field(name): draw(PLAUSIBLE[name]) for name in names}
    if draw(ONE_IN_THREE):
        body[_field(draw(st.sampled_from(fields[::-1])))] = draw(ANY_JSON)
    if path == "/v1/completions":
        body["max_tokens"] = draw(MAX_TOKENS)
    elif path == "/v1/chat/completions":
        body["max_completion_tokens"] = draw(MAX_TOKENS)
    return path, body


def _field(name: str) -> str:
    """A body's field for a key of PLAUSIBLE: "chat:logprobs" is chat's `logprobs`."""
    return name.rpartition(":")[2]


@pytest.fixture(scope="module")
def served(llm):
    """(a TestClient of the app, the statuses each POST route's OpenAPI entry lists)."""
    app = build_app(llm.engine, MODEL)
    documented = {
        path: {int(status) for status in entry["post"]["responses"]}
        for path, entry in app.openapi()["paths"].items()
        if "post" in entry
    }
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, documented


def _check_response(documented: set[int], path: str, body: dict, r) -> None:
    _, whole, event = ROUTES[path]
    assert r.status_code < 500, (body, r.text[:500])
    assert r.status_code in documented, (body, r.status_code, r.text[:500])
    if r.status_code != 200:
        ErrorResponse.model_validate(r.json())
    elif not r.headers["content-type"].startswith("text/event-stream"):
        whole.model_validate(r.json())
    else:
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", (body, events[-3:])
        for data in events[:-1]:
            assert '"error"' not in data[:10], (body, data)  # no error event
            event.model_validate_json(data)


@pytest.mark.slow
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests())
def test_fuzzed_requests_get_documented_responses_and_no_5xx(served, request):
    client, documented = served
    path, body = request
    raw = json.dumps(body)  # Infinity and huge ints, as a client may send them
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    _check_response(documented[path], path, body, r)


BASE_BODIES = {
    ("/v1/completions", "CompletionRequest"): {"prompt": "hi", "max_tokens": 1},
    ("/v1/chat/completions", "ChatCompletionRequest"): {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
    },
    ("/tokenize", "TokenizeChatRequest"): {"messages": [{"role": "user", "content": "hi"}]},
}  # fmt: skip


def _past_each_limit(props: dict) -> list[tuple[str, object]]:
    """(field, a value just outside a range its schema states) for every stated bound."""
    cases = []
    for field, schema in props.items():
        is_int = "integer" in json.dumps(schema) and "number" not in json.dumps(schema)
        step = 1 if is_int else 0.5
        if "minimum" in schema:
            cases.append((field, schema["minimum"] - step))
        if "maximum" in schema:
            cases.append((field, schema["maximum"] + step if is_int else schema["maximum"] * 10))
        if "exclusiveMinimum" in schema:
            cases.append((field, schema["exclusiveMinimum"]))
        if "minItems" in schema:
            cases.append((field, []))
        if "minLength" in schema:
            cases.append((field, ""))
    return cases


def test_every_limit_the_openapi_document_states_is_enforced(served):
    """A value just past any bound the document states (minimum, maximum, exclusiveMinimum,
    minItems, minLength) is a 400 naming the field."""
    client, _ = served
    schemas = client.app.openapi()["components"]["schemas"]
    checked = 0
    for (path, model), base in BASE_BODIES.items():
        for field, value in _past_each_limit(schemas[model]["properties"]):
            r = client.post(path, json=base | {field: value})
            assert r.status_code == 400, (path, field, value, r.text[:300])
            error = r.json()["error"]
            assert field in (error["param"] or "") + error["message"], (path, field, error)
            checked += 1
    assert checked >= 25
