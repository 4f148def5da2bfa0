"""The systemd notify protocol (sd_notify(3)) without libsystemd: one
datagram of newline-separated KEY=VALUE assignments to $NOTIFY_SOCKET.

Used by cgpud under `Type=notify`: READY=1 once the API socket listens (so
units ordered after cgpud, and cgpuctl, find it answering), STOPPING=1 on
shutdown, STATUS= for `systemctl status`, and WATCHDOG=1 every half of
$WATCHDOG_USEC when the unit sets WatchdogSec=. Outside systemd (no
NOTIFY_SOCKET) every call does nothing, so the daemon needs no special case.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import structlog

from cgpud.errors import UsageError


@dataclass(frozen=True)
class Notifier:
    # The socket address as socket.sendto wants it: a filesystem path, or a
    # str starting with NUL for the abstract namespace. None: not under systemd.
    address: str | None = None
    # The keep-alive period systemd asks for (WatchdogSec=) in microseconds; None: none.
    keepalive_usec: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        # sd_notify: a leading '@' stands for the abstract namespace (NUL).
        address = ("\0" + raw[1:] if raw.startswith("@") else raw) or None
        return cls(address=address, keepalive_usec=_keepalive_usec(env))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def keepalive_interval(self) -> float | None:
        """Seconds between pings: half the period, as systemd recommends, so
        one late ping is not yet a missed deadline."""
        return None if self.keepalive_usec is None else self.keepalive_usec / 2_000_000

    def ready(self) -> bool:
        return self.notify("READY=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        # One assignment per line: a newline in the text would start a new one.
        return self.notify("STATUS=" + " ".join(text.splitlines()))

    def keepalive(self) -> bool:
        return self.notify("WATCHDOG=1")

    def notify(self, *assignments: str) -> bool:
        """Send one datagram; True if sent. A failure is logged, not raised:
        the daemon's work does not depend on systemd hearing it (if READY=1 is
        lost, systemd's start timeout reports it)."""
        if self.address is None:
            return False
        payload = "\n".join(assignments).encode()
        try:
            # A socket per message: nothing shared between the main thread and
            # the keep-alive thread, and nothing to reopen if systemd restarts.
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(payload, self.address)
        except OSError as e:
            structlog.get_logger("cgpud.notify").warning(
                "systemd notification failed", message=payload.decode(), socket=self.address, error=str(e)
            )
            return False
        return True


def _keepalive_usec(env: Mapping[str, str]) -> int | None:
    """$WATCHDOG_USEC as sd_watchdog_enabled(3) reads it: ignored when
    $WATCHDOG_PID names another process (the variables were inherited from a
    parent that systemd watches, not meant for us)."""
    raw = env.get("WATCHDOG_USEC", "")
    try:
        usec = int(raw)
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    return usec


@dataclass
class Heartbeat:
    """When a loop last completed a round. The loop beats; the keep-alive
    thread asks whether the last beat is recent, so a ping means the loop
    still turns, not merely that the keep-alive thread does. A float
    assignment is atomic under the GIL: no lock."""

    clock: Callable[[], float] = time.monotonic
    last: float = field(init=False)

    def __post_init__(self) -> None:
        self.last = self.clock()

    def beat(self) -> None:
        self.last = self.clock()

    def age(self) -> float:
        return self.clock() - self.last

    def fresh(self, max_age: float) -> bool:
        return self.age() <= max_age


def heartbeat_max_age(notifier: Notifier, loop_interval: float) -> float | None:
    """How old the loop's last beat may be when a ping is due: one ping
    interval (half the WatchdogSec= period), so a loop stuck for longer than
    that misses systemd's deadline within one more interval. None without a
    keep-alive. A period that leaves room for fewer than two rounds of the
    loop would restart a healthy daemon: refused."""
    interval = notifier.keepalive_interval
    if not notifier.enabled or interval is None:
        return None
    if interval < 2 * loop_interval:
        raise UsageError(
            f"systemd's WatchdogSec= period ({interval * 2:g} s) must be at least 4 sweep intervals "
            f"({4 * loop_interval:g} s with sweep_interval = {loop_interval:g}): raise WatchdogSec= or lower "
            "sweep_interval"
        )
    return interval


def start_keepalive(
    notifier: Notifier, stop_event: threading.Event, *, healthy: Callable[[], bool] | None = None
) -> threading.Thread | None:
    """Ping WATCHDOG=1 every `keepalive_interval` seconds from a daemon thread
    until `stop_event` is set; None (no thread) when systemd asked for no
    keep-alive. `healthy`, when given, is asked before each ping and a False
    answer skips it, so a wedged daemon is restarted by systemd instead of
    being vouched for by a thread that merely still runs."""
    interval = notifier.keepalive_interval
    if not notifier.enabled or interval is None:
        return None

    def run() -> None:
        log = structlog.get_logger("cgpud.notify")
        while not stop_event.wait(interval):
            try:
                ok = healthy is None or healthy()
            except Exception:
                log.exception("keep-alive health check crashed")
                ok = False
            if ok:
                notifier.keepalive()
            else:
                log.warning("unhealthy: keep-alive ping withheld")

    thread = threading.Thread(target=run, name="cgpud-keepalive", daemon=True)
    thread.start()
    return thread
