"""What every engine loop does with the engine (AsyncEngine's thread, the engine process):
apply a command (add or abort requests) and run a step, keeping the live requests in step
and turning failures into per-request errors; the loops' commands and errors."""

from __future__ import annotations

import concurrent.futures
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from octavo.core.request import Request
from octavo.engine.engine import Engine
from octavo.outputs import RequestOutput
from octavo.runner.multiproc import WorkerDied
from octavo.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop is not running (never started, stopped, or crashed)."""


class EngineStepError(RuntimeError):
    """A step of the engine failed; the requests in that step were aborted."""


def describe(error: BaseException) -> str:
    """An error as a client reads it: its message, never its class (the log has both)."""
    if isinstance(error, WorkerDied):
        return f"the engine process died: {error}"
    return str(error) or "an internal error (see the server's log)"


def loop_died(error: BaseException) -> str:
    """Why the engine loop ended, for the requests it fails (503s)."""
    died = isinstance(error, WorkerDied)  # describe names it already
    return describe(error) if died else f"the engine loop died: {describe(error)}"


@dataclass
class AddCommand:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams


@dataclass
class AbortCommand:
    request_ids: list[str]


@dataclass
class CallCommand:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future


STOP = object()


class IdleRelease:
    """When an engine loop has stepped and then waited `after_s` seconds with nothing to do,
    it gives the KV cache's free memory back (Engine.release_kv_memory), once per idle
    spell. `after_s` 0 or None: never."""

    def __init__(self, engine: Engine, after_s: float | None) -> None:
        if after_s is not None and not after_s >= 0:
            raise ValueError(f"kv_idle_release_s must be >= 0 seconds, got {after_s}")
        self.engine, self.after_s = engine, after_s or None
        self.stepped = False  # a step ran since the last release

    def timeout(self) -> float | None:
        """How long an idle loop waits for a command before it calls `release` (None: for
        as long as it takes)."""
        return self.after_s if self.stepped else None

    def release(self) -> None:
        """Best effort: a failure is logged and the loop goes on, but a dead worker is raised
        (the engine cannot go on without it)."""
        self.stepped = False
        try:
            released = self.engine.release_kv_memory()
        except WorkerDied:
            raise
        except Exception:  # the memory stays where it is; no request is affected
            logger.exception("giving the free KV blocks' memory back failed")
            return
        if released:
            logger.info("idle for %g s: the free KV blocks' memory (%.0f MiB, resident or not)"
                        " went back to the system", self.after_s, released / 2**20)  # fmt: skip


def apply_command(
    engine: Engine,
    live: dict[str, Request],
    command: AddCommand | AbortCommand,
    reject: Callable[[str, ValueError], None],
    fail: Callable[[list[str], EngineStepError], None],
) -> list[RequestOutput]:
    """Adds or aborts requests in `engine`, keeping `live` (id -> request) in step. A
    prompt or parameters the engine refuses go to `reject(request_id, error)`; any other
    failure to add a request goes to `fail([request_id], error)`, and the loop goes on.
    Returns the final outputs (finish reason "abort") of the requests an abort ended."""
    if isinstance(command, AddCommand):
        try:
            request = engine.add_request(command.prompt, command.params, command.request_id)
        except ValueError as e:
            reject(command.request_id, e)
        except Exception as e:  # noqa: BLE001 - a bug, not the caller's input
            logger.error("adding a request failed:\n%s", traceback.format_exc())
            error = EngineStepError(f"the engine could not add it: {describe(e)}")
            fail([command.request_id], error)
        else:
            live[command.request_id] = request
        return []
    outputs = engine.abort_request(command.request_ids)
    for request_id in command.request_ids:
        live.pop(request_id, None)
    return outputs


def step_engine(
    engine: Engine,
    live: dict[str, Request],
    fail: Callable[[list[str], EngineStepError], None],
) -> list[RequestOutput]:
    """One step of `engine`; finished requests leave `live`. If the step fails, the engine
    has aborted the requests in it: those go to `fail(request_ids, error)`. If it aborted
    none, all are aborted, since the engine's state is unknown. Returns the step's outputs
    ([] after a failure). A dead tensor-parallel worker fails every request, and is raised
    again: the engine cannot go on."""
    try:
        outputs = engine.step()
    except Exception as e:
        logger.error("engine step failed:\n%s", traceback.format_exc())
        if isinstance(e, WorkerDied):  # the engine cannot go on: its requests fail as it dies
            engine.abort_request(list(live))
            live.clear()
            raise
        dropped = [rid for rid, request in live.items() if request.is_finished]
        if not dropped and live:
            dropped = list(live)
            engine.abort_request(dropped)
        for request_id in dropped:
            del live[request_id]
        fail(dropped, EngineStepError(f"the engine failed on this request: {describe(e)}"))
        return []
    for out in outputs:
        if out.finished:
            live.pop(out.request_id, None)
    return outputs
