"""QuietHeap's spacing of full collections (next_collect_wait), and the
collector left as it was when the heap is released."""

from __future__ import annotations

import gc

from cgpud.extender.server import LITTLE_GARBAGE, QuietHeap, next_collect_wait
from cgpud.extender.state import ClusterState


def test_a_collection_that_finds_nothing_doubles_the_wait() -> None:
    assert next_collect_wait(60.0, 0, 60.0, 960.0) == 120.0
    assert next_collect_wait(120.0, LITTLE_GARBAGE, 60.0, 960.0) == 240.0


def test_the_wait_stops_at_the_longest() -> None:
    wait = 60.0
    for _ in range(10):
        wait = next_collect_wait(wait, 0, 60.0, 960.0)
    assert wait == 960.0


def test_a_collection_that_finds_garbage_brings_the_wait_back() -> None:
    assert next_collect_wait(960.0, LITTLE_GARBAGE + 1, 60.0, 960.0) == 60.0


def test_the_wait_is_never_below_the_base() -> None:
    assert next_collect_wait(1.0, 0, 60.0, 960.0) == 120.0


def test_the_heap_is_frozen_on_writes_and_thawed_at_stop() -> None:
    state = ClusterState()
    heap = QuietHeap(state, collect_every=3600.0).start()
    try:
        assert state.on_write is gc.freeze
        assert gc.get_freeze_count() > 0
    finally:
        heap.stop()
    assert state.on_write is None
    assert gc.get_freeze_count() == 0
