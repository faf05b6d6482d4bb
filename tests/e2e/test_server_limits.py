"""The server under abuse: bodies over the size limit, the API key on every route but
/health, requests that must be refused with a 400 naming their field before any costly
work, the OpenAPI document's error responses, and methods a route has not.

A real uvicorn server on the session's embedded engine, with a small body limit; none of
these requests runs a step, so the engine stays idle.
"""

from __future__ import annotations

import argparse
import json
import re
import socket

import httpx
import pytest
from server_fixture import ServerThread

from octavo.entrypoints.openai.api_server import build_app
from octavo.entrypoints.openai.cli_serve import add_parser, api_key

API_KEY = "limits-key"
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BYTES = 256 << 10  # above the prompt limit of the model's context (16 x 8192 chars)


@pytest.fixture(scope="module")
def server(llm):
    app = build_app(llm.engine, MODEL, api_key=API_KEY, max_request_bytes=MAX_BYTES)
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def guarded_metrics(llm):
    app = build_app(llm.engine, MODEL, api_key=API_KEY, api_key_metrics=True)
    with ServerThread(app) as s:
        yield s


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- the body limit ----------------------------------------------------------------------


def _raw_exchange(server, head: bytes, body_parts: list[bytes]) -> bytes:
    """Sends a request's head and then body parts on a raw socket, stopping early if the
    server answers; returns the response as read until the server closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head)
        for part in body_parts:
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
    return response


@pytest.mark.parametrize("request_line", [b"POST /v1/completions", b"GET /health"])
def test_content_length_over_the_limit_is_413_before_the_body_is_sent(server, request_line):
    """The server answers from the header alone: the 64 MiB body is never sent."""
    head = (
        request_line + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
        b"Content-Length: " + str(64 << 20).encode() + b"\r\n\r\n"
    )
    response = _raw_exchange(server, head, [])
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert b'"code":"request_too_large"' in response and b'"param":null' in response


def test_a_chunked_body_over_the_limit_is_413_once_it_passes_the_limit(server):
    def chunks():
        for _ in range(MAX_BYTES // 1024 + 1):
            yield b" " * 1024

    r = httpx.post(
        server.url + "/v1/completions",
        content=chunks(),
        headers=AUTH | {"Content-Type": "application/json"},
        timeout=30,
    )
    error = _assert_error(r, 413)
    assert str(MAX_BYTES) in error["message"]


def test_a_body_under_the_limit_passes(server):
    body = {"model": MODEL, "prompt": "x" * (MAX_BYTES // 2), "max_tokens": 1}
    r = httpx.post(server.url + "/tokenize", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text


def test_too_many_prompts_or_json_items_are_400s_that_name_the_limit(server, monkeypatch):
    cases = [
        ({"prompt": ["a"] * 2049}, "prompt", "2048"),
        ({"prompt": [[1]] * 16_400}, None, "16384"),
        ({"messages": [{"role": "user", "content": ""}] * 5500}, None, "16384"),
    ]
    for body, param, limit in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=30)
        assert limit in _assert_error(r, 400, param)["message"]
    # Brackets and colons inside strings are text, not JSON items.
    body = {"prompt": "[{:" * 20_000}
    assert httpx.post(server.url + "/tokenize", json=body, headers=AUTH).status_code == 200
    # /detokenize: as many ids as a prompt's characters (a shorter context keeps the body small)
    monkeypatch.setattr(server.ctx, "max_model_len", 1024)
    limit = 16 * 1024
    r = httpx.post(server.url + "/detokenize", json={"tokens": [1] * (limit + 1)}, headers=AUTH)
    assert str(limit) in _assert_error(r, 400, "tokens")["message"]


@pytest.mark.parametrize("depth", [300, 1000, 10_000])
def test_json_nested_too_deep_is_a_400_on_every_post_route(server, depth):
    """Deep nesting is a 400 naming the limit, on a connection that stays open: never a
    recursion error's 500."""
    with httpx.Client(timeout=30) as client:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
            r = client.post(server.url + path, content=raw, headers=AUTH)
            assert "256 deep" in _assert_error(r, 400)["message"], path
            ok = client.post(server.url + "/tokenize", json={"prompt": "hi"}, headers=AUTH)
            assert ok.status_code == 200  # the same keep-alive connection answers


def test_head_health_and_metrics_text_in_the_openapi_document(server):
    assert httpx.head(server.url + "/health", timeout=30).status_code == 200
    doc = httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=30).json()
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {
        "text/plain; version=0.0.4; charset=utf-8"
    }


# ---- the API key -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/version"),
        ("GET", "/v1/models"),
        ("GET", "/openapi.json"),
    ],
)
def test_every_route_but_health_and_metrics_needs_the_key(server, method, path):
    body = {"prompt": "hi"} if path == "/tokenize" else {"tokens": [5]}
    kwargs = {"json": body} if method == "POST" else {}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.request(method, server.url + path, headers=headers, timeout=30, **kwargs)
        assert _assert_error(r, 401)["code"] == "invalid_api_key"
    r = httpx.request(method, server.url + path, headers=AUTH, timeout=30, **kwargs)
    assert r.status_code == 200, r.text


def test_health_and_metrics_are_open_unless_metrics_are_guarded(server, guarded_metrics):
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200
    assert httpx.get(guarded_metrics.url + "/health", timeout=30).status_code == 200
    _assert_error(httpx.get(guarded_metrics.url + "/metrics", timeout=30), 401)
    r = httpx.get(guarded_metrics.url + "/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200


def test_the_key_comes_from_octavo_api_key_unless_given(monkeypatch):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    monkeypatch.setenv("OCTAVO_API_KEY", "from-env")
    assert api_key(parser.parse_args(["serve"])) == "from-env"
    assert api_key(parser.parse_args(["serve", "--api-key", "flag"])) == "flag"
    monkeypatch.setenv("OCTAVO_API_KEY", "")
    assert api_key(parser.parse_args(["serve"])) is None
    args = parser.parse_args(["serve", "--max-request-bytes", "1000", "--api-key-metrics"])
    assert args.max_request_bytes == 1000 and args.api_key_metrics
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-request-bytes", "0"])


# ---- methods -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/health", "/v1/models"])
def test_trace_is_405_with_allow(server, path):
    r = httpx.request("TRACE", server.url + path, headers=AUTH, timeout=30)
    _assert_error(r, 405)
    allowed = {m.strip() for m in r.headers["allow"].split(",")}
    assert "TRACE" not in allowed and allowed & {"GET", "POST"}


# ---- validation: a 400 that names the field, before any costly work --------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _nested_schema(levels: int) -> str:
    """A JSON schema as text, `levels` objects deep, built as text: json.dumps recurses."""
    return '{"type": "object", "properties": {"a": ' * levels + "{}" + "}}" * levels


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]},
         "messages", "role"),
        ("/tokenize", {"messages": [{"role": "root", "content": "hi"}]}, "messages", "role"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {" 1_0 ": 1}}, "logit_bias",
         "decimal"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u0661": 1}}, "logit_bias",
         "decimal"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"10\n": 1}}, "logit_bias",
         "decimal"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, "logit_bias",
         "decimal"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 1}}, "logit_bias",
         "vocabulary"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"49152": 1}}, "logit_bias",
         "vocabulary"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids",
         "vocabulary"),
        ("/v1/chat/completions", {**CHAT, "stop_token_ids": [49152]}, "stop_token_ids",
         "vocabulary"),
        ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [-1]}, "allowed_token_ids",
         "vocabulary"),
    ],
)  # fmt: skip
def test_bad_fields_are_400s_that_name_them(server, path, body, param, words):
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, headers=AUTH, timeout=30)
    error = _assert_error(r, 400, param)
    assert words in error["message"], error


def test_a_text_prompt_too_long_for_any_tokenization_is_refused_untokenized(server, monkeypatch):
    tokenized = []
    cls = type(server.ctx.tokenizer)
    for name in ("encode", "apply_chat_template"):
        method = getattr(cls, name)
        spy = lambda *a, _method=method, **k: tokenized.append(1) or _method(*a, **k)
        monkeypatch.setattr(cls, name, spy)
    text = "a" * (16 * server.ctx.max_model_len + 1)
    cases = [
        ("/v1/completions", {"prompt": text}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", text]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
        ("/tokenize", {"prompt": text}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": text}]}, "messages"),
    ]
    for path, body, param in cases:
        r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=30)
        assert "characters" in _assert_error(r, 400, param)["message"]
    assert tokenized == []
    for body in ({"prompt": text[:100]}, {"messages": [{"role": "user", "content": "hi"}]}):
        assert httpx.post(server.url + "/tokenize", json=body, headers=AUTH).status_code == 200
    assert len(tokenized) >= 2  # the spies see the tokenizer's work


@pytest.mark.parametrize(
    "field, levels",
    [("guided_json", 40), ("response_format", 40), ("guided_json", 400),
     ("structured_outputs", 2000)],
)  # fmt: skip
def test_a_json_schema_too_deep_is_a_400_without_a_recursion_error(server, field, levels):
    schema = _nested_schema(levels)
    if field == "guided_json" and levels > 100:
        value = json.dumps(schema)  # as a JSON string: the server parses it
    elif field == "response_format":
        value = '{"type": "json_schema", "json_schema": {"name": "x", "schema": ' + schema + "}}"
    elif field == "structured_outputs":
        value = json.dumps({"json": schema})
    else:
        value = schema
    raw = '{"prompt": "hi", "max_tokens": 1, "' + field + '": ' + value + "}"
    r = httpx.post(
        server.url + "/v1/completions",
        content=raw.encode(),
        headers=AUTH | {"Content-Type": "application/json"},
        timeout=30,
    )
    error = _assert_error(r, 400, field)
    assert "64 levels" in error["message"] and "Recursion" not in error["message"]


def test_a_json_schema_too_large_is_a_400(server):
    # Long names: over the character limit with few JSON items.
    properties = {f"p{i:060d}": {"type": "string"} for i in range(3000)}
    schema = {"type": "object", "properties": properties}
    body = {"prompt": "hi", "guided_json": schema}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert "limit" in _assert_error(r, 400, "guided_json")["message"]


def test_grammar_errors_are_short_and_name_no_python_class(server):
    grammar = "start: foo\nfoo: 'a' | bar baz\n" + "rule_x: 'y'\n" * 500
    body = {"prompt": "hi", "max_tokens": 1, "guided_grammar": grammar}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    message = _assert_error(r, 400, "structured_outputs")["message"]
    assert "does not compile" in message and len(message) < 300 and "rule_x" not in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": ["hi"]}),
        ("/tokenize", {"prompt": 5}),
        ("/tokenize", {}),
        ("/v1/completions", {"prompt": "hi", "guided_json": "[" * 100_000}),
    ],
)
def test_errors_name_no_python_class(server, path, body):
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=30)
    message = _assert_error(r, 400)["message"]
    assert not re.search(r"[A-Z][a-z]+[A-Z]\w*|Error\b", message), message


def test_a_good_json_schema_still_runs(server):
    schema = json.loads(_nested_schema(3))
    body = {"prompt": "hi", "max_tokens": 2, "guided_json": schema}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


# ---- the OpenAPI document ----------------------------------------------------------------


def test_openapi_lists_each_routes_error_responses(server):
    doc = httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=30).json()
    paths = doc["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = paths[path]["post"]["responses"]
        assert {"400", "401", "404", "413"} <= set(responses), (path, responses)
        assert "422" not in responses  # FastAPI's, which this server never sends
        ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorResponse")
    assert {"401", "404"} <= set(paths["/v1/models/{model_id}"]["get"]["responses"])
    assert "401" in paths["/v1/models"]["get"]["responses"]
    error = doc["components"]["schemas"]["ErrorInfo"]["properties"]
    assert set(error) == {"message", "type", "param", "code"}
