"""cgpud.daemon.notify against real AF_UNIX datagram sockets, as systemd
listens: a filesystem one and an abstract one."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.daemon.notify import Heartbeat, Notifier, heartbeat_max_age, start_keepalive
from cgpud.errors import UsageError


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket standing in for systemd's notify socket, and the
    NOTIFY_SOCKET value that names it."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        s.settimeout(2.0)
        yield s, str(path)


def _recv(s: socket.socket) -> str:
    return s.recv(4096).decode()


def test_ready_stopping_and_status_reach_a_path_socket(listener) -> None:
    s, name = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": name})
    assert n.enabled
    assert n.ready()
    assert _recv(s) == "READY=1"
    assert n.status("serving 3 instances\non 2 GPUs")
    assert _recv(s) == "STATUS=serving 3 instances on 2 GPUs"  # one line: a newline would start a new key
    assert n.stopping()
    assert _recv(s) == "STOPPING=1"


def test_leading_at_means_the_abstract_namespace() -> None:
    name = f"cgpu-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(2.0)
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.ready()
        assert _recv(s) == "READY=1"
    # And no file named "@..." was involved.
    assert not Path("@" + name).exists()


def test_without_notify_socket_everything_is_a_no_op() -> None:
    n = Notifier.from_env({"WATCHDOG_USEC": "200000"})
    assert not n.enabled
    assert not n.ready() and not n.stopping() and not n.keepalive() and not n.status("x")
    assert start_keepalive(n, threading.Event()) is None


def test_a_send_failure_is_reported_not_raised(tmp_path: Path) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert n.ready() is False


def test_no_keepalive_unless_asked(listener) -> None:
    _, name = listener
    assert Notifier.from_env({"NOTIFY_SOCKET": name}).keepalive_interval is None
    assert start_keepalive(Notifier.from_env({"NOTIFY_SOCKET": name}), threading.Event()) is None
    assert Notifier.from_env({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "0"}).keepalive_interval is None
    assert Notifier.from_env({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "junk"}).keepalive_interval is None


def test_keepalive_meant_for_another_pid_is_ignored(listener) -> None:
    _, name = listener
    env = {"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "200000"}
    assert Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid() + 1)}).keepalive_interval is None
    assert Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid())}).keepalive_interval == pytest.approx(0.1)


def _pings(s: socket.socket, seconds: float) -> list[float]:
    """Arrival times of WATCHDOG=1 datagrams during `seconds`."""
    times: list[float] = []
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            msg = _recv(s)
        except TimeoutError:
            break
        assert msg == "WATCHDOG=1"
        times.append(time.monotonic())
    return times


def test_keepalive_pings_every_half_period_until_stopped(listener) -> None:
    s, name = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "200000"})
    stop = threading.Event()
    thread = start_keepalive(n, stop)
    assert thread is not None and thread.daemon
    try:
        times = _pings(s, 1.05)
    finally:
        stop.set()
        thread.join(timeout=2)
    assert not thread.is_alive()
    # 100 ms apart: about ten in a second (loose bounds: 2 shared vCPUs).
    assert 7 <= len(times) <= 11, times
    gaps = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
    assert all(0.06 <= g <= 0.2 for g in gaps), gaps
    assert 0.08 <= sum(gaps) / len(gaps) <= 0.13, gaps
    # Stopped means silent.
    assert _pings(s, 0.3) == []


def test_keepalive_withholds_pings_while_unhealthy(listener) -> None:
    s, name = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "100000"})
    healthy = threading.Event()
    stop = threading.Event()
    thread = start_keepalive(n, stop, healthy=healthy.is_set)
    assert thread is not None
    try:
        assert _pings(s, 0.3) == []
        healthy.set()
        assert len(_pings(s, 0.3)) >= 3
    finally:
        stop.set()
        thread.join(timeout=2)


def test_heartbeat_is_fresh_only_within_its_bound() -> None:
    now = [100.0]
    beat = Heartbeat(clock=lambda: now[0])
    assert beat.fresh(1.0)
    now[0] = 101.5
    assert beat.age() == 1.5 and not beat.fresh(1.0)
    beat.beat()
    assert beat.fresh(1.0) and beat.age() == 0.0


def test_heartbeat_bound_is_the_ping_interval_and_short_periods_are_refused() -> None:
    watched = Notifier.from_env({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "30000000"})
    assert heartbeat_max_age(watched, 2.0) == 15.0  # the unit's WatchdogSec=30s, the default sweep
    assert heartbeat_max_age(Notifier.from_env({"WATCHDOG_USEC": "30000000"}), 2.0) is None  # no socket
    assert heartbeat_max_age(Notifier.from_env({"NOTIFY_SOCKET": "/x"}), 2.0) is None  # no keep-alive
    assert heartbeat_max_age(watched, 7.5) == 15.0  # exactly four sweeps fit
    with pytest.raises(UsageError, match="at least 4 sweep intervals"):
        heartbeat_max_age(watched, 7.6)
