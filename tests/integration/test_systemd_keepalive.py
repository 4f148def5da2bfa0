"""The systemd keep-alive (WatchdogSec=) as cgpud runs under it: a real cgpud process pings
a real notify socket only while its sweep loop turns. The loop is made to
hang for real: the test holds the write lock of cgpud's SQLite database from
another connection while a reservation expires, so the sweep blocks in the
store, deleting it, for its busy timeout."""

from __future__ import annotations

import sqlite3
import subprocess
import time

from tests.harness.daemon import BIN, make_daemon


def _pings(d, seconds: float) -> list[float]:
    """Times of WATCHDOG=1 datagrams seen within `seconds`."""
    seen: list[float] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        d.notify.settimeout(left)
        try:
            data = d.notify.recv(4096)
        except TimeoutError:
            break
        if b"WATCHDOG=1" in data.split(b"\n"):
            seen.append(time.monotonic())
    return seen


def test_pings_stop_while_the_sweep_hangs_and_resume_after(tmp_path, sim_env):
    d = make_daemon(tmp_path, sim_env)  # --sweep-interval 0.2
    d.env["WATCHDOG_USEC"] = "1000000"  # a ping every 0.5 s, each vouching for a beat at most 0.5 s old
    d.start()
    try:
        assert len(_pings(d, 1.6)) >= 2
        db = sqlite3.connect(d.state / "cgpud.db", isolation_level=None, timeout=30)
        # A scheduler's reservation that runs out while the lock is held: the
        # sweep's delete of it is a write, and it blocks. (A sweep with
        # nothing to expire writes nothing, and reads go on beside the lock.)
        share = '[{"gpu_index": 0, "memory": 1073741824, "core_percent": 0, "instances": 1}]'
        db.execute(
            "INSERT INTO reservations (pod_uid, namespace, name, shares, expires) VALUES (?, ?, ?, ?, ?)",
            ("keepalive-test", "default", "held", share, time.time() + 0.6),
        )
        db.execute("BEGIN EXCLUSIVE")
        try:
            _pings(d, 1.2)  # a ping may still be due from the last beat before the lock
            assert _pings(d, 3.0) == []
            assert d.proc is not None and d.proc.poll() is None  # hung, not dead: systemd's to restart
        finally:
            db.execute("ROLLBACK")
            db.close()
        assert _pings(d, 3.0), "pings did not resume once the sweep could run again"
        assert "keep-alive ping withheld" in d.log.read_text()
    finally:
        d.stop()


def test_a_keepalive_period_shorter_than_four_sweeps_is_refused(tmp_path, sim_env):
    d = make_daemon(tmp_path, sim_env)
    d.env["WATCHDOG_USEC"] = "500000"  # pings every 0.25 s; sweeps every 0.2 s
    out = subprocess.run([str(BIN / "cgpud"), *d.args], env=d.env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "at least 4 sweep intervals" in out.stderr
    assert not d.socket.exists()  # refused before serving anything
