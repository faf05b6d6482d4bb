"""How `octavo serve` lives and dies: uvicorn's server, plus what it does when the engine dies
and when it is told to stop.

- The engine dies: the requests it held have failed (503, or an error event in a stream).
  An engine process is started again after a backoff, up to MAX_RESTARTS times in a row,
  /health answering 503 meanwhile. With restarts off, or when they all fail, the server
  exits with status 1, so that a supervisor (systemd, Kubernetes) starts it again.
- SIGTERM or SIGINT: stop accepting connections, give the requests in flight
  `shutdown_timeout` seconds, then fail those left (a stream ends with an error event and
  `data: [DONE]`), stop the engine, and exit 0. A second signal exits at once, with status
  128 + the signal's number.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from types import FrameType

import uvicorn

from octavo.engine.async_engine import AsyncEngine
from octavo.engine.engine_process import EngineProcess

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3  # in a row, before the server gives up and exits
RESTART_BACKOFF_S = 0.5  # before the first restart; doubled before each further one
_WATCH_INTERVAL_S = 0.2


class Server(uvicorn.Server):
    """uvicorn's server over an app whose engine is `engine`, with the restarts and the
    shutdown above. After `run()`, `exit_code` is the status the process should exit with."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncEngine,
        *,
        restart_engine: bool = True,
        shutdown_timeout: float = 30.0,
    ) -> None:
        # A response still open 5 s past the deadline (a client that does not read its
        # stream) has its task cancelled by uvicorn.
        config.timeout_graceful_shutdown = shutdown_timeout + 5
        super().__init__(config)
        self.engine = engine
        self.restart_engine = restart_engine
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._watcher: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: uvicorn's own handler re-raises the signal after the shutdown, which would
        # end the process with the signal instead of status 0.
        if self.should_exit:  # the second signal: nothing is waited for
            os._exit(128 + sig)
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._watcher = asyncio.create_task(self._watch_engine())

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        # Past the deadline the engine stops, failing every request it still has; their
        # responses then end, and uvicorn's wait for the connections with them.
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(
            self.shutdown_timeout, lambda: loop.create_task(self._stop_engine())
        )
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _stop_engine(self) -> None:
        logger.warning("shutdown: %s s passed; failing the requests left", self.shutdown_timeout)
        await self.engine.shutdown()

    async def _watch_engine(self) -> None:
        """Restarts the engine each time it dies, or makes the server exit with status 1."""
        while not self.should_exit:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if self.engine.is_running or self.should_exit:
                continue
            logger.error("the engine died: %s", self.engine.error)
            if not (self.restart_engine and await self._restart()):
                logger.error("the engine is not restarted: the server exits")
                self.exit_code = 1
                self.should_exit = True

    async def _restart(self) -> bool:
        if not isinstance(self.engine, EngineProcess):  # an engine on a thread: no restart
            return False
        for attempt in range(MAX_RESTARTS):
            await asyncio.sleep(RESTART_BACKOFF_S * 2**attempt)
            try:
                await self.engine.restart()
            except Exception:  # logged; the next attempt may succeed
                logger.exception("restarting the engine failed (attempt %d)", attempt + 1)
            else:
                logger.warning("the engine is running again")
                return True
        return False
