"""Freezing cgpud (SIGSTOP, every thread) at a chosen moment, so that what
follows (a SIGKILL) finds the state that moment left."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from cgpud._region import lib
from tests.harness.wait import until

OPEN = int(lib.CGPU_GATE_OPEN)


def _all_stopped(pid: int) -> bool:
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] in "tT" for t in tasks)


def freeze_with_gate_closed(pid: int, gate: Callable[[], int], timeout: float = 60) -> None:
    """Stops cgpud (SIGSTOP, every thread) at a moment its tenant's gate is
    closed: stopped, it cannot open it before the SIGKILL that follows."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, "never caught the gate closed"
        os.kill(pid, signal.SIGSTOP)
        until(
            lambda: _all_stopped(pid),
            timeout=max(deadline - time.monotonic(), 0.0),
            interval=0.001,
            what=f"every thread of {pid} stopped",
        )
        if not gate() & OPEN:
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.005)
