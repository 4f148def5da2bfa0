"""cgpud learns of a bound container's init exiting from a pidfd: the
watch itself over real child processes, then the instance service over a
real store: released or handed back at the exit, and a start refused for
room retried once the exits that are ready are handled."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.node.exits import ExitWatch
from cgpud.node.model import GIB, GpuCapacity, InstanceState, NodePolicy, Owner, OwnerKind, Request
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from cgpud.errors import AdmissionError
from tests.harness.wait import until

GPUS = (GpuCapacity(0, "GPU-aaaa", 16 * GIB),)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for child in started:
        child.kill()
        child.wait()


def sleeper(children: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    return children[-1]


@pytest.fixture
def running() -> Iterator[tuple[ExitWatch, list[tuple[str, int]], threading.Event]]:
    seen: list[tuple[str, int]] = []
    stop = threading.Event()
    watch = ExitWatch()
    thread = watch.start(lambda iid, pid: seen.append((iid, pid)), stop)
    yield watch, seen, stop
    stop.set()
    thread.join(timeout=5)


def test_an_exit_is_told_once_with_the_pid_it_was_watched_for(running, children) -> None:
    watch, seen, _ = running
    a, b = sleeper(children), sleeper(children)
    watch.watch("inst-a", a.pid)
    watch.watch("inst-b", b.pid)
    a.kill()  # a zombie until waited for: exited all the same
    until(lambda: seen == [("inst-a", a.pid)], 10.0, interval=0.01)
    assert watch.watching() == {"inst-b": b.pid}
    time.sleep(0.2)
    assert seen == [("inst-a", a.pid)]  # once


def test_a_forgotten_or_replaced_watch_tells_nothing(running, children) -> None:
    watch, seen, _ = running
    a, b, c = sleeper(children), sleeper(children), sleeper(children)
    watch.watch("inst-a", a.pid)
    watch.forget("inst-a")
    watch.watch("inst-b", b.pid)
    watch.watch("inst-b", c.pid)  # bound again to another init
    a.kill()
    b.kill()
    time.sleep(0.3)
    assert seen == []
    c.kill()
    until(lambda: seen == [("inst-b", c.pid)], 10.0, interval=0.01)


def test_a_process_gone_before_the_watch_is_told_at_once(running, children) -> None:
    watch, seen, _ = running
    gone = sleeper(children)
    gone.kill()
    gone.wait()  # reaped: no pidfd can be opened for it
    watch.watch("inst-a", gone.pid)
    until(lambda: seen == [("inst-a", gone.pid)], 10.0, interval=0.01)


def test_settle_hands_ready_exits_to_the_caller_and_nothing_twice(children) -> None:
    seen: list[tuple[str, str]] = []
    watch = ExitWatch()
    watch.handle_with(lambda iid, pid: seen.append((iid, threading.current_thread().name)))  # no thread
    a = sleeper(children)
    watch.watch("inst-a", a.pid)
    assert watch.settle() is False
    a.kill()
    a.wait()
    assert watch.settle() is True
    assert watch.settle() is False
    assert seen == [("inst-a", threading.current_thread().name)]
    watch.close()


# ---- the instance service ------------------------------------------------------------


def service(tmp_path: Path, exits: ExitWatch | None) -> InstanceService:
    return InstanceService(
        Store(tmp_path / "db" / "cgpud.db"), GPUS, NodePolicy(), tmp_path / "regions", "580", "b", exits=exits
    )


def test_a_containers_own_instance_is_released_when_its_init_exits(tmp_path, children) -> None:
    exits, stop = ExitWatch(), threading.Event()
    svc = service(tmp_path, exits)
    exits.start(svc.init_exited, stop)
    try:
        init = sleeper(children)
        inst = svc.create(Request(Owner(OwnerKind.CONTAINER, "job@/b"), 8 * GIB))
        svc.bind_container(inst.id, "job@/b", init.pid)
        assert exits.watching() == {inst.id: init.pid}
        init.kill()
        until(lambda: svc.get(inst.id).state is InstanceState.RELEASED, 10.0, interval=0.01)
        assert exits.watching() == {}
    finally:
        stop.set()


def test_a_claimed_instance_goes_back_to_reserved_and_a_later_holder_is_kept(tmp_path, children) -> None:
    exits, stop = ExitWatch(), threading.Event()
    svc = service(tmp_path, exits)
    exits.start(svc.init_exited, stop)
    try:
        inst = svc.create(Request(Owner(OwnerKind.DEVICE, "cgpuctl-1"), 4 * GIB))
        first, second = sleeper(children), sleeper(children)
        svc.bind_container(inst.id, "one@/b1", first.pid)
        first.kill()
        until(lambda: svc.get(inst.id).state is InstanceState.RESERVED, 10.0, interval=0.01)
        svc.bind_container(inst.id, "two@/b2", second.pid)  # the next container of the pod
        assert svc.get(inst.id).holder == "two@/b2"
        # A late word about the first init changes nothing now.
        svc.init_exited(inst.id, first.pid)
        assert svc.get(inst.id).state is InstanceState.BOUND and svc.get(inst.id).pids == (second.pid,)
        second.kill()
        until(lambda: svc.get(inst.id).state is InstanceState.RESERVED, 10.0, interval=0.01)
    finally:
        stop.set()


@pytest.mark.parametrize("watched", [True, False], ids=["with-exit-watch", "without"])
def test_a_start_refused_for_room_held_by_a_stopped_container_is_retried(tmp_path, children, watched) -> None:
    """`docker rm -f a && docker run b`: a's init is dead when b asks, but
    its exit may not be handled yet. The refusal handles the exits that
    are ready, then admits once more."""
    exits = ExitWatch() if watched else None
    svc = service(tmp_path, exits)
    if exits is not None:
        exits.handle_with(svc.init_exited)  # no thread: only the retry can handle it
    a = sleeper(children)
    inst = svc.create(Request(Owner(OwnerKind.CONTAINER, "a@/a"), 16 * GIB))
    svc.bind_container(inst.id, "a@/a", a.pid)
    a.kill()
    a.wait()
    if watched:
        b = svc.create(Request(Owner(OwnerKind.CONTAINER, "b@/b"), 16 * GIB))
        assert svc.get(inst.id).state is InstanceState.RELEASED and b.grants[0].memory == 16 * GIB
    else:
        with pytest.raises(AdmissionError):
            svc.create(Request(Owner(OwnerKind.CONTAINER, "b@/b"), 16 * GIB))
