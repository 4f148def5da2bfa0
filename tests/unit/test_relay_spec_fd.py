"""cgpud's side of a spec streamed to the runtime: `prepare ... spec-fd`
reads the bundle's config.json from the descriptor sent with the request
(its path holds the shim's FIFO by then) and writes the edited spec to the
path. Any other use of a descriptor is refused and changes nothing. Real
relay socket, instance service and SQLite file."""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.containers.relay import RelayServer
from cgpud.node.service import InstanceService
from tests.harness.lifecycle import bundle, lifecycle, state

GPU = "ALIYUN_COM_GPU_MEM_CONTAINER=2"


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[Path, InstanceService]]:
    lc, svc = lifecycle(tmp_path)
    path = tmp_path / "relay.sock"
    server = RelayServer(lc, path).start()
    yield path, svc
    server.stop()


def ask(path: Path, request: bytes, fds: list[int]) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        try:
            if fds:
                socket.send_fds(s, [request[:1]], fds)  # as the shim: the descriptors ride on the first byte
                request = request[1:]
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
        except BrokenPipeError:
            pass  # refused at the first byte: the answer is there to read, as the shim reads it
        return b"".join(iter(lambda: s.recv(65536), b"")).decode()


def fifo_in_place(b: Path) -> int:
    """The shim's move: the engine's config.json opened, a FIFO renamed over its path."""
    original = os.open(b / "config.json", os.O_RDONLY | os.O_CLOEXEC)
    os.mkfifo(b / ".fifo", 0o640)
    os.rename(b / ".fifo", b / "config.json")
    return original


def open_files() -> set[str]:
    """What this process's descriptors name: a path, or pipe:[inode]."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.add(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the listing's own descriptor, or one closed since
            pass
    return names


def test_the_spec_is_read_from_the_descriptor_and_the_edit_written_to_the_path(relay, tmp_path: Path) -> None:
    path, svc = relay
    b = bundle(tmp_path / "b", GPU)
    os.chmod(b / "config.json", 0o640)
    original = fifo_in_place(b)
    try:
        answer = ask(path, f"prepare job shim-binds spec-fd\n{b}".encode(), [original])
    finally:
        os.close(original)
    assert answer.startswith("ok instance "), answer
    iid = answer.split()[-1]
    st = os.lstat(b / "config.json")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640  # the FIFO's mode, as the shim gives it
    spec = json.loads((b / "config.json").read_text())
    assert GPU in spec["process"]["env"] and "hooks" not in spec  # the shim binds itself
    assert any(m["destination"] == "/run/cgpu" for m in spec["mounts"])
    assert svc.get(iid).active


@pytest.mark.parametrize(
    "case",
    [
        "flag without descriptor",
        "descriptor without flag",
        "descriptor with a bind",
        "two descriptors",
        "a pipe",
        "opened for writing only",
    ],
)
def test_a_descriptor_that_does_not_fit_the_request_is_refused_and_changes_nothing(
    relay, tmp_path: Path, case: str
) -> None:
    path, svc = relay
    b = bundle(tmp_path / "b", GPU)
    before = (b / "config.json").read_bytes()
    head, fds, expected = {
        "flag without descriptor": ("prepare job shim-binds spec-fd", [], "came without the spec's file descriptor"),
        "descriptor without flag": ("prepare job shim-binds", ["spec"], "a file descriptor came with a request"),
        "descriptor with a bind": ("bind cgpu-000000000001", ["spec"], "a file descriptor came with a request"),
        "two descriptors": ("prepare job shim-binds spec-fd", ["spec", "spec"], "more than one file descriptor"),
        "a pipe": ("prepare job shim-binds spec-fd", ["pipe"], f"{b}/config.json is not a regular file"),
        "opened for writing only": ("prepare job shim-binds spec-fd", ["write"], f"cannot read {b}/config.json"),
    }[case]
    body = state("job", b, 4242) if head.startswith("bind") else str(b).encode()
    sent, also = [], []
    for kind in fds:
        if kind == "pipe":
            r, w = os.pipe()
            os.write(w, before)
            sent.append(r)
            also.append(w)
        else:
            sent.append(os.open(b / "config.json", os.O_WRONLY if kind == "write" else os.O_RDONLY))
    given = {os.readlink(f"/proc/self/fd/{fd}") for fd in sent}
    try:
        answer = ask(path, head.encode() + b"\n" + body, sent)
    finally:
        for fd in sent + also:
            os.close(fd)
    assert answer.startswith("error ") and expected in answer, answer
    assert (b / "config.json").read_bytes() == before
    assert svc.list() == []
    assert not given & open_files()  # cgpud (in this process) closed what it was given


def test_a_spec_fd_for_a_bundle_that_is_not_there_is_refused(relay, tmp_path: Path) -> None:
    """The spec came open, so the bundle path was not walked to read it:
    cgpud still refuses a bundle that is not a directory, before admitting."""
    path, svc = relay
    b = bundle(tmp_path / "b", GPU)
    spec = os.open(b / "config.json", os.O_RDONLY | os.O_CLOEXEC)
    try:
        answer = ask(path, f"prepare job shim-binds spec-fd\n{tmp_path / 'gone'}".encode(), [spec])
    finally:
        os.close(spec)
    assert answer == f"error bundle {tmp_path / 'gone'} is not a directory\n"
    assert svc.list() == []


def test_a_bundle_path_that_is_not_utf8_is_refused(relay, tmp_path: Path) -> None:
    """It would become the instance's owner: refused with a message, not
    "cgpud failed on this request" from the SQLite write (found by the
    py_relay_server fuzzer)."""
    path, svc = relay
    b = tmp_path / b"b\xff".decode(errors="surrogateescape")
    bundle(b, GPU)
    spec = os.open(b / "config.json", os.O_RDONLY | os.O_CLOEXEC)
    try:
        with_fd = ask(path, b"prepare job shim-binds spec-fd\n" + os.fsencode(b), [spec])
    finally:
        os.close(spec)
    by_path = ask(path, b"prepare job shim-binds\n" + os.fsencode(b), [])
    for answer in (with_fd, by_path):
        assert answer.startswith("error container job: bundle path") and "is not valid UTF-8" in answer, answer
    assert svc.list() == []
