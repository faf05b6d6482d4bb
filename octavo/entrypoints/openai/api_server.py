"""`octavo serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one Engine.

    POST /v1/completions, POST /v1/chat/completions   (JSON or SSE with `stream: true`)
    POST /tokenize, /detokenize                       (vLLM's)
    GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus), /version

Every error is answered in OpenAI's format, `{"error": {"message", "type", "param", "code"}}`,
with its HTTP status (400 bad input, 401 bad key, 404 unknown model, 405 a method the route
has not, 413 a body over the limit, 500/503 engine failure);
no error reaches the engine loop or the other requests.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

import octavo
from octavo.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError
from octavo.engine.engine import Engine
from octavo.engine.gc_heap import frozen_gc_heap
from octavo.entrypoints.openai.guards import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    ParsedJSONRoute,
    error_response,
)
from octavo.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BYTES
from octavo.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from octavo.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from octavo.entrypoints.openai.serving import (
    ChatOptions,
    ClientDisconnected,
    OpenAIError,
    ServingContext,
    error_from_exception,
)
from octavo.entrypoints.openai.serving_chat import create_chat_completion
from octavo.entrypoints.openai.serving_completion import create_completion
from octavo.entrypoints.openai.serving_tokenization import detokenize, tokenize

logger = logging.getLogger(__name__)


def build_app(
    engine: Engine | AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    *,
    api_key_metrics: bool = False,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    chat: ChatOptions | None = None,
    chat_template: str | None = None,
) -> FastAPI:
    """The server's ASGI app over an Engine, or an AsyncEngine (`AsyncEngine.build` keeps
    the CPU's torch work on one thread; `EngineProcess` runs the Engine in a process of its
    own, as `octavo serve` does). The engine loop starts and stops with the app's
    lifespan; its state is in `app.state.ctx` (a ServingContext). `chat` picks how chat
    replies are read (tool calls, reasoning); `chat_template` replaces the model's.

    `api_key` guards every route but /health, and /metrics unless `api_key_metrics`; a
    body over `max_request_bytes` is refused with a 413 before it is read whole."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    metrics = ServerMetrics(
        lambda: async_engine.stats if async_engine.is_running else None,
        lambda: async_engine.restarts,
    )
    if chat_template is not None and async_engine.tokenizer is None:
        raise ValueError("a chat template needs a tokenizer, and this model has none")
    ctx = ServingContext(
        async_engine, model_name, async_engine.max_model_len, metrics, chat or ChatOptions(),
        chat_template,
    )  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            with _collector_for_serving():
                yield
        finally:
            await async_engine.shutdown()

    app = FastAPI(title="octavo", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.router.route_class = ParsedJSONRoute
    app.state.ctx = ctx
    _add_error_handlers(app, metrics)
    _add_routes(app, ctx)
    _document_errors_only_as_sent(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes, metrics=metrics)
    if api_key:  # added last, so it runs first: no body is read for a stranger
        app.add_middleware(
            APIKeyMiddleware, api_key=api_key, metrics=metrics, guard_metrics=api_key_metrics
        )
    return app


@contextmanager
def _collector_for_serving() -> Iterator[None]:
    """The garbage collector while the app serves. A full collection holds the event loop
    while it walks every tracked object, so the startup heap (torch, the tokenizer, the web
    stack) is hidden from it (frozen_gc_heap), and full collections come 10 times rarer than
    Python's default, as a burst's requests in flight are many objects and few reference
    cycles (docs/PERFORMANCE.md, "CPU: a busy machine")."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, full * 10)
    try:
        with frozen_gc_heap():
            yield
    finally:
        gc.set_threshold(young, middle, full)


async def _on_thread(fn, *args) -> JSONResponse:
    """fn(*args)'s pydantic answer, computed and rendered to JSON off the event loop."""
    return await asyncio.to_thread(lambda: JSONResponse(fn(*args).model_dump()))


_ERROR_DESCRIPTIONS = {
    400: "Bad request: the error's `param` names the field",
    401: "Missing or wrong API key (when the server has one)",
    404: "Unknown model",
    413: "Request body over the server's limit",
    500: "The engine failed on this request",
    503: "The engine is not running",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's error responses for the OpenAPI document, each in OpenAI's format."""
    return {s: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[s]} for s in statuses}


def _document_errors_only_as_sent(app: FastAPI) -> None:
    """Drops FastAPI's 422 from the OpenAPI document: a body that fails validation is
    answered with a 400 (see `_validation_error`)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):  # what the 422s named
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/completions", responses=_errors(400, 401, 404, 413, 500, 503))
    async def completions(req: CompletionRequest, raw: HTTPRequest) -> Response:
        return await create_completion(ctx, req, raw)

    @app.post("/v1/chat/completions", responses=_errors(400, 401, 404, 413, 500, 503))
    async def chat_completions(req: ChatCompletionRequest, raw: HTTPRequest) -> Response:
        return await create_chat_completion(ctx, req, raw)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 401, 404, 413))
    async def tokenize_route(req: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        return await _on_thread(tokenize, ctx, req)

    @app.post(
        "/detokenize", response_model=DetokenizeResponse, responses=_errors(400, 401, 404, 413)
    )
    async def detokenize_route(req: DetokenizeRequest) -> Response:
        return await _on_thread(detokenize, ctx, req)

    @app.get("/version", responses=_errors(401))
    async def version() -> dict[str, str]:
        return {"version": octavo.__version__}

    @app.get("/v1/models", responses=_errors(401))
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len)])

    @app.get("/v1/models/{model_id:path}", responses=_errors(401, 404))
    async def get_model(model_id: str) -> ModelCard:
        ctx.check_model(model_id)
        return ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len)

    @app.api_route("/health", methods=["GET", "HEAD"], responses=_errors(503))
    async def health() -> Response:
        if ctx.engine.is_running:
            return JSONResponse({"status": "ok"})
        return error_response(OpenAIError("the engine loop is not running", 503, "server_error"))

    @app.get("/metrics", responses=_errors(401), response_class=_MetricsText)
    async def metrics() -> Response:
        return _MetricsText(ctx.metrics.render())


class _MetricsText(Response):
    """Prometheus' text format (so the OpenAPI document says so, not JSON)."""

    media_type = CONTENT_TYPE


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: HTTPRequest, e: RequestValidationError) -> Response:
        metrics.count_error()
        return error_response(_validation_error(e))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: HTTPRequest, e: HTTPException) -> Response:
        metrics.count_error()
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        error = OpenAIError(str(e.detail), e.status_code, kind)
        return error_response(error, e.headers)  # a 405's `Allow`, say

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(request: HTTPRequest, e: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed"

    async def on_error(request: HTTPRequest, e: Exception) -> Response:
        error = error_from_exception(e)
        if error.status >= 500:
            logger.error("request failed: %r", e)
        metrics.count_error()
        return error_response(error)

    for kind in (OpenAIError, ValueError, EngineStepError, EngineDeadError):
        app.add_exception_handler(kind, on_error)
    # Anything else is a bug: answered with a 500 in the same format, then logged by uvicorn.
    app.add_exception_handler(Exception, on_error)


def _validation_error(e: RequestValidationError) -> OpenAIError:
    """FastAPI's list of schema errors -> one 400 that names the first bad field."""
    errors: list[dict[str, Any]] = list(e.errors())
    if not errors:
        return OpenAIError("invalid request body")
    # A field that is there but wrong says more than one that is missing: of a union's
    # members (/tokenize's prompt or messages), the one the client meant has it.
    first = next((e for e in errors if e.get("type") != "missing"), errors[0])
    # A union's errors carry its member's class in their place (`TokenizeChatRequest`):
    # field names are lower case, and the client is told fields only.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not str(p)[:1].isupper()]
    msg = re.sub(r"instance of [A-Z]\w*", "object", str(first.get("msg")))
    if first.get("type") == "json_invalid":
        return OpenAIError(f"the body is not valid JSON: {msg}")
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return OpenAIError(f"{where}: {msg}{more}", param=loc[0] if loc else None)
