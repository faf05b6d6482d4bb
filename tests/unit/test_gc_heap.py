"""frozen_gc_heap: the garbage collector skips what was alive before the block (so a full
collection in the middle of a run does not walk the whole startup heap), still collects what
the block makes, and gives everything back afterwards, even after an error."""

from __future__ import annotations

import gc
import weakref

import pytest

from octavo.engine.gc_heap import frozen_gc_heap


class Node:
    pass


def garbage_cycle() -> weakref.ref:
    """An unreachable reference cycle, which only the cyclic collector can free."""
    node = Node()
    node.self = node
    return weakref.ref(node)


@pytest.fixture
def no_automatic_gc():
    """No automatic collection may free a cycle before the test looks at it."""
    was_enabled = gc.isenabled()
    gc.disable()
    yield
    if was_enabled:
        gc.enable()


def test_the_old_heap_is_hidden_inside_and_collected_after(no_automatic_gc):
    old = garbage_cycle()
    with frozen_gc_heap():
        new = garbage_cycle()
        gc.collect()
        assert new() is None, "a cycle made inside the block must be collected"
        assert old() is not None, "a cycle made before the block must be left alone"
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old() is None


def test_it_freezes_after_a_library_froze_part_of_the_heap(no_automatic_gc):
    """The GPU machine's imports call gc.freeze() on a few hundred objects: the block must
    still hide everything made since."""
    gc.freeze()
    old = garbage_cycle()
    with frozen_gc_heap():
        gc.collect()
        assert old() is not None
    gc.collect()
    assert old() is None


def test_nested_blocks_keep_the_heap_frozen_until_the_outermost_ends(no_automatic_gc):
    old = garbage_cycle()
    with frozen_gc_heap():
        with frozen_gc_heap():
            pass
        gc.collect()
        assert old() is not None, "the inner block's end must not unfreeze the outer's heap"
    gc.collect()
    assert old() is None


def test_an_error_inside_the_block_unfreezes_the_heap():
    with pytest.raises(RuntimeError), frozen_gc_heap():
        raise RuntimeError("step failed")
    assert gc.get_freeze_count() == 0


def test_collect_first_frees_the_garbage_alive_at_the_start(no_automatic_gc):
    """The server's loop lasts the process's life: garbage alive when it starts must not be
    frozen with the rest."""
    old = garbage_cycle()
    with frozen_gc_heap(collect_first=True):
        assert old() is None
