"""The Engine in a process of its own, behind AsyncEngine's asyncio interface: `octavo serve`.

    server process (event loop)                      engine process (owns the Engine)
    generate() -> writer thread --AddCommand / AbortCommand / _Stop--> pipe
                                                     -> drain commands; step()
    reader thread <-- ("step", outputs, stats) <-- pipe <-- one message per step

The event loop never waits on the pipe: a long prompt fills the pipe's buffer until the engine
process reads it between two steps, so a writer thread sends the commands.

Why a process: an Engine on a thread of the server's process shares the GIL with the event
loop, which runs Python for every streamed chunk. With many streams open the loop alone holds
the GIL about as long as the GPU takes for a step, and the engine waits for it (see
docs/PERFORMANCE.md). vLLM runs its engine core in a process of its own for the same reason.

The engine process builds the Engine itself (`build_engine(**options)`; spawned, so CUDA is
set up there only) and runs the same loop as AsyncEngine's thread. Outputs cross the pipe
pickled, one message per step; a request's prompt ids cross once, with its first output
(the server asks for DELTA outputs, so the rest of a message is the step's new tokens).
The server process keeps the tokenizer for prompts and chat templates. Requests and their
errors behave as with AsyncEngine: a rejected prompt raises ValueError, a failed step
EngineStepError, and a dead engine EngineDeadError, in `generate`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import signal
import threading
from dataclasses import dataclass
from typing import Any

from octavo.config import DEFAULT_KV_IDLE_RELEASE_S
from octavo.engine.async_engine import AsyncEngine
from octavo.engine.engine_loop import (
    AddCommand,
    EngineDeadError,
    EngineStepError,
    IdleRelease,
    apply_command,
    describe,
    loop_died,
    step_engine,
)
from octavo.engine.gc_heap import frozen_gc_heap
from octavo.engine.spawn import start_engine_process
from octavo.outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class _Stop:
    pass


class EngineProcess(AsyncEngine):
    """An AsyncEngine whose Engine lives in a child process. Build it with `start_process`,
    then use it as an AsyncEngine (`call` is not available: the Engine is not here); after
    the process dies, `restart` starts another."""

    def __init__(
        self,
        process,
        conn,
        max_model_len: int,
        vocab_size: int,
        stats: dict,
        tokenizer,
        options: dict | None = None,
    ) -> None:
        # NOTE: AsyncEngine.__init__ is not called: it needs the Engine, which is not here.
        self.engine = None
        self._options = options  # build_engine's, for a restart
        self._process = process
        self._conn = conn
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # for the writer thread
        self._writer: threading.Thread | None = None
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._init_event_loop_side(stats)
        self._prompt_ids: dict[str, list[int]] = {}  # by engine id, of requests with a consumer

    @classmethod
    def start_process(cls, started: tuple[Any, Any] | None = None, **options: Any) -> EngineProcess:
        """Spawns the engine process, which runs `build_engine(**options)` (or takes the one
        `spawn.start_engine_process(options)` started); waits until it is built and raises
        what building raised (ValueError for bad options)."""
        # The server's own tokenizer loads while the engine is built (a GGUF tokenizer takes
        # seconds to convert); an error in building wins over one in loading.
        loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="octavo-tokenizer")
        tokenizer = loader.submit(_server_tokenizer, options)
        loader.shutdown(wait=False)
        process, conn = started or start_engine_process(options)
        max_model_len, vocab_size, stats = _wait_built(process, conn)
        return cls(process, conn, max_model_len, vocab_size, stats, tokenizer.result(), options)

    async def restart(self) -> None:
        """Starts a new engine process with the same options once this one has died (the
        requests it held have failed with EngineDeadError); raises what building raises.
        Requests made meanwhile fail with EngineDeadError."""
        if self._options is None:
            raise RuntimeError("this engine was not started by start_process: no options")
        await self.shutdown()  # joins the pipe's threads, so no message of the old process is left
        await asyncio.sleep(0)  # runs the reader's last callback (`_close`) before we reopen
        self._process, self._conn, (_, _, self._stats) = await asyncio.to_thread(
            _spawn, self._options
        )
        self._commands = queue.SimpleQueue()  # aborts for the old process: nobody to read them
        self._closed, self.error = False, None
        self.start()
        self.restarts += 1

    # ---- what the server reads --------------------------------------------------------

    tokenizer = property(lambda self: self._tokenizer)
    max_model_len = property(lambda self: self._max_model_len)
    vocab_size = property(lambda self: self._vocab_size)

    @property
    def is_running(self) -> bool:
        return super().is_running and self._process.is_alive()

    # ---- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        if self._loop is not None:
            raise RuntimeError("the engine loop is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._read, name="octavo-engine-pipe", daemon=True)
        self._thread.start()
        self._writer = threading.Thread(target=self._write, name="octavo-engine-send", daemon=True)
        self._writer.start()

    async def shutdown(self) -> None:
        """Stops the engine process after its current step; unfinished requests are aborted.
        A process that does not stop within 30 s (a hung device, say) is killed. Calling it
        again does nothing."""
        if self._conn.closed:
            return
        if self._writer is not None:
            self._commands.put(_Stop())
        else:  # never started: no writer thread
            with contextlib.suppress(OSError):
                self._conn.send(_Stop())
        await asyncio.to_thread(self._process.join, 30)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join)
        for thread in (self._thread, self._writer):  # the pipe is closed at the far end
            if thread is not None:
                await asyncio.to_thread(thread.join)
        self._conn.close()
        self._thread = self._writer = self._loop = None

    def _write(self) -> None:
        """The writer thread: sends each command in order until _Stop. If the engine process
        is gone, a new request fails and anything else has nothing left to do."""
        while True:
            command = self._commands.get()
            try:
                self._conn.send(command)
            except Exception as e:  # noqa: BLE001 - the process is gone, or pickle refused
                if isinstance(e, OSError):
                    error = EngineDeadError(f"the engine process exited ({self._process.exitcode})")
                else:
                    logger.warning("could not send %s to the engine process: %r", type(command), e)
                    error = ValueError(f"the request cannot be sent to the engine process: {e!r}")
                if isinstance(command, AddCommand):
                    self._post(self._deliver_error, command.request_id, error)
            if isinstance(command, _Stop):
                return

    def _submit_call(self, fn):
        raise NotImplementedError("the Engine runs in another process: `call` cannot reach it")

    # ---- the pipe-reading thread ------------------------------------------------------

    def _read(self) -> None:
        error: BaseException = EngineDeadError("the server is shutting down")
        try:
            while True:
                kind, *rest = self._conn.recv()
                if kind == "step":
                    outputs, self._stats = rest
                    if outputs:
                        self._post(self._dispatch, outputs)
                elif kind == "reject":
                    self._post(self._deliver_error, rest[0], ValueError(rest[1]))
                elif kind == "fail":
                    self._post(self._fail, rest[0], EngineStepError(rest[1]))
                else:  # "stopped", or "dead" with why
                    if kind == "dead":
                        error = self.error = EngineDeadError(rest[0])
                    break
        except (EOFError, OSError):
            self._process.join(5)  # for its exit code
            code = self._process.exitcode
            error = self.error = EngineDeadError(f"the engine process exited ({code})")
            logger.error("%s", error)
        except BaseException as e:  # a message this side cannot read: a bug
            logger.exception("reading the engine process's pipe failed")
            error = self.error = EngineDeadError(f"reading the engine's pipe failed: {describe(e)}")
        finally:
            self._post(self._close, error)

    # ---- event-loop callbacks ---------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._stream_for(out.request_id)
            if target is None:
                continue
            if out.prompt_token_ids is None:  # sent with an earlier output (_prompt_ids_once)
                ids = self._prompt_ids.get(out.request_id)
                if ids is None:  # not expected: an engine id's first output carries them
                    continue
                out.prompt_token_ids = ids
            else:
                self._prompt_ids[out.request_id] = out.prompt_token_ids
            out.request_id, stream = target  # the caller's id, not the engine's
            stream.put_nowait(out)

    def _forget(self, request_id: str) -> None:
        self._prompt_ids.pop(self._engine_ids.get(request_id, ""), None)
        super()._forget(request_id)


def _spawn(options: dict) -> tuple[Any, Any, tuple[int, int, dict]]:
    process, conn = start_engine_process(options)
    return process, conn, _wait_built(process, conn)


def _wait_built(process, conn) -> tuple[int, int, dict]:
    """Waits until the engine process has built its Engine: (max_model_len, vocab_size,
    stats); raises what building raised."""
    try:
        message = conn.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"the engine process exited ({process.exitcode})") from None
    if message[0] == "failed":
        process.join()
        raise message[1]
    return tuple(message[1:])


def _server_tokenizer(options: dict):
    from octavo.engine.builder import resolve_model
    from octavo.tokenizer.tokenizer import load_tokenizer

    name = options.get("tokenizer") or options.get("model")
    return load_tokenizer(resolve_model(name, options.get("revision")))


class _ServerGone(Exception):
    """The server's end of the pipe is closed."""


class _Pipe:
    """The engine process's end of the pipe; a closed pipe raises _ServerGone, so that an
    OSError from the engine itself is not mistaken for the server going away."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def send(self, message: Any) -> None:
        self._call(self.conn.send, message)

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self._call(self.conn.poll, timeout)

    def recv(self) -> Any:
        return self._call(self.conn.recv)

    @staticmethod
    def _call(method, *args) -> Any:
        try:
            return method(*args)
        except (EOFError, OSError) as e:
            raise _ServerGone from e


def engine_process_main(conn, options: dict) -> None:
    """The engine process: build the Engine, then step it and answer commands until told
    to stop or until the server's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops us
    from octavo.engine.builder import build_engine

    idle_release_s = options.pop("kv_idle_release_s", DEFAULT_KV_IDLE_RELEASE_S)
    try:
        engine = build_engine(**options)
    except BaseException as e:  # noqa: BLE001 - raised again in the server process
        conn.send(("failed", e if isinstance(e, ValueError) else RuntimeError(repr(e))))
        return
    max_model_len = engine.scheduler_config.max_model_len
    conn.send(("ready", max_model_len, engine.vocab_size, engine.get_stats()))
    conn = _Pipe(conn)
    live: dict = {}  # request id -> Request
    announced: set[str] = set()  # requests whose prompt ids the server has
    idle = IdleRelease(engine, idle_release_s)

    def fail(request_ids: list[str], error: Exception) -> None:
        conn.send(("fail", request_ids, str(error)))

    try:
        with frozen_gc_heap(collect_first=True):
            while True:
                outputs: list[RequestOutput] = []  # from aborts first, then from the step
                block = not engine.has_unfinished_requests()
                if block and not conn.poll(idle.timeout()):
                    idle.release()
                    continue
                if not _apply_commands(conn, engine, live, block, fail, outputs):
                    break
                if engine.has_unfinished_requests():
                    outputs += step_engine(engine, live, fail)
                    idle.stepped = True
                _prompt_ids_once(outputs, announced, live)
                conn.send(("step", outputs, engine.get_stats()))  # stats also after an abort
    except _ServerGone:
        return
    except BaseException as e:  # a bug in the loop: tell the server
        logger.exception("the engine loop died")
        with contextlib.suppress(_ServerGone):
            conn.send(("dead", loop_died(e)))
        return
    if live:
        engine.abort_request(list(live))
    with contextlib.suppress(_ServerGone):
        conn.send(("stopped",))


def _apply_commands(conn, engine, live: dict, block: bool, fail, outputs: list) -> bool:
    """Applies every command waiting in the pipe (waiting for one if `block`), adding the
    outputs of aborted requests to `outputs`; False on stop."""

    def reject(request_id: str, error: ValueError) -> None:
        conn.send(("reject", request_id, str(error)))

    while block or conn.poll():
        block = False
        command = conn.recv()
        if isinstance(command, _Stop):
            return False
        outputs += apply_command(engine, live, command, reject, fail)
    return True


def _prompt_ids_once(outputs: list[RequestOutput], announced: set[str], live: dict) -> None:
    """Leaves a request's prompt ids out of every output after its first (None; the server
    puts them back), so that a step's message does not grow with the prompts' lengths.
    NOTE: an engine id is never used twice (AsyncEngine's `n#request_id`), so an id in
    `announced` is always the request that announced it."""
    for out in outputs:
        if out.request_id in announced:
            out.prompt_token_ids = None  # type: ignore[assignment]
        else:
            announced.add(out.request_id)
    announced.intersection_update(live)  # finished, aborted and failed requests leave
