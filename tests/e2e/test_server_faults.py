"""The server under load and faults: /health answers while the largest allowed request is
being prepared, and full garbage collections skip the startup heap; an engine that cannot
come back stops the server with status 1; a shutdown gives streams a grace period, then
ends them with an error event.

Real uvicorn servers (octavo's Server) on the session's embedded engine, in this process;
the signals are played by calling the server's handler. tests/e2e/test_serve_process.py
sends real ones to `octavo serve`, and test_engine_process.py kills an engine process.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import threading
import time

import httpx
import pytest
from server_fixture import ServerThread

from octavo.entrypoints.openai.api_server import build_app
from octavo.entrypoints.openai.cli_serve import add_parser
from octavo.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BYTES, MAX_CHARS_PER_TOKEN

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(build_app(llm.engine, MODEL)) as s:
        yield s


def _health_latencies(url: str, stop: threading.Event) -> tuple[list[float], threading.Thread]:
    """Polls /health every 20 ms on a thread until `stop`: the time each answer took (a
    list the thread fills), and the thread, to join before reading the list."""
    latencies: list[float] = []

    def poll() -> None:
        while not stop.is_set():  # a connection each: no delayed ACK on a kept-alive one
            start = time.perf_counter()
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    return latencies, thread


def _largest_bodies(max_model_len: int) -> dict[str, bytes]:
    """Bodies near the limits that the server must tokenize in full before it can refuse
    them for the context: as many prompts at the character limit as the default body
    limit holds, and conversations of many messages with that many characters in all; and
    bodies at the size limit made of tiny items, refused before they are parsed or
    tokenized: one-token prompts, one-character prompts, empty messages, and long lists of ids
    (stop ids, ids to detokenize)."""
    chars = MAX_CHARS_PER_TOKEN * max_model_len
    words = "The quick brown fox jumps over the lazy dog. "
    text = (words * (chars // len(words) + 1))[:chars]
    num_prompts = DEFAULT_MAX_REQUEST_BYTES // (chars + 16)
    messages = [{"role": "user", "content": words[:32]}] * (chars // 32)
    ids_at_limit = DEFAULT_MAX_REQUEST_BYTES // 3 - 8  # "1, " each
    bodies = {
        "/v1/completions": {"model": MODEL, "prompt": [text] * num_prompts},
        "/v1/chat/completions": {"model": MODEL, "messages": messages},
        "/tokenize": {"model": MODEL, "messages": messages, "return_token_strs": True},
        "/v1/completions token ids": {"prompt": [[1]] * (DEFAULT_MAX_REQUEST_BYTES // 5 - 8)},
        "/v1/completions texts": {"prompt": ["a"] * (DEFAULT_MAX_REQUEST_BYTES // 5 - 8)},
        "/v1/chat/completions empty": {"messages": [{"role": "user", "content": ""}] * 127_000},
        "/v1/completions stop ids": {
            "prompt": "hi",
            "max_tokens": 1,
            "stop_token_ids": [1] * (ids_at_limit - 10),
        },
        "/detokenize": {"tokens": [1] * ids_at_limit},
    }
    return {path: json.dumps(body).encode() for path, body in bodies.items()}


@pytest.mark.alone
@pytest.mark.parametrize(
    "body_name",
    ["/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/completions token ids",
     "/v1/completions texts", "/v1/chat/completions empty", "/v1/completions stop ids",
     "/detokenize"],
)  # fmt: skip
def test_health_answers_within_100_ms_while_the_largest_request_is_prepared(server, body_name):
    """A blocked event loop stalls /health every time; a busy machine's scheduler only now
    and then: the best of three tries must stay under 100 ms."""
    body = _largest_bodies(server.ctx.max_model_len)[body_name]  # encoded before the clock
    assert len(body) <= DEFAULT_MAX_REQUEST_BYTES
    path = body_name.split(" ")[0]
    tries = []
    for _ in range(3):
        stop = threading.Event()
        latencies, poller = _health_latencies(server.url, stop)
        time.sleep(0.2)
        start = time.perf_counter()
        headers = {"Content-Type": "application/json"}
        r = httpx.post(server.url + path, content=body, headers=headers, timeout=120)
        took = time.perf_counter() - start
        stop.set()
        poller.join(30)
        assert r.status_code in (200, 400), r.text[:300]
        tries.append((max(latencies), sorted(latencies)[-5:], took))
        if tries[-1][0] < 0.1:
            break
    assert min(t[0] for t in tries) < 0.1, tries


def test_while_serving_full_collections_skip_the_startup_heap_and_come_rarer(llm):
    """A full collection over the startup heap, or over a burst's requests in flight, held
    the event loop (and /health) for 100-250 ms."""
    before = gc.get_threshold()
    with ServerThread(build_app(llm.engine, MODEL)) as server:
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (*before[:2], before[2] * 10)
    assert gc.get_threshold() == before


def _stream_events(server, max_tokens: int):
    """The `data:` lines of a streamed completion, as they come."""
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        yield from (line for line in r.iter_lines() if line.startswith("data:"))


def test_a_dead_engine_that_cannot_restart_stops_the_server_with_status_1(llm):
    with ServerThread(build_app(llm.engine, MODEL), restart_engine=False) as server:
        server.ctx.engine._commands.put(None)  # a command the engine loop cannot read: it dies
        server.thread.join(30)
        assert not server.thread.is_alive() and server.server.exit_code == 1


def test_shutdown_gives_a_stream_its_grace_then_ends_it_with_an_error_and_done(llm):
    app = build_app(llm.engine, MODEL)
    with ServerThread(app, shutdown_timeout=1.0) as server:
        events = _stream_events(server, max_tokens=4000)
        assert next(events).startswith("data: {")
        signalled = time.perf_counter()
        server.server.handle_exit(signal.SIGTERM, None)
        rest = list(events)
        ended = time.perf_counter() - signalled
        server.thread.join(30)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(server.url + "/health")
    assert 1.0 <= ended < 10, ended
    assert len(rest) > 3  # tokens kept coming during the grace period
    error = json.loads(rest[-2][len("data: ") :])["error"]
    assert "shutting down" in error["message"] and rest[-1] == "data: [DONE]"
    assert not server.thread.is_alive() and server.server.exit_code == 0


def test_serve_restarts_and_waits_30_s_unless_told_otherwise():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert args.restart and args.shutdown_timeout == 30.0
    args = parser.parse_args(["serve", "--no-restart", "--shutdown-timeout", "0.5"])
    assert not args.restart and args.shutdown_timeout == 0.5
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--shutdown-timeout", bad])
