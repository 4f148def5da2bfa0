"""Reservations on the node: the Changes counter with real threads, the
store's reservations table on real SQLite files (an older file gains it, a
damaged row is skipped), and InstanceService.reserve/unreserve/create over
a real file: expiry by the service clock, replacement, what an instance
takes off its pod's reservation, restarts, and threads racing for the last
GiB."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from cgpud.node.changes import Changes
from cgpud.node.model import GIB, ComputePolicy, GpuCapacity, InstanceState, NodeMode, NodePolicy, Owner, OwnerKind
from cgpud.node.model import Instance, Placement, Request, Reservation, Share
from cgpud.node.service import DEFAULT_RESERVATION_TTL, InstanceService
from cgpud.node.store import SCHEMA_VERSION, Store
from cgpud.errors import AdmissionError, StateError, UsageError
from tests.harness.threads import run_threads

GPUS = (GpuCapacity(0, "GPU-aaaa", 16 * GIB), GpuCapacity(1, "GPU-bbbb", 16 * GIB))


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def service(
    tmp_path: Path, mode: NodeMode = NodeMode.CGPU, clock: Callable[[], float] = time.time, **kw: object
) -> InstanceService:
    return InstanceService(
        Store(tmp_path / "db" / "cgpud.db"),
        GPUS,
        NodePolicy(mode=mode),
        tmp_path / "regions",
        "580.65.06",
        "boot-1",
        clock=clock,
        **kw,
    )  # type: ignore[arg-type]


def pod(uid: str, container: str = "main") -> Owner:
    return Owner(OwnerKind.POD, f"{uid}/{container}")


def gib(index: int, n: float, core: int = 0, instances: int = 1) -> Share:
    return Share(index, int(n * GIB), core, instances)


# --------------------------------------------------------------------------
# Changes


def test_changes_count_from_zero_and_each_bump_returns_the_new_revision():
    c = Changes()
    assert c.revision == 0
    assert [c.bump(), c.bump(), c.bump()] == [1, 2, 3]
    assert c.revision == 3


def test_each_changes_has_its_own_incarnation():
    a, b = Changes(), Changes()
    assert a.incarnation != b.incarnation
    assert len(a.incarnation) == 32 and int(a.incarnation, 16) >= 0


def test_wait_returns_at_once_when_already_past():
    c = Changes()
    c.bump()
    c.bump()
    start = time.monotonic()
    assert c.wait(0, timeout=5.0) == 2
    assert c.wait(1, timeout=5.0) == 2
    assert time.monotonic() - start < 0.5


def test_wait_is_bounded_by_its_timeout():
    c = Changes()
    c.bump()
    start = time.monotonic()
    assert c.wait(1, timeout=0.2) == 1
    assert 0.15 <= time.monotonic() - start < 2.0
    assert c.wait(1, timeout=0) == 1
    assert c.wait(1, timeout=-3) == 1


def test_a_bump_from_another_thread_wakes_every_waiter():
    c = Changes()
    got: list[int] = []
    lock = threading.Lock()

    def waiter() -> None:
        r = c.wait(0, timeout=10.0)
        with lock:
            got.append(r)

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    start = time.monotonic()
    c.bump()
    for t in threads:
        t.join(5.0)
    assert got == [1] * 8
    assert time.monotonic() - start < 2.0  # woken, not timed out


def test_concurrent_bumps_are_all_counted():
    c = Changes()
    seen: list[int] = []
    lock = threading.Lock()

    def bumper() -> None:
        for _ in range(500):
            r = c.bump()
            with lock:
                seen.append(r)

    run_threads(*[bumper] * 4)
    assert c.revision == 2000
    assert sorted(seen) == list(range(1, 2001))  # each revision handed out once


# --------------------------------------------------------------------------
# Store


def test_store_puts_lists_replaces_and_deletes(tmp_path: Path):
    with Store(tmp_path / "cgpud.db") as s:
        assert s.reservations() == []
        a = Reservation("uid-a", "ns", "a", (gib(0, 2), gib(1, 3, 10, 2)), 50.0)
        b = Reservation("uid-b", "ns", "b", (gib(1, 1),), 60.0)
        s.put_reservation(b)
        s.put_reservation(a)
        assert s.reservations() == [a, b]  # by pod UID
        a2 = Reservation("uid-a", "other", "a2", (gib(0, 5),), 70.0)
        s.put_reservation(a2)
        assert s.reservations() == [a2, b]
        assert s.delete_reservation("uid-a") is True
        assert s.delete_reservation("uid-a") is False
        assert s.reservations() == [b]


def test_store_deletes_expired_reservations(tmp_path: Path):
    with Store(tmp_path / "cgpud.db") as s:
        for uid, expires in (("a", 10.0), ("b", 20.0), ("c", 30.0)):
            s.put_reservation(Reservation(uid, "ns", uid, (gib(0, 1),), expires))
        assert s.delete_expired_reservations(20.0) == ["a", "b"]
        assert [r.pod_uid for r in s.reservations()] == ["c"]
        assert s.delete_expired_reservations(20.0) == []


def test_store_reservation_writes_roll_back_with_their_transaction(tmp_path: Path):
    with Store(tmp_path / "cgpud.db") as s:
        with pytest.raises(RuntimeError):
            with s.transaction() as tx:
                tx.put_reservation(Reservation("a", "ns", "a", (gib(0, 1),), 10.0))
                assert [r.pod_uid for r in tx.reservations()] == ["a"]
                raise RuntimeError("boom")
        assert s.reservations() == []


def test_store_refuses_a_reservation_without_a_pod_uid(tmp_path: Path):
    with Store(tmp_path / "cgpud.db") as s:
        with pytest.raises(UsageError, match="needs a pod UID"):
            s.put_reservation(Reservation("", "ns", "a", (gib(0, 1),), 10.0))


@pytest.mark.parametrize(
    "shares",
    [
        "not json",
        '{"gpu_index": 0}',
        '[{"gpu_index": 0, "memory": 1}]',
        '[{"gpu_index": 0, "memory": "1", "core_percent": 0, "instances": 1}]',
        '[{"gpu_index": 0, "memory": 1.5, "core_percent": 0, "instances": 1}]',
        '[{"gpu_index": true, "memory": 1, "core_percent": 0, "instances": 1}]',
        "[[0, 1, 0, 1]]",
        '["x"]',
    ],
)
def test_a_damaged_reservation_row_is_skipped_not_fatal(tmp_path: Path, shares: str, capsys):
    path = tmp_path / "cgpud.db"
    good = Reservation("uid-good", "ns", "g", (gib(0, 1),), 50.0)
    with Store(path) as s:
        s.put_reservation(good)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("INSERT INTO reservations VALUES ('uid-bad', 'ns', 'b', ?, 50.0)", (shares,))
    conn.execute("INSERT INTO reservations VALUES ('uid-bad2', 'ns', 'b', '[]', 'soon')")
    conn.close()
    with Store(path) as s:
        assert s.reservations() == [good]
    out = capsys.readouterr().out
    assert "unreadable reservation skipped" in out and "uid-bad" in out


def test_a_version_2_file_opens_and_gains_the_reservations_table(tmp_path: Path):
    path = tmp_path / "cgpud.db"
    with Store(path):
        pass
    # Make it the file cgpud wrote before reservations: version 2, no table.
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("DROP TABLE reservations")
    conn.execute("DROP TABLE runtime_users")  # version 4's
    conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    conn.close()
    r = Reservation("uid-a", "ns", "a", (gib(1, 2),), 10.0)
    with Store(path) as s:
        assert s.reservations() == []
        s.put_reservation(r)
    conn = sqlite3.connect(path, isolation_level=None)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    assert json.loads(conn.execute("SELECT shares FROM reservations").fetchone()[0]) == [
        {"gpu_index": 1, "memory": 2 * GIB, "core_percent": 0, "instances": 1}
    ]
    conn.close()
    with Store(path) as s:
        assert s.reservations() == [r]


# --------------------------------------------------------------------------
# Service: reserve and unreserve


def test_reserve_holds_capacity_until_unreserve(tmp_path: Path):
    clock = Clock()
    svc = service(tmp_path, clock=clock)
    r = svc.reserve("uid-a", "ns", "a", [gib(1, 4), gib(0, 12)])
    assert r == Reservation("uid-a", "ns", "a", (gib(0, 12), gib(1, 4)), 1000.0 + DEFAULT_RESERVATION_TTL)
    assert svc.reservations() == [r]
    with pytest.raises(AdmissionError, match="most free is 4 GiB on GPU 0"):
        svc.create(Request(pod("uid-b"), 5 * GIB, gpu_indexes=(0,)))
    assert [(g.allocated // GIB, g.instances) for g in svc.node_info().gpus] == [(12, 1), (4, 1)]
    assert svc.unreserve("uid-a") is True
    assert svc.unreserve("uid-a") is False
    assert svc.reservations() == []
    assert svc.create(Request(pod("uid-b"), 16 * GIB, gpu_indexes=(0,))).grants[0].memory == 16 * GIB


def test_reserve_refusals_change_nothing(tmp_path: Path):
    svc = service(tmp_path)
    svc.reserve("uid-a", "ns", "a", [gib(0, 10)])
    before = svc.reservations()
    revision = svc.changes.revision
    with pytest.raises(AdmissionError, match=r"GPU 0 has 6 GiB free \(of 16 GiB\) and the reservation asks for 8 GiB"):
        svc.reserve("uid-b", "ns", "b", [gib(1, 1), gib(0, 8)])
    with pytest.raises(UsageError, match="which has 16 GiB"):
        svc.reserve("uid-b", "ns", "b", [gib(0, 17)])
    with pytest.raises(UsageError, match="needs a pod UID"):
        svc.reserve("", "ns", "b", [gib(0, 1)])
    assert svc.reservations() == before
    assert svc.changes.revision == revision


@pytest.mark.parametrize("mode", [NodeMode.DEFAULT, NodeMode.TOPOLOGY], ids=lambda m: m.value)
def test_whole_gpu_nodes_refuse_to_reserve(tmp_path: Path, mode: NodeMode):
    svc = service(tmp_path, mode)
    with pytest.raises(StateError, match="cgpu-scheduler reserves only on nodes that share GPUs"):
        svc.reserve("uid-a", "ns", "a", [gib(0, 1)])
    assert svc.reservations() == []


@pytest.mark.parametrize("ttl", [0, 0.5, 3600.5, -1, float("inf"), float("nan"), True])
def test_a_time_to_live_out_of_bounds_is_a_usage_error(tmp_path: Path, ttl: float):
    svc = service(tmp_path)
    with pytest.raises(UsageError, match="time to live"):
        svc.reserve("uid-a", "ns", "a", [gib(0, 1)], ttl=ttl)
    assert svc.reservations() == []


def test_a_default_time_to_live_out_of_bounds_is_refused_at_construction(tmp_path: Path):
    with pytest.raises(UsageError, match="time to live is 0 seconds: use 1 to 3600"):
        service(tmp_path, reservation_ttl=0)


@pytest.mark.parametrize("ttl, expires", [(None, 1030.0), (1, 1001.0), (3600, 4600.0), (2.5, 1002.5)])
def test_time_to_live(tmp_path: Path, ttl: float | None, expires: float):
    svc = service(tmp_path, clock=Clock(), reservation_ttl=30.0)
    assert svc.reserve("uid-a", "ns", "a", [gib(0, 1)], ttl=ttl).expires == expires


def test_an_expired_reservation_holds_nothing_even_before_the_sweep(tmp_path: Path):
    clock = Clock()
    svc = service(tmp_path, clock=clock)
    svc.reserve("uid-a", "ns", "a", [gib(0, 16)], ttl=10)
    with pytest.raises(AdmissionError):
        svc.reserve("uid-b", "ns", "b", [gib(0, 1)])
    clock.now += 9.9
    assert len(svc.reservations()) == 1
    clock.now += 0.1
    assert svc.reservations() == []
    assert svc.reserve("uid-b", "ns", "b", [gib(0, 8)]).pod_uid == "uid-b"
    assert svc.create(Request(pod("uid-c"), 8 * GIB, gpu_indexes=(0,))).grants[0].gpu_index == 0
    # The row is still there until the sweep deletes it, and says so.
    revision = svc.changes.revision
    assert [r.pod_uid for r in svc._store.reservations()] == ["uid-a", "uid-b"]
    svc.sweep()
    assert [r.pod_uid for r in svc._store.reservations()] == ["uid-b"]
    assert svc.changes.revision == revision + 1
    svc.sweep()  # nothing expired: no change
    assert svc.changes.revision == revision + 1


def test_the_same_pod_again_replaces_its_reservation(tmp_path: Path):
    svc = service(tmp_path, clock=Clock())
    svc.reserve("uid-a", "ns", "a", [gib(0, 12)])
    # Checked as if the old one were gone: 14 GiB fit only then.
    r = svc.reserve("uid-a", "ns", "a", [gib(0, 14)], ttl=5)
    assert svc.reservations() == [r]
    assert r.shares == (gib(0, 14),) and r.expires == 1005.0
    # A refused replacement keeps the old reservation.
    with pytest.raises(UsageError):
        svc.reserve("uid-a", "ns", "a", [gib(0, 20)])
    assert svc.reservations() == [r]


def test_reservations_survive_a_restart(tmp_path: Path):
    clock = Clock()
    first = service(tmp_path, clock=clock)
    kept = first.reserve("uid-a", "ns", "a", [gib(0, 12, 0, 2)], ttl=100)
    first.reserve("uid-b", "ns", "b", [gib(1, 1)], ttl=5)
    first._store.close()
    clock.now += 50
    again = service(tmp_path, clock=clock)
    assert again.reservations() == [kept]
    assert again.changes.incarnation != first.changes.incarnation
    with pytest.raises(AdmissionError, match="most free is 4 GiB on GPU 0"):
        again.create(Request(pod("uid-c"), 5 * GIB, gpu_indexes=(0,)))


# --------------------------------------------------------------------------
# Service: create draws on the pod's reservation


def test_create_draws_on_its_pods_reservation_and_takes_what_it_got(tmp_path: Path):
    svc = service(tmp_path, NodeMode.CORE_MEM, clock=Clock())
    svc.reserve("uid-a", "ns", "a", [gib(0, 12, 60, 2)])
    svc.reserve("uid-b", "ns", "b", [gib(0, 4)])
    # GPU 0 is full for anyone else...
    with pytest.raises(AdmissionError):
        svc.create(Request(pod("uid-c"), GIB, gpu_indexes=(0,)))
    # ...but pod A's containers get what was held for them.
    first = svc.create(Request(pod("uid-a", "one"), 8 * GIB, core_percent=40, gpu_indexes=(0,), reservation="uid-a"))
    assert [(g.gpu_index, g.memory, g.core_percent) for g in first.grants] == [(0, 8 * GIB, 40)]
    [left] = [r for r in svc.reservations() if r.pod_uid == "uid-a"]
    assert left.shares == (gib(0, 4, 20, 1),)
    usage = svc.node_info().gpus[0]
    assert (usage.allocated, usage.core_percent, usage.instances) == (16 * GIB, 60, 3)
    svc.create(Request(pod("uid-a", "two"), 4 * GIB, core_percent=20, gpu_indexes=(0,), reservation="uid-a"))
    assert [r.pod_uid for r in svc.reservations()] == ["uid-b"]  # nothing left of A's


def test_a_request_may_not_draw_on_another_pods_reservation(tmp_path: Path):
    svc = service(tmp_path)
    svc.reserve("uid-a", "ns", "a", [gib(0, 16)])
    with pytest.raises(AdmissionError):
        svc.create(Request(pod("uid-b"), GIB, gpu_indexes=(0,), reservation="uid-b"))
    assert svc.reservations()[0].shares == (gib(0, 16),)


def test_an_instance_elsewhere_takes_nothing_from_the_reservation(tmp_path: Path):
    svc = service(tmp_path)
    svc.reserve("uid-a", "ns", "a", [gib(0, 4)])
    inst = svc.create(Request(pod("uid-a"), 4 * GIB, gpu_indexes=(1,), reservation="uid-a"))
    assert inst.grants[0].gpu_index == 1
    assert svc.reservations()[0].shares == (gib(0, 4),)


def test_a_refused_create_keeps_the_reservation(tmp_path: Path):
    svc = service(tmp_path)
    svc.reserve("uid-a", "ns", "a", [gib(0, 4)])
    svc.create(Request(pod("uid-x"), 12 * GIB, gpu_indexes=(0,)))
    with pytest.raises(AdmissionError):
        svc.create(Request(pod("uid-a"), 5 * GIB, gpu_indexes=(0,), reservation="uid-a"))
    assert svc.reservations()[0].shares == (gib(0, 4),)


def test_an_expired_reservation_is_not_drawn_on(tmp_path: Path):
    clock = Clock()
    svc = service(tmp_path, clock=clock)
    svc.reserve("uid-a", "ns", "a", [gib(0, 8)], ttl=10)
    clock.now += 20
    svc.create(Request(pod("uid-a"), 4 * GIB, gpu_indexes=(0,), reservation="uid-a"))
    # The expired row is left for the sweep, untouched.
    assert svc._store.reservations()[0].shares == (gib(0, 8),)
    assert svc.reservations() == []


# --------------------------------------------------------------------------
# Service: every change a node view shows bumps the revision


def test_every_change_bumps_the_revision(tmp_path: Path):
    svc = service(tmp_path, NodeMode.SHARE)
    inst = svc.create(Request(Owner(OwnerKind.DEVICE, "dev"), GIB))
    revision = svc.changes.revision
    assert revision >= 1

    def check(name: str, call: Callable[[], object]) -> None:
        nonlocal revision
        call()
        assert svc.changes.revision > revision, f"{name} did not bump"
        revision = svc.changes.revision

    check("reserve", lambda: svc.reserve("uid-a", "ns", "a", [gib(0, 1)]))
    check("unreserve", lambda: svc.unreserve("uid-a"))
    check("create", lambda: svc.create(Request(Owner(OwnerKind.POD, "p/c"), GIB)))
    check("bind", lambda: svc.bind(inst.id, (1,)))
    check("unbind", lambda: svc.unbind(inst.id))
    check("bind_container", lambda: svc.bind_container(inst.id, "ctr", 1))
    check("container_stopped", lambda: svc.container_stopped(inst.id, "ctr"))
    check("set_compute_policy", lambda: svc.set_compute_policy(ComputePolicy.FAIR))
    check("set_node_policy", lambda: svc.set_node_policy(NodeMode.SHARE, Placement.SPREAD))
    check("release", lambda: svc.release(inst.id))
    # What changes nothing bumps nothing.
    for name, call in (
        ("unreserve of none", lambda: svc.unreserve("nobody")),
        ("release again", lambda: svc.release(inst.id)),
        ("sweep", svc.sweep),
    ):
        call()
        assert svc.changes.revision == revision, f"{name} bumped"


def test_a_watcher_is_woken_by_a_reserve(tmp_path: Path):
    svc = service(tmp_path)
    start = svc.changes.revision
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(svc.changes.wait(start, timeout=10.0)))
    t.start()
    time.sleep(0.1)
    svc.reserve("uid-a", "ns", "a", [gib(0, 1)])
    t.join(5.0)
    assert got == [start + 1]


# --------------------------------------------------------------------------
# Service: threads racing for the last GiB, on a real SQLite file


def race(calls: list[Callable[[], object]]) -> list[object]:
    """Run the calls at once from their own threads; each one's result or exception."""
    results: list[object] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except Exception as e:
            results[i] = e

    run_threads(*(partial(run, i) for i in range(len(calls))), timeout=60)
    return results


def test_concurrent_reserves_never_both_get_the_last_gib(tmp_path: Path):
    svc = service(tmp_path)
    svc.reserve("uid-base", "ns", "base", [gib(0, 15)])
    for round_ in range(5):
        results = race([lambda i=i: svc.reserve(f"uid-{round_}-{i}", "ns", "p", [gib(0, 1)]) for i in range(8)])
        won = [r for r in results if isinstance(r, Reservation)]
        lost = [r for r in results if not isinstance(r, Reservation)]
        assert len(won) == 1, results
        assert all(isinstance(e, AdmissionError) for e in lost)
        assert svc.unreserve(won[0].pod_uid)


def test_concurrent_reserves_and_creates_fill_a_gpu_exactly(tmp_path: Path):
    svc = service(tmp_path)
    calls: list[Callable[[], object]] = []
    for i in range(24):
        if i % 2:
            calls.append(lambda i=i: svc.reserve(f"uid-{i}", "ns", "p", [gib(0, 1)]))
        else:
            calls.append(lambda i=i: svc.create(Request(pod(f"uid-{i}"), GIB, gpu_indexes=(0,))))
    results = race(calls)
    won = [r for r in results if not isinstance(r, Exception)]
    assert all(isinstance(r, AdmissionError) for r in results if isinstance(r, Exception))
    assert len(won) == 16
    usage = svc.node_info().gpus[0]
    assert usage.allocated == 16 * GIB
    # And from a second service on the same file (another process's view).
    other = service(tmp_path)
    assert other.node_info().gpus[0].allocated == 16 * GIB


def test_instance_state_is_untouched_by_reservations(tmp_path: Path):
    svc = service(tmp_path)
    inst = svc.create(Request(pod("uid-a"), GIB))
    svc.reserve("uid-b", "ns", "b", [gib(1, 1)])
    svc.unreserve("uid-b")
    assert svc.get(inst.id).state is InstanceState.RESERVED


def test_holdings_are_live_reservations_and_active_instances(tmp_path: Path):
    clock = Clock()
    svc = service(tmp_path, clock=clock)
    inst = svc.create(Request(pod("uid-a"), GIB))
    gone = svc.create(Request(pod("uid-b"), GIB))
    svc.release(gone.id)
    kept = svc.reserve("uid-c", "ns", "c", [gib(1, 2)], ttl=100)
    svc.reserve("uid-d", "ns", "d", [gib(1, 2)], ttl=10)
    clock.now += 10
    assert svc.holdings() == ([inst], [kept])


def test_holdings_never_show_a_drawn_share_twice_or_not_at_all(tmp_path: Path):
    # While containers draw on their pod's reservation, what an instance took
    # and what is left of the reservation always add up to what was reserved.
    svc = service(tmp_path)
    svc.reserve("uid-a", "ns", "a", [gib(0, 16, 0, 16)])
    done = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        while not done.is_set():
            active, reserved = svc.holdings()
            seen.append(
                sum(g.memory for i in active for g in i.grants) + sum(s.memory for r in reserved for s in r.shares)
            )

    t = threading.Thread(target=reader)
    t.start()
    try:
        results = race(
            [
                lambda i=i: svc.create(Request(pod("uid-a", f"c{i}"), GIB, gpu_indexes=(0,), reservation="uid-a"))
                for i in range(16)
            ]
        )
    finally:
        done.set()
        t.join(10)
    assert not [r for r in results if isinstance(r, Exception)]
    assert svc.reservations() == []
    assert len(seen) > 10 and set(seen) == {16 * GIB}


# --------------------------------------------------------------------------
# Service: an undone instance gives its pod's reservation back


def reserve_then_draw_4_gib(svc: InstanceService, *shares: Share) -> tuple[Reservation, Instance]:
    """Pod uid-a's reservation of `shares`, and its 4 GiB instance on GPU 0
    drawn on it: what each undo below starts from."""
    before = svc.reserve("uid-a", "ns", "a", list(shares))
    return before, svc.create(Request(pod("uid-a"), 4 * GIB, gpu_indexes=(0,), reservation="uid-a"))


def test_release_with_restore_puts_the_reservation_back(tmp_path: Path):
    svc = service(tmp_path)
    before, inst = reserve_then_draw_4_gib(svc, gib(0, 6, 0, 2))
    assert svc.reservations()[0].shares == (gib(0, 2),)
    svc.release(inst.id, restore=before)
    assert svc.reservations() == [before]
    assert svc.node_info().gpus[0].allocated == 6 * GIB


def test_release_with_restore_brings_back_a_reservation_fully_drawn(tmp_path: Path):
    svc = service(tmp_path)
    before, inst = reserve_then_draw_4_gib(svc, gib(0, 4))
    assert svc.reservations() == []
    svc.release(inst.id, restore=before)
    assert svc.reservations() == [before]


def test_release_with_restore_leaves_a_replaced_reservation_alone(tmp_path: Path):
    svc = service(tmp_path)
    before, inst = reserve_then_draw_4_gib(svc, gib(0, 6))
    replaced = svc.reserve("uid-a", "ns", "a", [gib(1, 3)])
    svc.release(inst.id, restore=before)
    assert svc.reservations() == [replaced]


def test_release_with_restore_leaves_a_given_back_reservation_gone(tmp_path: Path):
    svc = service(tmp_path)
    before, inst = reserve_then_draw_4_gib(svc, gib(0, 6))
    svc.unreserve("uid-a")
    svc.release(inst.id, restore=before)
    assert svc.reservations() == []


def test_a_create_the_compute_scheduler_refuses_keeps_the_reservation(tmp_path: Path):
    from cgpud.node.compute import ComputeError

    class Refusing:
        def configure(self, policy: NodePolicy) -> None:
            pass

        def attach(self, instance: object, region: Path) -> None:
            raise ComputeError("no slot")

        def detach(self, instance_id: str) -> None:
            pass

    svc = InstanceService(
        Store(tmp_path / "cgpud.db"),
        GPUS,
        NodePolicy(mode=NodeMode.CORE_MEM),
        tmp_path / "regions",
        "580.65.06",
        "boot-1",
        compute=Refusing(),
    )  # type: ignore[arg-type]
    before = svc.reserve("uid-a", "ns", "a", [gib(0, 4, 20)])
    with pytest.raises(ComputeError):
        svc.create(Request(pod("uid-a"), 4 * GIB, core_percent=20, gpu_indexes=(0,), reservation="uid-a"))
    assert svc.list() == []
    assert svc.reservations() == [before]


# --------------------------------------------------------------------------
# Service: random operations with time passing never overcommit a GPU


@pytest.mark.parametrize("seed", range(6))
def test_random_reserves_creates_and_expiry_never_overcommit(tmp_path: Path, seed: int):
    import random

    rng = random.Random(seed)
    clock = Clock()
    policy = NodePolicy(mode=NodeMode.CORE_MEM, max_instances_per_gpu=3)
    svc = InstanceService(
        Store(tmp_path / "cgpud.db"), GPUS, policy, tmp_path / "regions", "580.65.06", "boot-1", clock=clock
    )
    pods = [f"uid-{n}" for n in range(5)]
    created = 0
    for step in range(150):
        op = rng.choice(["reserve", "create", "create", "release", "unreserve", "time", "sweep"])
        uid = rng.choice(pods)
        try:
            if op == "reserve":
                shares = [
                    Share(i, rng.randint(1, 10) * GIB, rng.choice([0, 25, 50]), rng.randint(0, 2))
                    for i in rng.sample([0, 1], rng.randint(1, 2))
                ]
                svc.reserve(uid, "ns", uid, shares, ttl=rng.choice([1, 5, 30]))
            elif op == "create":
                gpu = rng.choice([(), (0,), (1,)])
                svc.create(
                    Request(
                        pod(uid, f"c{step}"),
                        rng.randint(1, 8) * GIB,
                        core_percent=rng.choice([0, 25]),
                        gpu_indexes=gpu,
                        reservation=rng.choice([uid, ""]),
                    )
                )
                created += 1
            elif op == "release":
                live = svc.list()
                if live:
                    svc.release(rng.choice(live).id)
            elif op == "unreserve":
                svc.unreserve(uid)
            elif op == "time":
                clock.now += rng.choice([0.5, 2, 10])
            else:
                svc.sweep()
        except (AdmissionError, UsageError):
            pass
        for u in svc.node_info().gpus:
            assert u.allocated <= u.gpu.memory, (seed, step)
            assert u.core_percent <= 100, (seed, step)
            assert u.instances <= policy.max_instances_per_gpu, (seed, step)
        assert all(r.live(clock.now) for r in svc.reservations())
    assert created > 5  # the sequence did exercise admission


def test_a_row_changed_under_an_open_store_is_read_as_it_is_now(tmp_path: Path, capsys):
    """Decoded reservations are kept by their whole row: a row another
    writer changed (its expiry, its shares, damaged) is decoded again."""
    path = tmp_path / "cgpud.db"
    with Store(path) as s:
        s.put_reservation(Reservation("uid-a", "ns", "a", (gib(0, 1),), 50.0))
        assert [r.expires for r in s.reservations()] == [50.0]
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("UPDATE reservations SET expires = 70.0 WHERE pod_uid = 'uid-a'")
        assert [r.expires for r in s.reservations()] == [70.0]
        conn.execute(
            "UPDATE reservations SET shares = ? WHERE pod_uid = 'uid-a'",
            ('[{"gpu_index": 1, "memory": 2, "core_percent": 5, "instances": 1}]',),
        )
        assert s.reservations()[0].shares == (Share(1, 2, 5, 1),)
        conn.execute("UPDATE reservations SET shares = 'not json' WHERE pod_uid = 'uid-a'")
        assert s.reservations() == []
        conn.close()
    assert "unreadable reservation skipped" in capsys.readouterr().out


def test_a_sweep_that_finds_nothing_expired_writes_nothing(tmp_path: Path):
    clock = Clock()
    svc = service(tmp_path, clock=clock)
    svc.reserve("uid-a", "ns", "a", [gib(0, 1)], ttl=10)
    svc.create(Request(pod("uid-c"), GIB, gpu_indexes=(0,)))
    writes: list[str] = []
    svc.sweep()  # the first also purges old released rows (then once an hour)
    svc._store._connection().set_trace_callback(lambda sql: writes.append(sql) if "IMMEDIATE" in sql else None)
    svc.sweep()
    assert writes == []
    clock.now += 10
    svc.sweep()
    assert len(writes) == 1 and svc.reservations() == []
