"""cgpu-runtime's front (csrc/hook/runtime_front.c): every runtime command
of every container goes through it, and it execs the real runtime itself
unless the command needs the shim proper, cgpu-runtime-gpu beside it. Played
with the real binaries (the release front, built without libc, and the
sanitizer build of the same logic on libc) and a fake runc."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz.py_bundle import shim_may_ask
from tests.harness.relay import GPU_CONFIG, PLAIN_CONFIG, bundle, run
from tests.harness.wait import until

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "csrc"))
import build_native  # noqa: E402

CHUNK = 64 << 10  # runtime_rules.h CONFIG_CHUNK: a marker may straddle two reads
CONFIG_MAX = 8 << 20


def front_in(where: Path, bins: Path, gpu_shim: str | None) -> Path:
    """A copy of the front in `where`, with `gpu_shim` (a script) or nothing beside it."""
    where.mkdir(parents=True, exist_ok=True)
    front = where / "cgpu-runtime"
    shutil.copy2(bins / "cgpu-runtime", front)
    if gpu_shim is not None:
        spy = where / "cgpu-runtime-gpu"
        spy.write_text(gpu_shim)
        spy.chmod(0o755)
    return front


SPY = '#!/bin/sh\nprintf \'%s\\0\' "$@" > "$(dirname "$0")/gpu-shim.argv"\nexit 42\n'


def spied(front: Path) -> list[str] | None:
    record = front.parent / "gpu-shim.argv"
    if not record.exists():
        return None
    argv = record.read_bytes().decode().split("\0")[:-1]
    record.unlink()
    return argv


def test_commands_that_need_nothing_of_cgpu_run_without_the_gpu_shim(bins, env, runtime, tmp_path):
    front = front_in(tmp_path / "alone", bins, None)
    plain = bundle(tmp_path, "plain", PLAIN_CONFIG)
    for args in (
        ["state", "c1"],
        ["--root", str(tmp_path / "root"), "delete", "c1"],
        ["--log", str(tmp_path / "log"), "create", "--bundle", str(plain), "--pid-file", "p", "c1"],
        ["run", "-b", str(plain), "c1"],
        ["create", "--bundle", str(tmp_path / "missing"), "c1"],
        ["kill", "c1", "KILL"],
    ):
        proc = run(front, args, env)
        assert (proc.returncode, proc.stdout) == (0, "fake-runc ran\n"), proc.stderr
        assert runtime.argv == args


def test_a_gpu_start_without_the_gpu_shim_fails_closed(bins, env, runtime, tmp_path):
    front = front_in(tmp_path / "alone", bins, None)
    proc = run(front, ["create", "--bundle", str(bundle(tmp_path)), "c1"], env)
    assert proc.returncode == 127
    assert proc.stderr.startswith(
        f"cgpu-runtime: cannot run {front.parent}/cgpu-runtime-gpu: it is installed with "
        "cgpu-runtime, in the same directory; reinstall cgpu"
    )
    assert runtime.argv is None


def _config(tmp_path: Path, name: str, raw: bytes) -> Path:
    b = tmp_path / "bundles" / name
    b.mkdir(parents=True)
    (b / "config.json").write_bytes(raw)
    return b


def test_the_front_hands_on_exactly_what_may_ask_for_a_gpu(bins, env, runtime, tmp_path):
    front = front_in(tmp_path / "spied", bins, SPY)
    pad = b" " * (CHUNK - 7)
    cases = {
        "plain": PLAIN_CONFIG.encode(),
        "env": GPU_CONFIG.encode(),
        "claim": b'{"mounts":[{"destination":"/run//cgpu"}]}',
        "escaped slash": b'{"mounts":[{"destination":"\\/run"}]}',
        "escaped letter": b'{"process":{"env":["\\u0041LIYUN_COM_GPU_MEM_CONTAINER=2"]}}',
        "escaped ampersand": b'{"process":{"args":["sh","-c","a \\u0026\\u0026 b"]}}',
        "marker across reads": b'{"x":"' + pad[:-3] + b'ALIYUN_COM_GPU_MEM_CONTAINER=1"}',
        "escape across reads": b'{"x":"' + pad[:-1] + b'\\u0061"}',
        "half an escape at the end": b'{"x":"\\u00',
        "empty": b"",
    }
    for name, raw in cases.items():
        b = _config(tmp_path, name.replace(" ", "-"), raw)
        args = ["--root", "r", "create", "--bundle", str(b), "c1"]
        proc = run(front, args, env)
        handed = spied(front)
        if shim_may_ask(raw):
            assert (proc.returncode, handed, runtime.argv) == (42, args, None), name
        else:
            assert (proc.returncode, handed, runtime.argv) == (0, None, args), name
        runtime.record.unlink(missing_ok=True)
    # Too big to scan: the shim proper (and cgpud) decide. A FIFO or a link is unreadable: runc says why.
    big = _config(tmp_path, "big", b"")
    os.truncate(big / "config.json", CONFIG_MAX + 1)
    assert run(front, ["create", "--bundle", str(big), "c1"], env).returncode == 42 and spied(front)
    fifo = tmp_path / "bundles" / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")
    linked = tmp_path / "bundles" / "linked"
    linked.mkdir()
    (linked / "config.json").symlink_to(tmp_path / "bundles" / "env" / "config.json")
    for b in (fifo, linked):
        assert run(front, ["create", "--bundle", str(b), "c1"], env).returncode == 0
        assert spied(front) is None and runtime.argv == ["create", "--bundle", str(b), "c1"]
    assert run(front, ["--version"], env).returncode == 42 and spied(front) == ["--version"]


def test_a_real_runtime_that_cannot_run_is_reported_by_the_gpu_shim(bins, env, runtime, tmp_path):
    env["CGPU_REAL_RUNTIME"] = "no-such-runc"
    proc = run(bins / "cgpu-runtime", ["state", "c1"], env)
    assert proc.returncode == 127
    assert "cgpu-runtime: cannot run no-such-runc: No such file or directory" in proc.stderr


def test_through_a_link_the_gpu_shim_is_found_beside_the_real_file(bins, env, runtime, cgpud, tmp_path):
    (tmp_path / "usr-bin").mkdir()
    link = tmp_path / "usr-bin" / "cgpu-runtime"
    link.symlink_to(bins / "cgpu-runtime")  # as the packages install /usr/bin/cgpu-runtime
    server = cgpud(b"error no room here\n")
    proc = run(link, ["create", "--bundle", str(bundle(tmp_path)), "c1"], env)
    assert proc.returncode == 1 and "no room here" in proc.stderr
    assert len(server.requests) == 1 and server.requests[0].startswith(b"prepare c1\n")
    assert runtime.argv is None


# cgpu-hook too: runc runs it inside every CDI/hooks start's `create`.
@pytest.mark.parametrize("program", ["cgpu-runtime", "cgpu-hook"])
def test_the_release_front_runs_without_libc_where_it_knows_how(native, program):
    data = (native / "bin" / program).read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2  # 64-bit
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    kinds = {struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)}
    # No PT_INTERP and no PT_DYNAMIC: nothing is loaded or relocated before it runs.
    loads_nothing = 3 not in kinds and 2 not in kinds
    assert loads_nothing == (platform.machine() in build_native.FREESTANDING_MACHINES)


# --- the prepare request the front sends before the shim proper starts ----------------------------

SENT_FD = "CGPU_RUNTIME_SENT_FD"  # runtime_rules.h SENT_FD_ENV


def recorded(server) -> None:
    """Waits (10 s at most) for the server's thread to record a request: it
    does once it has read it to the end, which may come after the process
    that sent it has exited and nobody waited for an answer."""
    until(lambda: server.requests, timeout=10, interval=0.01, what="the server to record a request")


def test_the_front_sends_the_prepare_request_before_the_gpu_shim_runs(bins, env, runtime, cgpud, tmp_path):
    # No shim beside this front: whatever cgpud got, the front sent.
    front = front_in(tmp_path / "alone", bins, None)
    server = cgpud(None)
    b = bundle(tmp_path)
    link = tmp_path / "via-link"
    link.symlink_to(b)
    args = ["--root", str(tmp_path / "root"), "create", "--bundle", str(link), "--pid-file", "p", "c1"]
    proc = run(front, args, env)
    assert proc.returncode == 127 and "cannot run" in proc.stderr
    recorded(server)
    # What the shim proper would send: the bundle as realpath(3) names it, shim-binds for create --pid-file.
    assert server.requests == [b"prepare c1 shim-binds\n" + os.path.realpath(b).encode()]


SHIM_SEES = """#!/bin/sh
{{ printf '%s\\n' "${var}"; [ -S "/proc/$$/fd/${var}" ] && echo socket; }} > "$(dirname "$0")/seen"
exit 42
"""


def test_the_gpu_shim_gets_the_connection_and_never_an_inherited_one(bins, env, runtime, cgpud, tmp_path):
    front = front_in(tmp_path / "spied", bins, SHIM_SEES.format(var=SENT_FD))
    server = cgpud(None)
    proc = run(front, ["run", "--bundle", str(bundle(tmp_path)), "c1"], dict(env, **{SENT_FD: "999"}))
    assert proc.returncode == 42, proc.stderr
    fd, kind = (front.parent / "seen").read_text().split()
    assert fd != "999" and int(fd) >= 3 and kind == "socket"
    recorded(server)
    assert server.requests == [b"prepare c1\n" + str(tmp_path / "bundles" / "c1").encode()]


def test_nothing_is_sent_ahead_for_a_start_the_shim_refuses(bins, env, runtime, cgpud, tmp_path):
    front = front_in(tmp_path / "spied", bins, SHIM_SEES.format(var=SENT_FD))
    server = cgpud(None)
    b = bundle(tmp_path)
    for args in (
        ["create", "--bundle", str(b)],
        ["create", "--bundle", str(b), "bad id"],
        ["create", "--bundle", str(b), "x" * 1025],
    ):
        assert run(front, args, env).returncode == 42
        assert (front.parent / "seen").read_text() == "\n"  # no variable, so no socket either
    assert server.requests == []


def shim_with_fd(bins: Path, env: dict[str, str], b: Path, fd: int) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [str(bins / "cgpu-runtime-gpu"), "create", "--bundle", str(b), "c1"],
        env=dict(env, **{SENT_FD: str(fd)}),
        pass_fds=(fd,),
        capture_output=True,
        timeout=20,
    )


def test_the_gpu_shim_asks_itself_when_the_fd_it_is_told_of_is_no_connection_to_cgpud(
    bins, env, runtime, cgpud, tmp_path
):
    server = cgpud(b"ok\n")
    b = bundle(tmp_path)
    other = tmp_path / "other.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(other))
    listener.listen(1)
    elsewhere = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    elsewhere.connect(str(other))
    pair = socket.socketpair()
    with open(b / "config.json", "rb") as file, listener, elsewhere, pair[0], pair[1]:
        for fd in (file.fileno(), pair[0].fileno(), elsewhere.fileno()):
            proc = shim_with_fd(bins, env, b, fd)
            assert proc.returncode == 0, proc.stderr
    assert server.requests == [b"prepare c1\n" + str(b).encode()] * 3
    assert runtime.argv == ["create", "--bundle", str(b), "c1"]


def test_the_real_runtime_inherits_neither_the_connection_nor_the_variable(bins, env, cgpud, tmp_path):
    record = tmp_path / "runc-saw"
    fake = tmp_path / "runc-recording"
    fake.write_text(f"#!/bin/sh\n{{ env | grep {SENT_FD}; ls -l /proc/$$/fd | grep -c socket; }} > {record}\nexit 0\n")
    fake.chmod(0o755)
    server = cgpud(b"ok\n")
    proc = run(
        bins / "cgpu-runtime", ["run", "--bundle", str(bundle(tmp_path)), "c1"], dict(env, CGPU_REAL_RUNTIME=str(fake))
    )
    assert proc.returncode == 0, proc.stderr
    assert len(server.requests) == 1 and record.read_text() == "0\n"


def test_a_cgpud_whose_backlog_is_full_does_not_hold_the_front(bins, env, runtime, sock_path, tmp_path):
    # A wedged cgpud: listening, never accepting, its queue full. The front
    # gives up at once, and the shim proper deals with it (and says so).
    front = front_in(tmp_path / "spied", bins, SHIM_SEES.format(var=SENT_FD))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(0)
    queued = []
    while True:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(str(sock_path))
        except BlockingIOError:
            c.close()
            break
        queued.append(c)
    try:
        proc = run(front, ["create", "--bundle", str(bundle(tmp_path)), "c1"], env)  # run() allows 20 s
    finally:
        for c in [*queued, listener]:
            c.close()
    assert proc.returncode == 42 and (front.parent / "seen").read_text() == "\n"
