"""ASGI middleware that refuses a request before any route sees it: a missing or wrong API
key (401), a body over the size limit (413), and one with too many JSON arrays and objects
to parse (400). All answer in OpenAI's error format. The body's JSON is parsed on a thread
here, and the routes (ParsedJSONRoute) read it instead of parsing it on the event loop."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from octavo.entrypoints.openai.limits import JSON_TOO_DEEP, check_json_depth, check_json_items
from octavo.entrypoints.openai.metrics import ServerMetrics
from octavo.entrypoints.openai.serving import OpenAIError


def error_response(error: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body.model_dump(), status_code=error.status, headers=headers)


class APIKeyMiddleware:
    """401 without `Authorization: Bearer <api key>`, on every path but /health (a load
    balancer's probe) and, unless `guard_metrics`, /metrics (a Prometheus scraper's)."""

    def __init__(
        self, app: ASGIApp, api_key: str, metrics: ServerMetrics, guard_metrics: bool = False
    ) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.metrics = metrics
        self.open_paths = {"/health"} if guard_metrics else {"/health", "/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                self.metrics.count_error()
                error = OpenAIError(
                    "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                    401,
                    code="invalid_api_key",
                )
                await error_response(error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: at once when Content-Length says so, else once the
    bytes read so far pass it (a chunked body), without reading the rest. A 400 for a body
    with more JSON arrays, objects and members than `check_json_items` allows: parsing it
    would hold the event loop.

    The body is read here, up to the limit, and handed to the app as one message; later
    receives go to the client's connection (the routes watch it for a disconnect)."""

    def __init__(self, app: ASGIApp, max_bytes: int, metrics: ServerMetrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):  # their routes read no body
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to answer
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        data = b"".join(chunks)
        try:
            parsed = await asyncio.to_thread(_parse_json, data)
        except ValueError as e:
            self.metrics.count_error()
            await error_response(OpenAIError(str(e)))(scope, receive, send)
            return
        if parsed is not _NOT_JSON:
            scope[PARSED_JSON] = parsed
        body: Message | None = {"type": "http.request", "body": data}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics.count_error()
        error = OpenAIError(
            f"the request body is larger than this server's limit of {self.max_bytes} bytes",
            413,
            code="request_too_large",
        )
        await error_response(error, {"Connection": "close"})(scope, receive, send)


PARSED_JSON = "octavo.json"  # the scope's key for the body's JSON, once parsed
_NOT_JSON = object()


def _parse_json(data: bytes) -> Any:
    """The body's JSON value, or _NOT_JSON for an empty or malformed one (FastAPI then
    parses it again and answers its own error). ValueError from check_json_items."""
    check_json_items(data)
    try:
        value = json.loads(data) if data else _NOT_JSON
    except RecursionError:  # nested deeper than Python's parser goes
        raise ValueError(JSON_TOO_DEEP) from None
    except ValueError:
        return _NOT_JSON
    if isinstance(value, (dict, list)):
        check_json_depth(value)
    return value


class ParsedJSONRoute(APIRoute):
    """FastAPI's route, handing FastAPI the JSON that BodyLimitMiddleware parsed: Starlette's
    `Request.json()` returns `_json` when it is set."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            if PARSED_JSON in request.scope:
                request._json = request.scope[PARSED_JSON]
            return await handler(request)

        return route
