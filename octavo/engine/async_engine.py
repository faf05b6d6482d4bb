"""The Engine behind an asyncio server: one thread steps it, requests stream through queues.

    asyncio side (event loop)                  engine thread (owns the Engine)
    generate() --("add", ...)--> commands -->  drain commands: add_request / abort_request
              <-- per-request asyncio.Queue <-- step() -> outputs, routed by request id

The Engine is not thread-safe, so only the engine thread ever calls it; everything else
sends it commands, which it drains between steps (`AsyncEngine.build` also builds it there,
so that on the CPU one thread alone runs torch's parallel ops). Outputs cross back to the
event loop in one `call_soon_threadsafe` per step. A consumer that goes away (client
disconnect, task cancelled) aborts its request, which frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from octavo.config import DEFAULT_KV_IDLE_RELEASE_S
from octavo.core.request import Request
from octavo.engine.engine import Engine
from octavo.engine.engine_loop import (
    STOP,
    AbortCommand,
    AddCommand,
    CallCommand,
    EngineDeadError,
    EngineStepError,
    IdleRelease,
    apply_command,
    describe,
    loop_died,
    step_engine,
)
from octavo.engine.gc_heap import frozen_gc_heap
from octavo.engine.prompts import request_id_list
from octavo.outputs import RequestOutput
from octavo.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Runs an Engine in a background thread and streams each request's outputs.

    Use from one asyncio event loop: `start()` inside it, then `generate()` from any
    number of tasks, and `await shutdown()` at the end.
    """

    restarts = 0  # times the engine was started again after it died (EngineProcess only)

    def __init__(
        self, engine: Engine, kv_idle_release_s: float | None = DEFAULT_KV_IDLE_RELEASE_S
    ) -> None:
        self.engine = engine
        self._idle = IdleRelease(engine, kv_idle_release_s)  # the CPU's KV memory, when idle
        self._commands: queue.Queue = queue.Queue()
        self._init_event_loop_side(engine.get_stats())
        self._started = threading.Event()  # lets a thread from `build` begin its loop
        # The requests in the engine, by id; touched only on the engine thread.
        self._live: dict[str, Request] = {}

    # ---- lifecycle --------------------------------------------------------------------

    @classmethod
    def build(cls, make_engine: Callable[[], Engine], **options: Any) -> AsyncEngine:
        """Runs `make_engine()` on a new engine thread, which then steps the Engine once
        `start()` is called; raises what `make_engine` raises. `options` go to __init__.

        Why a thread of its own from the start: on the CPU, torch's OpenMP pool of worker
        threads belongs to the thread that runs the parallel ops. An Engine built on the main
        thread and stepped on another leaves two pools on the same cores; libgomp then stops
        its idle workers from spinning, and every op waits for one to wake up.
        """
        built: concurrent.futures.Future = concurrent.futures.Future()  # -> the Engine
        owner: concurrent.futures.Future = concurrent.futures.Future()  # -> the AsyncEngine

        def build_then_run() -> None:
            try:
                built.set_result(make_engine())
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                built.set_exception(e)
                return
            async_engine = owner.result()
            async_engine._started.wait()
            async_engine._run()

        thread = threading.Thread(target=build_then_run, name="octavo-engine", daemon=True)
        thread.start()
        async_engine = cls(built.result(), **options)
        async_engine._thread = thread
        owner.set_result(async_engine)
        return async_engine

    def start(self) -> None:
        """Starts the engine loop; must be called from the event loop that will use it."""
        if self._loop is not None:
            raise RuntimeError("the engine loop is already started")
        self._loop = asyncio.get_running_loop()
        self._closed = False
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="octavo-engine", daemon=True)
            self._thread.start()
        self._started.set()

    async def shutdown(self) -> None:
        """Stops the engine thread after its current step; unfinished requests are aborted."""
        if self._thread is None:
            return
        self._commands.put(STOP)
        self._started.set()  # a thread from `build` that was never started: it stops at once
        await asyncio.to_thread(self._thread.join)
        self._thread = self._loop = None
        self._started.clear()

    @property
    def is_running(self) -> bool:
        return (
            not self._closed
            and self._loop is not None
            and self._thread is not None
            and self._thread.is_alive()
        )

    tokenizer = property(lambda self: self.engine.tokenizer)
    max_model_len = property(lambda self: self.engine.scheduler_config.max_model_len)
    vocab_size = property(lambda self: self.engine.vocab_size)  # token ids: [0, vocab_size)

    # `Engine.get_stats()` as of the last step (a snapshot: reading it is thread-safe).
    stats = property(lambda self: self._stats)

    # ---- requests ---------------------------------------------------------------------

    def _init_event_loop_side(self, stats: dict[str, int | float | str]) -> None:
        """The event loop's side: a stream per generate call, and the id its request has in
        the engine, `n#request_id` for the n-th call. So a late output of an aborted request
        never reaches a later request that uses its id again. (The counter goes first: the
        engine names an n > 1 request's sequences `id#i`, which must not be another id.)"""
        self._streams: dict[str, asyncio.Queue] = {}  # touched only on the event loop
        self._engine_ids: dict[str, str] = {}  # request id -> its id in the engine
        self._calls = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None  # runs the loop, or reads its pipe
        self._stats = stats
        self._closed = False  # set on the event loop once the engine loop has ended
        self.error: BaseException | None = None  # why the loop died, if it did

    def _stream_for(self, engine_id: str) -> tuple[str, asyncio.Queue] | None:
        """(request id, stream) of the generate call that added `engine_id`; None if that
        call has ended."""
        request_id = engine_id.partition("#")[2]
        stream = self._streams.get(request_id)
        if stream is None or self._engine_ids.get(request_id) != engine_id:
            return None
        return request_id, stream

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Adds a request and yields its outputs until it finishes.

        Each output is what `params.output_kind` asks for. When the consumer falls behind,
        the outputs waiting are folded into one: DELTA outputs are joined
        (RequestOutput.add), and of cumulative ones only the latest is kept. Leaving the loop
        early (or being cancelled) aborts the request.

        Raises:
            ValueError: the engine rejected the prompt or parameters.
            EngineStepError: a step failed while this request was in it.
            EngineDeadError: the engine loop is not running.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running: {describe(self.error)}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        engine_id = self._engine_ids[request_id] = f"{self._calls}#{request_id}"
        self._calls += 1
        self._commands.put(AddCommand(engine_id, prompt, params))
        deltas = params.output_kind is RequestOutputKind.DELTA
        finished = False
        try:
            while not finished:
                item = await stream.get()
                while not stream.empty() and not isinstance(item, BaseException):
                    later = stream.get_nowait()
                    join = deltas and not isinstance(later, BaseException)
                    item = item.add(later) if join else later
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._forget(request_id)
            if not finished:  # aborting an id the engine no longer has is a no-op
                self._commands.put(AbortCommand([engine_id]))

    def _forget(self, request_id: str) -> None:
        """On the event loop: the request's consumer is gone."""
        self._streams.pop(request_id, None)
        self._engine_ids.pop(request_id, None)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Asks the engine to abort the requests of running generate calls (one id or
        several, as `Engine.abort_request`); other ids are ignored. Each such call then
        yields a last output, finished with reason "abort". Call it on the event loop."""
        ids = request_id_list(request_ids)
        engine_ids = [self._engine_ids[r] for r in ids if r in self._engine_ids]
        if engine_ids:
            self._commands.put(AbortCommand(engine_ids))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between two steps and returns its result:
        the one safe way to touch the Engine while the loop runs."""
        return await asyncio.wrap_future(self._submit_call(fn))

    def call_sync(self, fn: Callable[[Engine], Any], timeout: float | None = None) -> Any:
        """`call` for a thread outside the event loop (a test, say); blocks until done."""
        return self._submit_call(fn).result(timeout)

    def _submit_call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running: {describe(self.error)}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(CallCommand(fn, future))
        return future

    # ---- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            with frozen_gc_heap(collect_first=True):  # for the loop's whole life
                while self._drain_commands(block=not self.engine.has_unfinished_requests()):
                    if self.engine.has_unfinished_requests():
                        self._step()
                    else:
                        self._stats = self.engine.get_stats()
        except BaseException as e:  # a bug in the loop itself: fail every waiter
            logger.exception("the engine loop died")
            self.error = e
            died = loop_died(e)
            self._post(self._close, EngineDeadError(died))
        else:
            self._abort_all()
            self._stats = self.engine.get_stats()
            self._post(self._close, EngineDeadError("the server is shutting down"))
        self._cancel_pending_calls()

    def _drain_commands(self, block: bool) -> bool:
        """Applies all queued commands (waiting for one if `block`); False on stop."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=self._idle.timeout())
            except queue.Empty:
                if not block:
                    return True
                self._idle.release()  # idle for that long: then wait for as long as it takes
                continue
            block = False
            if command is STOP:
                return False
            self._apply(command)

    def _apply(self, command: AddCommand | AbortCommand | CallCommand) -> None:
        if not isinstance(command, CallCommand):
            reject = functools.partial(self._post, self._deliver_error)
            fail = functools.partial(self._post, self._fail)
            aborted = apply_command(self.engine, self._live, command, reject, fail)
            if aborted:
                self._post(self._dispatch, aborted)
        elif command.future.set_running_or_notify_cancel():
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller, which raises it
                command.future.set_exception(e)

    def _step(self) -> None:
        failed: list[tuple[list[str], EngineStepError]] = []
        outputs = step_engine(self.engine, self._live, lambda *failure: failed.append(failure))
        self._idle.stepped = True
        # The snapshot goes first: whoever holds a step's outputs or failures sees that step's
        # stats (a finished request's blocks already free), as with the engine process.
        self._stats = self.engine.get_stats()
        for request_ids, error in failed:
            self._post(self._fail, request_ids, error)
        if outputs:
            self._post(self._dispatch, outputs)

    def _abort_all(self) -> None:
        ids, self._live = list(self._live), {}
        if ids:
            self.engine.abort_request(ids)

    def _cancel_pending_calls(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, CallCommand):
                command.future.cancel()

    def _post(self, fn: Callable, *args: Any) -> None:
        if self._loop is None:  # never started: nobody is waiting
            return
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is waiting
            self._loop.call_soon_threadsafe(fn, *args)

    # ---- event-loop callbacks ---------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._stream_for(out.request_id)
            if target is not None:
                out.request_id, stream = target  # the caller's id, not the engine's
                stream.put_nowait(out)

    def _deliver_error(self, engine_id: str, error: BaseException) -> None:
        target = self._stream_for(engine_id)
        if target is not None:
            target[1].put_nowait(error)

    def _fail(self, engine_ids: list[str], error: BaseException) -> None:
        for engine_id in engine_ids:
            self._deliver_error(engine_id, error)

    def _close(self, error: BaseException) -> None:
        """No request is taken from now on (the thread may not have exited yet, but nothing
        reads its commands any more), and every waiting one fails."""
        self._closed = True
        for stream in self._streams.values():
            stream.put_nowait(error)
