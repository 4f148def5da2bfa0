"""Playing the parts around the relays (cgpu-runtime, cgpu-hook): cgpud's side
of the relay wire (a real unix socket server that records each request and
answers a scripted line), a fake runc that records its argv, OCI bundles, and
one relay run judged clean of sanitizer reports. Fixtures built on these are
in tests/relay/conftest.py."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ParamSpec, Protocol, TypeVar

from tests.harness.sanitizers import SAN_OPTIONS, assert_clean

GPU_CONFIG = json.dumps(
    {"ociVersion": "1.0.2", "process": {"args": ["sh"], "env": ["PATH=/bin", "ALIYUN_COM_GPU_MEM_CONTAINER=2"]}}
)
PLAIN_CONFIG = json.dumps({"ociVersion": "1.0.2", "process": {"args": ["sh", "-c", "true"], "env": ["PATH=/bin"]}})
STATE = b'  {"ociVersion":"1.0.2","id":"c1","status":"creating","pid":4242,"bundle":"/b",' + (
    b'"annotations":{"note":"caf\xc3\xa9 \\" \\n \\u0000"}}\n'
)
INSTANCE = "cgpu-0123456789ab"


class _Closable(Protocol):
    def close(self) -> None: ...


P = ParamSpec("P")
S = TypeVar("S", bound=_Closable)


class Cgpud:
    """cgpud's side of the wire: read one request to EOF, answer, close."""

    def __init__(self, path: Path, answer: bytes | None) -> None:
        self.path, self.answer = path, answer
        self.requests: list[bytes] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(8)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # close() shut the listener down
                return
            with conn:
                self.requests.append(read_request(conn))
                if self.answer is not None:
                    conn.sendall(self.answer)

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)
        self._sock.close()


def read_request(conn: socket.socket) -> bytes:
    """One relay request: everything up to the relay's EOF (a relay that
    never closes its side fails the read in 10 s instead of hanging)."""
    conn.settimeout(10)
    data = b""
    while chunk := conn.recv(1 << 16):
        data += chunk
    return data


@contextmanager
def closed_after(start: Callable[P, S]) -> Iterator[Callable[P, S]]:
    """`start` for a test's servers (Cgpud and its kin), each one it
    started closed when the block ends."""
    servers: list[S] = []

    def started(*args: P.args, **kwargs: P.kwargs) -> S:
        servers.append(start(*args, **kwargs))
        return servers[-1]

    try:
        yield started
    finally:
        for server in servers:
            server.close()


class FakeRuntime:
    """An executable standing in for runc: records its argv, NUL-separated."""

    def __init__(self, path: Path) -> None:
        self.path, self.record = path, path.with_suffix(".argv")
        path.write_text(
            "#!/bin/sh\n"
            f'for a in "$@"; do printf "%s\\0" "$a"; done > {shlex.quote(str(self.record))}\n'
            "echo fake-runc ran\n"
        )
        path.chmod(0o755)

    @property
    def argv(self) -> list[str] | None:
        if not self.record.exists():
            return None
        return self.record.read_bytes().decode().split("\0")[:-1]


def relay_env(runtime: Path, sock_path: Path) -> dict[str, str]:
    """What the relays run with here: `runtime` as the real one, cgpud at sock_path."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CGPU_REAL_RUNTIME": str(runtime),
        "CGPU_RELAY_SOCKET": str(sock_path),
        "CGPU_RELAY_WAIT_MS": "0",  # no waiting for a cgpud that is down (test_relay_wait.py waits)
        **SAN_OPTIONS,
    }


def bundle(root: Path, name: str = "c1", config: str | None = GPU_CONFIG) -> Path:
    path = root / "bundles" / name
    path.mkdir(parents=True)
    if config is not None:
        (path / "config.json").write_text(config)
    return path


def run(
    prog: Path, args: list[str], env: dict[str, str], cwd: Path | str | None = None, stdin: bytes = b""
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(prog), *args], env=env, cwd=cwd, input=stdin, capture_output=True, timeout=20)
    out = subprocess.CompletedProcess(
        proc.args, proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    )
    assert_clean(out.stderr)
    return out


def create_args(tmp_path: Path, b: Path) -> list[str]:
    return ["--root", str(tmp_path / "root"), "create", "--bundle", str(b), "--pid-file", str(tmp_path / "pid"), "c1"]
