"""The CPU priority of tests that measure time: in ./dev test's parallel
pass they share the two cores with other tests' builds and daemons. Their
processes, and those the real cluster starts, run at TIMING_NICE: the
scheduler then gives them the CPU when they wake, as a quiet machine would,
and the other tests take what is left."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

TIMING_NICE = -10


@contextmanager
def raised(nice: int = TIMING_NICE) -> Iterator[None]:
    """The calling thread, and every process and thread it starts meanwhile,
    at `nice` (Linux keeps a niceness per thread; children inherit it)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)
