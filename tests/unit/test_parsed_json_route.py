"""The body's JSON is parsed once, on a thread in BodyLimitMiddleware; the routes read that
value and never parse on the event loop."""

from __future__ import annotations

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
