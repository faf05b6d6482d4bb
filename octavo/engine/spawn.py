"""Starting the engine process without importing the engine: `octavo serve` starts it first,
so that the engine process imports and builds while the server imports its own modules (on
a CPU with a few cores, the two overlap instead of running one after the other)."""

from __future__ import annotations

import multiprocessing
from typing import Any


def start_engine_process(options: dict) -> tuple[Any, Any]:
    """Spawns the process that builds `build_engine(**options)` and serves it over a pipe
    (engine_process.py): (process, the server's end of the pipe). Does not wait for it."""
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    process = context.Process(
        target=_main, args=(child_conn, options), name="octavo-engine", daemon=True
    )
    process.start()
    child_conn.close()
    return process, conn


def _main(conn, options: dict) -> None:
    from octavo.engine.engine_process import engine_process_main

    engine_process_main(conn, options)
