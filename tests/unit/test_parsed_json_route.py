"""The body's JSON is parsed once, on a thread in BodyLimitMiddleware; the routes read that
value and never parse on the event loop. A few requests at a time are admitted to that."""

from __future__ import annotations

import asyncio
import json

import starlette.requests
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from octavo.entrypoints.openai.guards import BodyLimitMiddleware, ParsedJSONRoute
from octavo.entrypoints.openai.metrics import ServerMetrics


class Body(BaseModel):
    tokens: list[int]


def _app() -> FastAPI:
    app = FastAPI()
    app.router.route_class = ParsedJSONRoute

    @app.post("/sum")
    async def total(body: Body) -> int:
        return sum(body.tokens)

    app.add_middleware(BodyLimitMiddleware, max_bytes=1 << 20, metrics=ServerMetrics(lambda: None))
    return app


def test_routes_read_the_json_the_middleware_parsed(monkeypatch):
    class NoParsing:
        @staticmethod
        def loads(*_):
            raise AssertionError("the route parsed the body again")

    monkeypatch.setattr(starlette.requests, "json", NoParsing)
    client = TestClient(_app())
    assert client.post("/sum", json={"tokens": [1, 2, 3]}).json() == 6
    # A body that is not JSON is left to FastAPI, which answers its own error.
    monkeypatch.undo()
    r = client.post("/sum", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422


def test_json_items_and_values_over_their_limits_are_refused_before_parsing():
    from octavo.entrypoints.openai.limits import (
        MAX_JSON_ARRAY_VALUES,
        MAX_JSON_ITEMS,
        check_json_items,
    )

    def check(value) -> bool:
        try:
            check_json_items(json.dumps(value).encode())
        except ValueError:
            return False
        return True

    assert check({"tokens": [1] * MAX_JSON_ARRAY_VALUES})  # commas: one fewer than values
    assert not check({"tokens": [1] * (MAX_JSON_ARRAY_VALUES + 2)})
    assert check({"prompt": [[1]] * (MAX_JSON_ITEMS - 3)})  # with {, : and the outer [
    assert not check({"prompt": [[1]] * (MAX_JSON_ITEMS - 2)})
    # Inside strings, brackets, colons and commas are text.
    assert check({"prompt": "[{:," * (MAX_JSON_ARRAY_VALUES + MAX_JSON_ITEMS)})
    # Bodies with more quotes than commas are counted item by item, the others string by string.
    assert check({"prompt": ["a,"] * (MAX_JSON_ARRAY_VALUES // 2 + 10)})
    assert not check({"prompt": ["a"] * (MAX_JSON_ARRAY_VALUES + 2)})


def _post_scope() -> dict:
    return {"type": "http", "method": "POST", "path": "/x", "headers": []}


def _exchange(body: bytes = b"{}"):
    """An ASGI receive that gives `body`, then waits until `leave` is set and says the
    client left; and a send that keeps what it is given."""
    leave, sent = asyncio.Event(), []
    messages = [{"type": "http.request", "body": body}]

    async def receive():
        if messages:
            return messages.pop()
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    return receive, send, leave, sent


def test_a_few_requests_at_a_time_are_admitted_until_they_wait_on_the_client_or_answer():
    """Past the gate, a request holds its place until the app waits on the client (a route
    whose request is with the engine) or sends its answer; the others wait their turn."""
    admitted: list[int] = []
    inside = 0

    async def app(scope, receive, send):
        nonlocal inside
        await receive()  # the body
        inside += 1
        admitted.append(inside)
        await asyncio.sleep(0.01)
        inside -= 1
        if scope["path"] == "/answer":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await asyncio.sleep(0.01)
        else:
            await receive()  # waits on the client, as a route with the engine does

    async def main():
        middleware = BodyLimitMiddleware(app, 1 << 20, ServerMetrics(lambda: None), 2)
        exchanges = [_exchange() for _ in range(8)]
        tasks = [
            asyncio.create_task(middleware(_post_scope() | {"path": p}, receive, send))
            for (receive, send, _, _), p in zip(exchanges, ["/answer", "/wait"] * 4, strict=True)
        ]
        await asyncio.sleep(0.5)
        assert len(admitted) == 8 and max(admitted) == 2, admitted  # none left waiting
        for _, _, leave, _ in exchanges:
            leave.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_a_refused_body_gives_its_place_back():
    async def app(scope, receive, send):
        raise AssertionError("the app saw a body the middleware refused")

    async def main():
        middleware = BodyLimitMiddleware(app, 1 << 20, ServerMetrics(lambda: None), 1)
        for _ in range(3):  # one place: each must give it back
            receive, send, _, sent = _exchange(b"[" * 300 + b"]" * 300)
            await asyncio.wait_for(middleware(_post_scope(), receive, send), 5)
            assert sent[0]["status"] == 400

    asyncio.run(main())
