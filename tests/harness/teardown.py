"""Taking down what a test started, however the start or the test ended:
processes (SIGTERM so each cleans up as on a real host, SIGKILL for one
that does not stop), and setups of many parts that must undo a start
failing part way."""

from __future__ import annotations

import signal
import subprocess
import time
from abc import ABC, abstractmethod
from typing import Any, Self

# A SIGKILLed process still has to be reaped; only one stuck in the kernel takes long.
KILL_WAIT_S = 30


def terminate(*procs: subprocess.Popen[Any], timeout: float = 20, kill: bool = True) -> None:
    """SIGTERM to each of `procs` still running, all at once, then wait for
    them within `timeout` altogether: they stop side by side. One still
    running then is killed, or with `kill=False` is the caller's failure
    (subprocess.TimeoutExpired)."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in running:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if not kill:
                raise
            p.kill()
            p.wait(timeout=KILL_WAIT_S)


class StartOrClose(ABC):
    """A context manager over `_start` and `close`: a start that fails part
    way closes what it had made before the error goes on, so `close` must
    take down any part of the setup."""

    @abstractmethod
    def _start(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def start(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
