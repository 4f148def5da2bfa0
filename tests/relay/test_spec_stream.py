"""The shim's GPU `create` with the spec streamed to runc (cgpu_runtime.c,
create_streamed): runc starts at once, a FIFO waits at config.json, cgpud
reads the engine's spec through the descriptor sent with the prepare and
renames its edit over the FIFO. Played with a cgpud that edits as cgpud
does (a real unix socket, the descriptor received as cgpud receives it)
and a fake runc that reads config.json as runc does (one JSON value from
whatever its open finds) or to the end of the file. Release and
sanitizer builds, as test_relays.py."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from tests.harness.relay import INSTANCE, Cgpud, bundle, closed_after, create_args, run
from tests.harness.wait import WaitTimeout, until

ORIGINAL = json.dumps(
    {
        "ociVersion": "1.0.2",
        "process": {"args": ["sh"], "env": ["PATH=/bin", "ALIYUN_COM_GPU_MEM_CONTAINER=2"]},
        "mounts": [{"destination": "/data", "source": "/srv/data"}],
    },
    indent=1,
)
EDITED_ENV = "CGPU_EDITED=1"


class EditingCgpud(Cgpud):
    """cgpud's side: each request's head, whether a descriptor came, and
    the spec read through it. A prepare is played per the next step:
    "edit" (the edit renamed over config.json, then ok), "refuse", "plain"
    (ok, the bundle asks for no GPU: untouched), "vanish" (closes without a
    word), "edit-vanish"; after `delay` seconds. With `started`, the first
    prepare then waits (up to 10 s) until it says so: a played runc killed
    by the answer must have got as far as recording its call, however
    loaded the machine."""

    def __init__(
        self, path: Path, steps: list[str], delay: float = 0.0, started: Callable[[], object] | None = None
    ) -> None:
        self.steps, self.delay, self.started = steps, delay, started
        self.heads: list[str] = []
        self.specs: list[bytes | None] = []
        super().__init__(path, None)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                data, fds = b"", []
                while True:
                    chunk, passed, _, _ = socket.recv_fds(conn, 1 << 16, 4)
                    fds += passed
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.decode().partition("\n")
                self.heads.append(head)
                spec = None
                for fd in fds:
                    spec = os.pread(fd, 1 << 20, 0)
                    os.close(fd)
                self.specs.append(spec)
                if not head.startswith("prepare"):
                    conn.sendall(f"ok {head.split()[0]} {INSTANCE}\n".encode())
                    continue
                step = self.steps.pop(0)
                time.sleep(self.delay)
                if self.started is not None and len(self.heads) == 1:
                    with contextlib.suppress(WaitTimeout):  # the test's own assertion then says what is missing
                        until(self.started, what="the runtime's first call")
                if step.startswith("edit"):
                    config = Path(body) / "config.json"
                    edited = json.loads(spec if spec is not None else config.read_bytes())
                    edited["process"]["env"].append(EDITED_ENV)
                    tmp = config.with_name(".edit")
                    tmp.write_text(json.dumps(edited))
                    tmp.chmod(stat.S_IMODE(os.lstat(config).st_mode))
                    os.rename(tmp, config)
                answer = {
                    "edit": f"ok instance {INSTANCE}\n",
                    "refuse": "error no GPU has 17 GiB free\n",
                    "plain": "ok no GPU request\n",
                }.get(step)
                if answer:
                    conn.sendall(answer.encode())


class StreamRunc:
    """A fake runc (named runc, so the shim streams to it). `create` opens
    config.json after $FAKE_OPEN_DELAY seconds, reads one JSON value as
    runc's decoder does (or to the end of the file with FAKE_READ=eof),
    records it, writes the pid file and <root>/<id>."""

    def __init__(self, path: Path) -> None:
        self.path, self.log, self.read = path, path.with_suffix(".log"), path.with_suffix(".read")
        self.inherited_path = path.with_suffix(".inherited")
        path.write_text(f"""#!{sys.executable}
import json, os, sys, time
args = sys.argv[1:]
with open({str(self.log)!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
def value(name):
    return args[args.index(name) + 1] if name in args else None
def fd_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
if "create" in args:
    inherited = {{
        "fds": [fd for fd in range(3, 64) if fd_open(fd)],
        "env": sorted(k for k in os.environ if k.startswith("CGPU_RUNTIME_")),
    }}
    with open({str(self.inherited_path)!r}, "w") as f:
        json.dump(inherited, f)
    time.sleep(float(os.environ.get("FAKE_OPEN_DELAY", "0")))
    fd = os.open(os.path.join(value("--bundle"), "config.json"), os.O_RDONLY)
    data, spec = b"", None
    while spec is None:
        more = os.read(fd, 4096)
        data += more
        try:
            spec = json.loads(data)
        except ValueError:
            if not more:
                sys.exit("config.json: unexpected end of JSON input")
    if os.environ.get("FAKE_READ") == "eof":
        while os.read(fd, 4096):
            pass
    with open({str(self.read)!r}, "w") as f:
        json.dump(spec, f)
    os.makedirs(os.path.join(value("--root"), args[-1]))
    with open(value("--pid-file"), "w") as f:
        f.write("4242")
if "delete" in args:
    os.rmdir(os.path.join(value("--root"), args[-1]))
""")
        path.chmod(0o755)

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def inherited(self) -> dict | None:
        """What `create` found open beyond stdio, and the CGPU_RUNTIME_* variables it got."""
        return json.loads(self.inherited_path.read_text()) if self.inherited_path.exists() else None

    def spec(self) -> dict | None:
        return json.loads(self.read.read_text()) if self.read.exists() else None


@pytest.fixture
def runtime(tmp_path: Path) -> StreamRunc:
    """Stands in for conftest.py's fake runtime, so its `env` points the
    relays at this runc."""
    (tmp_path / "rt").mkdir()
    return StreamRunc(tmp_path / "rt" / "runc")


@pytest.fixture
def cgpud(sock_path: Path) -> Iterator[Callable[..., EditingCgpud]]:
    with closed_after(partial(EditingCgpud, sock_path)) as start:
        yield start


def engine_bundle(tmp_path: Path) -> Path:
    b = bundle(tmp_path, config=ORIGINAL)
    (b / "config.json").chmod(0o640)
    return b


def untouched(b: Path) -> None:
    """The bundle as the engine left it: its config.json, byte for byte and mode, nothing of ours beside it."""
    st = os.lstat(b / "config.json")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
    assert (b / "config.json").read_text() == ORIGINAL
    assert os.listdir(b) == ["config.json"]


# cgpud slow (runc opens the FIFO and waits), or runc slow (it opens the edited file).
@pytest.mark.parametrize("slow", ["cgpud", "runc"])
@pytest.mark.parametrize("read", ["decoder", "eof"])
def test_runc_reads_cgpuds_edit_wherever_its_open_lands(bins, cgpud, runtime, env, tmp_path, slow, read) -> None:
    server = cgpud(["edit"], delay=0.3 if slow == "cgpud" else 0.0)
    b = engine_bundle(tmp_path)
    proc = run(
        bins / "cgpu-runtime",
        create_args(tmp_path, b),
        dict(env, FAKE_READ=read, FAKE_OPEN_DELAY="0.3" if slow == "runc" else "0"),
    )
    assert proc.returncode == 0, proc.stderr
    assert server.heads == ["prepare c1 shim-binds spec-fd", f"bind {INSTANCE}"]
    assert server.specs[0] == ORIGINAL.encode()  # cgpud read the engine's spec through the descriptor
    assert EDITED_ENV in runtime.spec()["process"]["env"]
    st = os.lstat(b / "config.json")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
    assert EDITED_ENV in json.loads((b / "config.json").read_text())["process"]["env"]
    assert os.listdir(b) == ["config.json"]


def test_a_refusal_kills_the_waiting_runtime_and_puts_the_spec_back(bins, cgpud, runtime, env, tmp_path) -> None:
    server = cgpud(["refuse"], delay=0.3, started=runtime.calls)
    b = engine_bundle(tmp_path)
    log = tmp_path / "runc.log"
    proc = run(bins / "cgpu-runtime", ["--log", str(log), *create_args(tmp_path, b)], env)
    assert proc.returncode == 1 and "cgpu-runtime: no GPU has 17 GiB free" in proc.stderr
    assert "no GPU has 17 GiB free" in log.read_text().splitlines()[-1]  # where containerd looks
    assert server.heads == ["prepare c1 shim-binds spec-fd"]
    assert len(runtime.calls()) == 1 and runtime.spec() is None  # started, killed before it had a spec
    assert not (tmp_path / "root").exists()
    untouched(b)


def test_a_bundle_asking_for_no_gpu_gets_the_engines_spec(bins, cgpud, runtime, env, tmp_path) -> None:
    server = cgpud(["plain"], delay=0.3)
    b = engine_bundle(tmp_path)
    proc = run(bins / "cgpu-runtime", create_args(tmp_path, b), env)
    assert proc.returncode == 0, proc.stderr
    assert server.heads == ["prepare c1 shim-binds spec-fd"]  # nothing to bind
    assert runtime.spec() == json.loads(ORIGINAL)
    untouched(b)


def test_cgpud_not_running_leaves_the_bundle_as_it_was(bins, runtime, env, tmp_path) -> None:
    b = engine_bundle(tmp_path)
    proc = run(bins / "cgpu-runtime", create_args(tmp_path, b), env)
    assert proc.returncode == 1 and "cgpud is not running" in proc.stderr
    assert runtime.calls() == []
    untouched(b)


def test_cgpud_gone_before_any_edit_is_asked_again_the_usual_way(bins, cgpud, runtime, env, tmp_path) -> None:
    """A restart mid-request: the streamed start is undone (runc killed,
    the spec put back) and the prepare sent again, by path, as any relay
    request is after cgpud went away."""
    server = cgpud(["vanish", "edit"], delay=0.3, started=runtime.calls)
    b = engine_bundle(tmp_path)
    proc = run(bins / "cgpu-runtime", create_args(tmp_path, b), env)
    assert proc.returncode == 0, proc.stderr
    assert server.heads == ["prepare c1 shim-binds spec-fd", "prepare c1 shim-binds", f"bind {INSTANCE}"]
    assert len(runtime.calls()) == 2 and EDITED_ENV in runtime.spec()["process"]["env"]
    assert os.listdir(b) == ["config.json"]


def test_cgpud_gone_after_its_edit_starts_nothing(bins, cgpud, runtime, env, tmp_path) -> None:
    """cgpud edited the bundle and went away without its ok: runc may have
    read the edit, so it is let finish and its container deleted."""
    server = cgpud(["edit-vanish"], delay=0.3)
    b = engine_bundle(tmp_path)
    proc = run(bins / "cgpu-runtime", create_args(tmp_path, b), env)
    assert proc.returncode == 1 and "cgpud went away without answering" in proc.stderr
    assert server.heads == ["prepare c1 shim-binds spec-fd"]
    assert runtime.calls()[-1] == f"--root {tmp_path / 'root'} delete --force c1"
    assert not (tmp_path / "root" / "c1").exists()
    assert os.listdir(b) == ["config.json"]


def test_a_runtime_not_named_runc_gets_the_finished_file(bins, cgpud, runtime, env, tmp_path) -> None:
    crun = runtime.path.with_name("crun")
    crun.write_text(runtime.path.read_text())
    crun.chmod(0o755)
    server = cgpud(["edit"])
    b = engine_bundle(tmp_path)
    proc = run(bins / "cgpu-runtime", create_args(tmp_path, b), dict(env, CGPU_REAL_RUNTIME=str(crun)))
    assert proc.returncode == 0, proc.stderr
    assert server.heads == ["prepare c1 shim-binds", f"bind {INSTANCE}"]
    assert server.specs[0] is None
    assert EDITED_ENV in runtime.spec()["process"]["env"]


def test_runc_inherits_nothing_of_the_hand_over(bins, cgpud, runtime, env, tmp_path) -> None:
    """The front starts runc itself and hands the start on to the shim
    proper in CGPU_RUNTIME_STREAM, with four descriptors: runc gets neither
    the variable nor any of them, and variables inherited from the engine
    are dropped, not taken for a hand-over."""
    server = cgpud(["edit"], delay=0.2)
    b = engine_bundle(tmp_path)
    inherited = dict(env, CGPU_RUNTIME_STREAM="3,4,5,6,1", CGPU_RUNTIME_SENT_FD="3")
    proc = run(bins / "cgpu-runtime", create_args(tmp_path, b), inherited)
    assert proc.returncode == 0, proc.stderr
    assert server.heads == ["prepare c1 shim-binds spec-fd", f"bind {INSTANCE}"]
    assert runtime.inherited() == {"fds": [], "env": []}
    assert EDITED_ENV in runtime.spec()["process"]["env"]
    assert os.listdir(b) == ["config.json"]


@pytest.mark.parametrize("handed", ["3,4,5,6,1", "-1,-1,-1,-1,-1", "x", "3,4,5,6", "0,1,2,3,4"])
def test_a_hand_over_that_does_not_hold_together_starts_nothing(bins, runtime, env, tmp_path, handed) -> None:
    """cgpu-runtime-gpu run with a CGPU_RUNTIME_STREAM that is not the
    front's: one message, the bundle untouched, no runtime."""
    b = engine_bundle(tmp_path)
    proc = run(bins / "cgpu-runtime-gpu", create_args(tmp_path, b), dict(env, CGPU_RUNTIME_STREAM=handed))
    assert proc.returncode == 1
    assert "the start cgpu-runtime began cannot be carried on" in proc.stderr
    assert runtime.calls() == []
    untouched(b)


FRONT_WITHOUT_SEND = """
import os, sys
shim, runc, bundle, *args = sys.argv[1:]
d = os.open(bundle, os.O_PATH | os.O_DIRECTORY)
original = os.open("config.json", os.O_RDONLY, dir_fd=d)
tmp = ".config.json.cgpu-%d" % os.getpid()
os.mkfifo(tmp, 0o600, dir_fd=d)
fifo = os.open(tmp, os.O_RDWR | os.O_NONBLOCK, dir_fd=d)
os.chmod(fifo, 0o640)
os.rename(tmp, "config.json", src_dir_fd=d, dst_dir_fd=d)
child = os.fork()
if child == 0:
    os.execv(runc, [runc, *args])
for fd in (d, original, fifo):
    os.set_inheritable(fd, True)
os.execve(shim, [shim, *args], dict(os.environ, CGPU_RUNTIME_STREAM=f"-1,{d},{original},{fifo},{child}"))
"""


def test_a_prepare_the_front_could_not_send_is_undone_and_asked_again(bins, cgpud, runtime, env, tmp_path) -> None:
    """The front put the FIFO in place and started runc, but the request did
    not go out (connection -1 in the hand-over, played here by a script in
    the front's place): the shim proper kills runc, puts the engine's spec
    back, and asks the usual way."""
    server = cgpud(["edit"])
    b = engine_bundle(tmp_path)
    front = tmp_path / "front.py"
    front.write_text(FRONT_WITHOUT_SEND)
    args = [str(front), str(bins / "cgpu-runtime-gpu"), str(runtime.path), str(b), *create_args(tmp_path, b)]
    proc = run(Path(sys.executable), args, dict(env, FAKE_OPEN_DELAY="0"))
    assert proc.returncode == 0, proc.stderr
    assert server.heads == ["prepare c1 shim-binds", f"bind {INSTANCE}"]
    # The first runc is killed, often before it got as far as its log.
    assert 1 <= len(runtime.calls()) <= 2 and EDITED_ENV in runtime.spec()["process"]["env"]
    assert os.listdir(b) == ["config.json"]
