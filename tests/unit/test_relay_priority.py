"""The thread answering the relay socket runs at RELAY_NICE, the daemon's
other threads at its own priority (a real RelayServer; the nice values read
back from /proc, as the scheduler sees them)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from cgpud.containers.relay import RELAY_NICE, RelayServer
from tests.harness.lifecycle import lifecycle
from tests.harness.wait import until


def nice_of(tid: int) -> int:
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])  # field 19, counted after the comm


def relay_tid() -> int | None:
    for t in threading.enumerate():
        if t.name == "cgpud-relay" and t.native_id is not None:
            return t.native_id
    return None


def test_the_relay_thread_answers_at_a_higher_priority_than_the_rest(tmp_path: Path) -> None:
    assert os.geteuid() == 0, "raising a thread's priority needs CAP_SYS_NICE"
    lc, _ = lifecycle(tmp_path)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    server = RelayServer(lc, tmp_path / "relay.sock").start()
    try:
        tid = until(relay_tid, timeout=5.0)
        until(lambda: nice_of(tid) == RELAY_NICE, timeout=5.0)
        assert nice_of(threading.get_native_id()) == before != RELAY_NICE
        after = next(t for t in threading.enumerate() if t.name == "cgpud-relay-after")
        assert after.native_id is not None and nice_of(after.native_id) == before
    finally:
        server.stop()
