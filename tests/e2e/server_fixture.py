"""A real `octavo serve` app under octavo's uvicorn server, in a background thread of the test
process, on a free loopback port (the socket is bound to port 0 before uvicorn starts)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Self

import uvicorn

from octavo.entrypoints.openai.lifecycle import Server
from octavo.entrypoints.openai.serving import ServingContext


class ServerThread:
    """Runs an app of `build_app` with octavo's Server until the `with` block ends;
    `lifecycle` are the Server's options (restart_engine, shutdown_timeout). The server
    cannot catch signals off the main thread: `server.handle_exit` plays them."""

    def __init__(self, app, **lifecycle) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self.server = Server(config, app.state.ctx.engine, **lifecycle)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ctx(self) -> ServingContext:
        return self.app.state.ctx

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def wait_for(predicate, timeout: float = 10.0) -> bool:
    """Polls `predicate` until it holds or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
