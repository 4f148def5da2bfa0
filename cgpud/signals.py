"""Stop on SIGTERM/SIGINT without taking a lock in a signal handler.

The obvious `signal.signal(SIGTERM, lambda *_: stop.set())` can hang a
daemon for good: Python runs the handler in the main thread between two
bytecodes, and Event.set takes the lock the main thread's own Event.wait
holds for a few bytecodes on its way in and out. A SIGTERM landing there
waits on a lock its own thread holds (cgpud ignored a SIGTERM sent 10 ms
after READY that way, in CI). Here the handler does nothing; the
interpreter's C-level handler writes the signal's number to a pipe
(signal.set_wakeup_fd) and the main thread reads it like any other input.

Ownership: one StopSignals per process, made and used by the main thread
only (set_wakeup_fd and signal.signal demand it); `stop` may be read and
set by any thread."""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _noted(signum: int, frame: FrameType | None) -> None:
    """The wakeup pipe already holds the signal's number: nothing to do here."""


class StopSignals:
    """Installed at once, so a signal that comes during start-up is kept
    for the first wait(); `stop` is set when one arrives (and may be set by
    other threads to stop the daemon too)."""

    def __init__(self, stop: threading.Event, signums: Iterable[signal.Signals] = STOP_SIGNALS) -> None:
        self.stop = stop
        self._signums = {int(s) for s in signums}
        self._read, self._write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._previous: dict[int, Any] = {s: signal.signal(s, _noted) for s in self._signums}
        self.received: int | None = None  # the signal that stopped us

    def wait(self, timeout: float | None = None) -> bool:
        """Until a stop signal arrives or `stop` is set (True), or `timeout`
        seconds pass (False). Other threads setting `stop` are seen within
        half a second."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.stop.is_set():
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                return False
            ready, _, _ = select.select([self._read], [], [], left)
            if ready and self._drain():
                self.stop.set()
        return True

    def _drain(self) -> bool:
        try:
            data = os.read(self._read, 256)
        except BlockingIOError:
            return False
        for signum in data:
            if signum in self._signums:
                self.received = signum
                return True
        return False

    def close(self) -> None:
        """The handlers and wakeup fd that were there before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)
