"""cgpud as a real process for tests: its own state dir, sockets and
notify socket under a test's temp dir, on the simulated GPUs."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgpud.native import native_path

BIN = Path(sys.executable).parent


@dataclass
class Daemon:
    socket: Path
    state: Path
    env: dict[str, str]
    notify: socket.socket
    args: list[str]
    proc: subprocess.Popen[str] | None = None
    # What cgpud runs under (tests/harness/old_kernel.py's launcher), if anything.
    wrapper: tuple[str, ...] = ()

    @property
    def log(self) -> Path:
        return self.state.parent / "cgpud.log"

    @property
    def relay(self) -> Path:
        return self.socket.parent / "relay.sock"

    def start(self) -> None:
        # A file, not a pipe: nobody reads a pipe while the test runs, and a
        # daemon whose log fills it blocks mid-request.
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [*self.wrapper, str(BIN / "cgpud"), *self.args],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                text=True,
            )
        self.wait_for(b"READY=1")

    def wait_for(self, message: bytes, timeout: float = 30) -> list[bytes]:
        seen: list[bytes] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.notify.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.notify.recv(4096)
            except TimeoutError:
                break
            seen.append(data)
            if message in data.split(b"\n"):
                return seen
        err = self.log.read_text()[-4000:] if self.log.exists() else ""
        raise AssertionError(f"no {message!r} from cgpud (got {seen}); its log ends: {err}")

    def kill(self) -> None:
        assert self.proc
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.wait_for(b"STOPPING=1")
            assert self.proc.wait(timeout=30) == 0

    def cgpuctl_argv(self, *args: str) -> list[str]:
        """cgpuctl's command line against this daemon's socket."""
        return [str(BIN / "cgpuctl"), "--socket", str(self.socket), *args]

    def cgpuctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.cgpuctl_argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout)

    def start_cgpuctl(
        self, *args: str, stdout: int | None = None, stderr: int | None = None, text: bool = False
    ) -> subprocess.Popen[Any]:
        """cgpuctl in the background (a `cgpuctl run` tenant that runs while
        the test acts on it), in the daemon's environment; the caller waits."""
        return subprocess.Popen(self.cgpuctl_argv(*args), env=self.env, stdout=stdout, stderr=stderr, text=text)


def make_daemon(tmp_path: Path, sim_env: dict[str, str], *extra: str, wrapper: Sequence[str] = ()) -> Daemon:
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = tmp_path / "notify.sock"
    notify.bind(str(notify_path))
    env = dict(sim_env, NOTIFY_SOCKET=str(notify_path), CGPU_SIM_CONFIG=sim_env["CGPU_SIM_CONFIG"])
    env["PATH"] = f"{BIN}:{native_path('bin/cgpu-burn').parent}:{env['PATH']}"
    args = [
        "--state-dir",
        str(tmp_path / "state"),
        "--socket",
        str(tmp_path / "run" / "cgpud.sock"),
        "--config",
        str(tmp_path / "none.toml"),
        "--relay-socket",
        str(tmp_path / "run" / "relay.sock"),
        "--sweep-interval",
        "0.2",
        *extra,
    ]
    (tmp_path / "none.toml").write_text("")
    return Daemon(tmp_path / "run" / "cgpud.sock", tmp_path / "state", env, notify, args, wrapper=tuple(wrapper))


@contextmanager
def running_daemon(
    tmp_path: Path, sim_env: dict[str, str], *extra: str, wrapper: Sequence[str] = ()
) -> Iterator[Daemon]:
    """A started cgpud (under `wrapper`, if given), stopped cleanly when the
    block ends however it ends."""
    d = make_daemon(tmp_path, sim_env, *extra, wrapper=wrapper)
    d.start()
    try:
        yield d
    finally:
        d.stop()
