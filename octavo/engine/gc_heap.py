"""Keeps Python's garbage collector off the startup heap while an engine loop runs.

A full collection walks every tracked object. After torch, transformers and a model are
loaded that is ~500k objects, and one such pause took 0.26-0.28 s in the middle of a GPU run,
with the device idle behind it (docs/PERFORMANCE.md). vLLM freezes its startup heap the same
way.
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
    either order); an inner block changes nothing. Unfreezing also gives back what a library
    froze before (the GPU machine's imports freeze a few hundred objects): they are alive,
    so a later full collection only walks them again.
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
