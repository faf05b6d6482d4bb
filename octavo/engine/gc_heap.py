"""Keeps Python's garbage collector off the startup heap while an engine is built and while
its loop runs.

A full collection walks every tracked object, and after torch, transformers and a model are
loaded there are hundreds of thousands: the device idles behind the pause (see
docs/PERFORMANCE.md). vLLM freezes its startup heap the same way.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_blocks_open = 0  # frozen_gc_heap blocks open in this process; the outermost freezes


@contextlib.contextmanager
def frozen_gc_heap(collect_first: bool = False) -> Iterator[None]:
    """Hides every object alive at the outermost block's start from the garbage collector
    (gc.freeze) until that block ends; objects made meanwhile are collected as usual.

    collect_first: collect garbage before freezing, so no cycle alive then is kept for the
        whole block. Costs a full collection: for blocks that last, like the server's loop.

    NOTE: blocks nest on purpose (the server's loop and LLM.generate may share a process, in
    either order); an inner block changes nothing. Unfreezing also unfreezes what a library
    froze earlier, which costs only a later collection's walk over those live objects.
    """
    global _blocks_open
    with _lock:
        _blocks_open += 1
        if _blocks_open == 1:
            if collect_first:
                gc.collect()
            gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _blocks_open -= 1
            if _blocks_open == 0:
                gc.unfreeze()
