"""The relays while cgpud is down: a GPU container's start waits for cgpud
(CGPU_RELAY_WAIT_S, relay_wire.h) saying so once, proceeds when it comes
back, and fails with a clear message when it does not. A container that asks
for no GPU never waits. Real relay binaries (release and sanitizer builds),
a real socket that appears late."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from cgpud.contract import RELAY_WAIT_S
from tests.harness.relay import PLAIN_CONFIG, STATE, Cgpud, bundle, read_request
from tests.harness.sanitizers import SAN_OPTIONS

START_HINT = "start it (systemctl start cgpud)"


def spawn(prog: Path, args: list[str], env: dict[str, str], stdin: bytes = b"") -> subprocess.Popen[bytes]:
    read, write = os.pipe()
    os.write(write, stdin)  # small: fits the pipe, so the child may read it any time
    os.close(write)
    try:
        return subprocess.Popen([str(prog), *args], env=env, stdin=read, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        os.close(read)


def finish(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    _, err = proc.communicate(timeout=RELAY_WAIT_S + 10)
    text = err.decode(errors="replace")
    assert "Sanitizer" not in text and "runtime error" not in text, text
    return proc.returncode, text


def test_runtime_waits_for_cgpud_to_come_back(bins, env, runtime, cgpud, sock_path, tmp_path):
    env = {**env, "CGPU_RELAY_WAIT_MS": "5000"}
    proc = spawn(bins / "cgpu-runtime", ["create", "--bundle", str(bundle(tmp_path)), "c1"], env)
    time.sleep(0.6)
    assert proc.poll() is None, "the relay gave up while cgpud was starting"
    server = cgpud()
    code, err = finish(proc)
    assert code == 0, err
    assert err == f"cgpu-runtime: cgpud is not running ({sock_path}: No such file or directory); retrying for 5 s\n"
    assert runtime.argv is not None and len(server.requests) == 1


def test_refused_socket_left_by_a_dead_cgpud_is_waited_on(bins, env, runtime, cgpud, sock_path, tmp_path):
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock_path))
    dead.close()
    env = {**env, "CGPU_RELAY_WAIT_MS": "5000"}
    proc = spawn(bins / "cgpu-runtime", ["create", "--bundle", str(bundle(tmp_path)), "c1"], env)
    time.sleep(0.4)
    sock_path.unlink()  # what a new cgpud does with a stale socket
    server = cgpud()
    code, err = finish(proc)
    assert code == 0 and "Connection refused); retrying for 5 s" in err and err.count("\n") == 1, err
    assert len(server.requests) == 1


def test_runtime_gives_up_within_the_bound(bins, env, runtime, sock_path, tmp_path):
    log = tmp_path / "log"
    env = {**env, "CGPU_RELAY_WAIT_MS": "1200"}
    started = time.monotonic()
    proc = spawn(bins / "cgpu-runtime", ["--log", str(log), "create", "--bundle", str(bundle(tmp_path)), "c1"], env)
    code, err = finish(proc)
    took = time.monotonic() - started
    why = f"cgpud is not running ({sock_path}: No such file or directory)"
    final = f"cgpu-runtime: {why}; it did not come back within 1.2 s: {START_HINT}"
    assert code == 1 and runtime.argv is None
    assert err == f"cgpu-runtime: {why}; retrying for 1.2 s\n{final}\n"
    assert 1.2 <= took < 4.0, took
    assert log.read_text().endswith(f'level=error msg="{final}"\n')  # what containerd shows


def test_hook_waits_the_full_default_bound_then_fails(native, sock_path):
    """The real constant, once (release build): runc's hook timeout in the
    entries cgpud writes is longer, so the hook's own message is what runc reports."""
    from cgpud.containers.edits import HOOK_TIMEOUT

    assert HOOK_TIMEOUT > RELAY_WAIT_S + 5
    started = time.monotonic()
    proc = spawn(
        native / "bin" / "cgpu-hook", ["--socket", str(sock_path), "--instance", "i1", "poststop"], {}, stdin=STATE
    )
    code, err = finish(proc)
    took = time.monotonic() - started
    assert code == 1 and RELAY_WAIT_S <= took < RELAY_WAIT_S + 3, took
    assert err.splitlines() == [
        f"cgpu-hook: cgpud is not running ({sock_path}: No such file or directory); retrying for {RELAY_WAIT_S} s",
        f"cgpu-hook: cgpud is not running ({sock_path}: No such file or directory); it did not come back "
        f"within {RELAY_WAIT_S} s: {START_HINT}",
    ]


def test_hook_waits_for_cgpud_to_come_back(bins, cgpud, sock_path):
    env = {**SAN_OPTIONS, "CGPU_RELAY_WAIT_MS": "5000"}
    proc = spawn(
        bins / "cgpu-hook", ["--socket", str(sock_path), "--instance", "i1", "createRuntime"], env, stdin=STATE
    )
    time.sleep(0.5)
    server = cgpud(b"ok bound i1\n")
    code, err = finish(proc)
    assert code == 0 and "retrying for 5 s" in err, err
    assert server.requests == [b"hook createRuntime i1\n" + STATE]


class DiesOnce(Cgpud):
    """A cgpud that reads the first request and dies without answering
    (kill -9 mid-request), then comes back and answers."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, None)

    def _serve(self) -> None:
        for answer in (None, b"ok instance cgpu-1\n"):
            conn, _ = self._sock.accept()
            with conn:
                self.requests.append(read_request(conn))
                if answer is not None:
                    conn.sendall(answer)


def test_request_lost_with_a_dying_cgpud_is_sent_again(bins, env, runtime, sock_path, tmp_path):
    server = DiesOnce(sock_path)
    try:
        env = {**env, "CGPU_RELAY_WAIT_MS": "5000"}
        proc = spawn(bins / "cgpu-runtime", ["create", "--bundle", str(bundle(tmp_path)), "c1"], env)
        code, err = finish(proc)
    finally:
        server.close()
    assert code == 0, err
    assert err == (
        f"cgpu-runtime: cgpud went away without answering ({sock_path}: connection closed); retrying for 5 s\n"
    )
    assert len(server.requests) == 2 and server.requests[0] == server.requests[1]
    assert server.requests[0].startswith(b"prepare c1\n")


def test_container_without_gpu_never_waits(bins, runtime, sock_path, tmp_path):
    # The default bound (no CGPU_RELAY_WAIT_MS) and no cgpud: still no wait.
    b = bundle(tmp_path, config=PLAIN_CONFIG)
    env = {
        "PATH": "/usr/bin:/bin",
        "CGPU_REAL_RUNTIME": str(runtime.path),
        "CGPU_RELAY_SOCKET": str(sock_path),
        **SAN_OPTIONS,
    }
    started = time.monotonic()
    code, err = finish(spawn(bins / "cgpu-runtime", ["create", "--bundle", str(b), "c1"], env))
    assert code == 0 and err == "" and runtime.argv is not None
    assert time.monotonic() - started < 1.0
