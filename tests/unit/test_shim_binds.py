"""cgpud's side of the shim binding itself: a `prepare ... shim-binds`
writes no hook entries (and drops those of an earlier prepare of the same
bundle), and the shim's `bind`/`release` requests do what the createRuntime
and poststop hooks do, with the same checks. Real instance service."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from cgpud.errors import StateError, UsageError
from cgpud.containers.relay import RelayProtocolError, RelayServer, handle
from cgpud.node.model import InstanceState
from tests.harness.lifecycle import bundle, lifecycle, state
from tests.harness.wait import until

GPU = "ALIYUN_COM_GPU_MEM_CONTAINER=2"


@pytest.fixture
def init() -> Iterator[int]:
    """A stand-in for a created container's init, as the shim's bind finds
    it: in a mount namespace of its own (here without /proc, which cgpud
    takes for a table it cannot check: the unit tests have no rootfs)."""
    proc = subprocess.Popen(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "umount -l /proc && echo ready && exec sleep 300",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    yield proc.pid
    proc.kill()
    proc.wait()


def hooks_of(b: Path) -> dict:
    return json.loads((b / "config.json").read_text()).get("hooks", {})


def test_shim_binds_prepare_writes_no_hooks_and_drops_earlier_ones(tmp_path: Path) -> None:
    lc, _ = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", GPU)
    assert handle(lc, ["prepare", "job"], str(b).encode()).startswith("instance ")
    assert set(hooks_of(b)) == {"createRuntime"}
    # A retried create of the same bundle, now by a shim that binds itself.
    assert handle(lc, ["prepare", "job", "shim-binds"], str(b).encode()).startswith("instance ")
    assert hooks_of(b) == {}


def test_shim_binds_keeps_hooks_that_are_not_cgpus(tmp_path: Path) -> None:
    lc, _ = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", GPU)
    spec = json.loads((b / "config.json").read_text())
    theirs = {"path": "/usr/bin/other-hook", "args": ["other-hook"]}
    spec["hooks"] = {"poststop": [theirs]}
    (b / "config.json").write_text(json.dumps(spec))
    handle(lc, ["prepare", "job", "shim-binds"], str(b).encode())
    assert hooks_of(b) == {"poststop": [theirs]}


def test_bind_and_release_requests_do_the_hooks_work(tmp_path: Path, init: int) -> None:
    lc, svc = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", GPU)
    iid = handle(lc, ["prepare", "job", "shim-binds"], str(b).encode()).split()[-1]
    assert handle(lc, ["bind", iid], state("job", b, init)) == f"bound {iid}"
    assert svc.get(iid).pids == (init,)
    with pytest.raises(UsageError, match="no init pid"):
        handle(lc, ["bind", iid], state("job", b))
    # Another container's bind or release changes nothing.
    other = bundle(tmp_path / "other", GPU)
    with pytest.raises(StateError, match="belongs to container"):
        handle(lc, ["bind", iid], state("job", other, init))
    assert "not" in handle(lc, ["release", iid], state("job", other))
    assert svc.get(iid).state.value == "bound"
    assert handle(lc, ["release", iid], state("job", b)) == f"released {iid}"
    assert svc.get(iid).state.value == "released"


def test_the_shims_bind_checks_the_inits_own_mount_table_and_never_reads_the_spec(tmp_path: Path, init: int) -> None:
    lc, _ = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", GPU)
    iid = handle(lc, ["prepare", "job", "shim-binds"], str(b).encode()).split()[-1]
    (b / "config.json").write_text("not json")  # runc read the spec before; the bind needs no rootfs path
    assert handle(lc, ["bind", iid], state("job", b, init)) == f"bound {iid}"
    # A createRuntime hook's bind (before pivot_root) takes the rootfs from the spec, and says what is wrong with it.
    c = bundle(tmp_path / "c", GPU)
    cid = handle(lc, ["prepare", "job", "shim-binds"], str(c).encode()).split()[-1]
    (c / "config.json").write_text("not json")
    with pytest.raises(UsageError, match="is not valid JSON"):
        lc.hook("createRuntime", cid, state("job", c, init))


def test_the_shims_bind_refuses_an_init_whose_table_lacks_cgpus_mounts(tmp_path: Path) -> None:
    """After `create` the init's table is the container's own, read from its
    root: this process's table (with /proc, without /run/cgpu) stands for a
    container whose mounts a link sent elsewhere."""
    lc, svc = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", GPU)
    iid = handle(lc, ["prepare", "job", "shim-binds"], str(b).encode()).split()[-1]
    with pytest.raises(UsageError, match="cgpu's mount at /run/cgpu is not in place"):
        handle(lc, ["bind", iid], state("job", b, os.getpid()))
    assert svc.get(iid).state is InstanceState.RELEASED  # the container does not start: its instance goes


def test_prepare_takes_only_the_shim_binds_flag(tmp_path: Path) -> None:
    lc, _ = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", GPU)
    with pytest.raises(RelayProtocolError):
        handle(lc, ["prepare", "job", "no-hooks-please"], str(b).encode())
    assert "hooks" not in json.loads((b / "config.json").read_text())


def test_a_release_answers_before_its_work_and_holds_the_memory_until_done(tmp_path: Path, init: int) -> None:
    """The runtime gets its ok before the SQLite write and the tmpfs umount,
    so `runc delete` need not wait for them; but a start that comes after
    the answer must still find the memory free, never a spurious refusal."""
    lc, svc = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", "ALIYUN_COM_GPU_MEM_CONTAINER=12")
    iid = handle(lc, ["prepare", "job", "shim-binds"], str(b).encode()).split()[-1]
    handle(lc, ["bind", iid], state("job", b, init))
    second = bundle(tmp_path / "second", "ALIYUN_COM_GPU_MEM_CONTAINER=12")  # fits only once `job` is gone
    seen: dict[str, object] = {}

    def decided(text: str) -> None:
        seen["text"] = text
        seen["region then"] = svc.region_dir(iid).exists()
        seen["state then"] = svc.get(iid).state.value
        # The next start, sent the moment the runtime has its answer.
        nxt = threading.Thread(
            target=lambda: seen.setdefault("next", handle(lc, ["prepare", "next", "shim-binds"], str(second).encode()))
        )
        nxt.start()
        nxt.join(0.3)
        seen["next waited"] = nxt.is_alive()  # it must queue behind the release, not be refused
        seen["thread"] = nxt

    assert handle(lc, ["release", iid], state("job", b), decided) == f"released {iid}"
    seen["thread"].join(10)  # type: ignore[attr-defined]
    assert seen["text"] == f"released {iid}"
    assert seen["region then"] is True and seen["state then"] == "bound"  # answered before the work
    assert seen["next waited"] is True
    assert str(seen["next"]).startswith("instance ")
    assert svc.get(iid).state.value == "released" and not svc.region_dir(iid).exists()


def test_a_bind_and_a_release_answer_early_and_refusals_at_the_end(tmp_path: Path, init: int) -> None:
    lc, svc = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", GPU)
    early: list[str] = []
    seen: dict[str, object] = {}
    iid = handle(lc, ["prepare", "job", "shim-binds"], str(b).encode(), early.append).split()[-1]
    assert early == []
    # A bind for another container is refused by its checks: answered at the end.
    with pytest.raises(StateError):
        handle(lc, ["bind", iid], state("other", b, init), early.append)
    assert early == []

    def bind_decided(text: str) -> None:
        early.append(text)
        # A request sent the moment the runtime has its answer waits for the write, and sees it.
        reader = threading.Thread(target=lambda: seen.setdefault("state after", svc.get(iid).state.value))
        reader.start()
        reader.join(0.3)
        seen["waited"] = "yes" if reader.is_alive() else "no"
        seen["reader"] = reader  # type: ignore[assignment]

    handle(lc, ["bind", iid], state("job", b, init), bind_decided)
    seen["reader"].join(10)  # type: ignore[attr-defined]
    assert early == [f"bound {iid}"]
    assert seen["waited"] == "yes" and seen["state after"] == "bound"
    assert "not" in handle(lc, ["release", iid], state("job", bundle(tmp_path / "o", GPU)), early.append)
    assert early == [f"bound {iid}"]  # a refusal or a no-op is answered at the end, as before
    handle(lc, ["release", iid], state("job", b), early.append)
    assert early == [f"bound {iid}", f"released {iid}"]
    handle(lc, ["release", iid], state("job", b), early.append)  # a retried poststop: nothing left to do
    assert early == [f"bound {iid}", f"released {iid}"]


def test_a_bind_whose_write_fails_after_its_answer_kills_the_init_and_frees_the_instance(
    tmp_path: Path, init: int, monkeypatch
) -> None:
    """The runtime already has `ok bound`; the container must not then run
    with an instance cgpud never recorded as bound."""
    from cgpud.node import store as store_module

    lc, svc = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", GPU)
    iid = handle(lc, ["prepare", "job", "shim-binds"], str(b).encode()).split()[-1]
    early: list[str] = []
    real = store_module.Transaction.set_state

    def failing(self, instance_id, new_state, **kw):
        if new_state is InstanceState.BOUND:
            raise StateError("disk full")
        return real(self, instance_id, new_state, **kw)

    monkeypatch.setattr(store_module.Transaction, "set_state", failing)
    with pytest.raises(StateError, match="disk full"):
        handle(lc, ["bind", iid], state("job", b, init), early.append)
    assert early == [f"bound {iid}"]
    until(lambda: not _alive(init), timeout=10, interval=0.01, what="the init to end after the failed bind")
    assert svc.get(iid).state is InstanceState.RELEASED


def _alive(pid: int) -> bool:
    """Running, not a zombie (the fixture reaps it only at the end)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _ask(path: Path, request: bytes, *, read: bool = True) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        return b"".join(iter(lambda: s.recv(65536), b"")) if read else b""  # all of it, up to the close


def test_over_the_socket_a_release_answers_once_and_finishes_without_its_runtime(tmp_path: Path, monkeypatch) -> None:
    lc, svc = lifecycle(tmp_path)
    relay_path = tmp_path / "relay.sock"
    relay = RelayServer(lc, relay_path).start()
    try:
        ids = []
        for name in ("a", "b", "c"):
            b = bundle(tmp_path / name, GPU)
            iid = _ask(relay_path, f"prepare {name} shim-binds\n{b}".encode()).split()[-1]
            ids.append((name, b, iid.decode()))
        name, b, iid = ids[0]
        # One line, then the end of the connection: the relays read up to the newline.
        assert _ask(relay_path, f"release {iid}\n".encode() + state(name, b)) == f"ok released {iid}\n".encode()
        # A runtime killed before reading its answer still has its release done.
        name, b, iid = ids[1]
        _ask(relay_path, f"release {iid}\n".encode() + state(name, b), read=False)
        until(
            lambda: svc.get(iid).state.value == "released",
            timeout=10,
            interval=0.01,
            what="the release of the runtime that did not read its answer",
            explain=lambda: f"the instance is {svc.get(iid).state.value}",
        )
        # Work that fails after the ok is logged, not answered a second time.
        name, b, iid = ids[2]

        def broken(instance_id: str, restore: object = None) -> None:
            raise StateError("the store is gone")

        monkeypatch.setattr(svc, "_release_locked", broken)
        with structlog.testing.capture_logs() as logs:
            assert _ask(relay_path, f"release {iid}\n".encode() + state(name, b)) == f"ok released {iid}\n".encode()
        assert [e["event"] for e in logs if e["log_level"] == "error"] == ["request failed after it was answered"]
    finally:
        relay.stop()


def test_a_request_is_answered_while_the_work_after_an_earlier_answer_runs(tmp_path: Path, monkeypatch) -> None:
    """The spare region made after an answer must not hold up the next
    container's start: it runs on its own thread, beside the accepting one."""
    lc, _ = lifecycle(tmp_path)
    busy, go_on = threading.Event(), threading.Event()

    def slow_idle() -> None:
        busy.set()
        assert go_on.wait(10)

    monkeypatch.setattr(lc, "idle", slow_idle)
    relay_path = tmp_path / "relay.sock"
    relay = RelayServer(lc, relay_path).start()
    try:
        first = _ask(relay_path, f"prepare a shim-binds\n{bundle(tmp_path / 'a', GPU)}".encode())
        assert first.startswith(b"ok instance ") and busy.wait(10)
        began = time.monotonic()
        second = _ask(relay_path, f"prepare b shim-binds\n{bundle(tmp_path / 'b', GPU)}".encode())
        assert second.startswith(b"ok instance ") and not go_on.is_set()
        assert time.monotonic() - began < 5
    finally:
        go_on.set()
        relay.stop()
    assert not [t for t in threading.enumerate() if t.name == "cgpud-relay-after"]
