"""ASGI middleware that refuses a request before any route sees it: a missing or wrong API
key (401), a body over the size limit (413), and one with too many JSON arrays and objects
to parse (400). All answer in OpenAI's error format. The body's JSON is parsed on a thread
here, and the routes (ParsedJSONRoute) read it instead of parsing it on the event loop; a
few requests at a time are admitted to that parsing and the routes' preparation."""

from __future__ import annotations

import asyncio
import hmac
import json
import weakref
from collections.abc import Callable
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from octavo.entrypoints.openai.limits import (
    JSON_TOO_DEEP,
    MAX_ADMITTING,
    check_json_depth,
    check_json_items,
)
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
    receives go to the client's connection (the routes watch it for a disconnect). Once read
    whole, a body waits for one of `max_admitting` places (AdmissionGate) before it is
    parsed, so that a burst of requests is admitted a few at a time."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        metrics: ServerMetrics,
        max_admitting: int = MAX_ADMITTING,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.gate = AdmissionGate(max_admitting)

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
        data = await self._read_body(scope, receive, send)
        if data is None:
            return
        leave = await self.gate.enter()
        try:
            await self._admitted(scope, receive, send, data, leave)
        finally:
            leave()

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body; None once the client left or the body was refused (413)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to answer
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _admitted(
        self, scope: Scope, receive: Receive, send: Send, data: bytes, leave: Callable[[], None]
    ) -> None:
        """Parses the body on a thread, then runs the app; `leave` gives the admission place
        back once the app waits on the client (its request is with the engine) or answers."""
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
            leave()
            return await receive()

        async def answer(message: Message) -> None:
            leave()
            await send(message)

        await self.app(scope, replay, answer)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics.count_error()
        error = OpenAIError(
            f"the request body is larger than this server's limit of {self.max_bytes} bytes",
            413,
            code="request_too_large",
        )
        await error_response(error, {"Connection": "close"})(scope, receive, send)


class AdmissionGate:
    """At most `limit` requests admitted at once; the others wait in order of arrival. One
    asyncio.Semaphore per event loop (an app may be served by several loops, in tests)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the admission limit must be >= 1, got {limit}")
        self.limit = limit
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # by loop

    async def enter(self) -> Callable[[], None]:
        """Waits for a place; returns the function that gives it back (once, however often
        it is called)."""
        loop = asyncio.get_running_loop()
        semaphore = self._semaphores.get(loop)
        if semaphore is None:
            semaphore = self._semaphores[loop] = asyncio.Semaphore(self.limit)
        await semaphore.acquire()
        held = True

        def leave() -> None:
            nonlocal held
            if held:
                held = False
                semaphore.release()

        return leave


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
