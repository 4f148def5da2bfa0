"""state.py: the cluster view and the overlay of reservations just made."""

from __future__ import annotations

import threading

from cgpud.node.model import Share
from cgpud.extender.fit import Placement, fit
from cgpud.extender.model import PodShare
from cgpud.extender.pod import pod_demand
from cgpud.extender.state import ClusterState, Hold
from tests.harness.extender_nodes import GIB, container, gpu, node, pod


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hold(
    uid: str = "u1", gib: int = 12, incarnation: str = "inc-1", revision: int = 5, expires: float = 2000.0
) -> Hold:
    return Hold(uid, "ns", uid, (Share(0, gib * GIB, 0, 1),), incarnation, revision, expires)


def test_set_state_entry_view_and_summary() -> None:
    s = ClusterState()
    assert s.entry("n1") is None and s.view().nodes == ()
    s.set_state("n2", "10.0.0.2:9455", node("n2"))
    s.set_state("n1", "10.0.0.1:9455", node("n1"))
    e = s.entry("n1")
    assert e is not None and e.connected and e.error == "" and e.capacity_address == "10.0.0.1:9455"
    assert [n.name for n in s.view().nodes] == ["n1", "n2"]
    rec = s.record("n1")
    assert rec is not None and rec.summary is not None and rec.summary.state is e.state


def test_set_down_keeps_the_last_view_and_refuses() -> None:
    s = ClusterState()
    s.set_state("n1", "a:1", node())
    s.set_down("n1", "a:1", "connection refused")
    e = s.entry("n1")
    assert e is not None and not e.connected and e.error == "connection refused" and e.state is not None
    rec = s.record("n1")
    assert rec is not None and rec.summary is None
    s.set_down("n9", "b:1", "")
    e9 = s.entry("n9")
    assert e9 is not None and e9.state is None and e9.error == "stream down"
    s.set_state("n1", "a:1", node(revision=2))
    e = s.entry("n1")
    assert e is not None and e.connected and e.error == ""


def test_a_hold_counts_until_a_view_at_its_revision() -> None:
    clock = Clock()
    s = ClusterState(clock)
    s.set_state("n1", "a:1", node(gpus=[gpu(0)], revision=4))
    d = pod_demand(pod(containers=[container("c", mem="8")]))
    rec = s.record("n1")
    assert rec is not None and isinstance(fit(d, rec.summary), Placement)
    s.hold("n1", hold(gib=12, revision=5))
    e = s.entry("n1")
    assert e is not None and e.state is not None
    g = e.state.gpus[0]
    assert (g.memory_allocated, g.memory_reserved, g.instances) == (12 * GIB, 12 * GIB, 1)
    assert any(p.reserved and p.pod_uid == "u1" for p in e.state.pods)
    rec = s.record("n1")
    assert rec is not None and not isinstance(fit(d, rec.summary), Placement)
    # A view from before the Reserve does not count it: the hold stays.
    s.set_state("n1", "a:1", node(gpus=[gpu(0)], revision=4))
    e = s.entry("n1")
    assert e is not None and e.state is not None and e.state.gpus[0].memory_allocated == 12 * GIB
    # The view at the Reserve's revision counts it itself: the hold goes, nothing counted twice.
    s.set_state("n1", "a:1", node(gpus=[gpu(0, used=12)], revision=5))
    rec = s.record("n1")
    assert rec is not None and rec.holds == () and rec.entry.state is not None
    assert rec.entry.state.gpus[0].memory_allocated == 12 * GIB


def test_a_hold_across_incarnations_stays_until_the_view_shows_the_pod() -> None:
    s = ClusterState(Clock())
    s.set_state("n1", "a:1", node(gpus=[gpu(0)], incarnation="old", revision=9))
    s.hold("n1", hold(incarnation="new", revision=2))
    s.set_state("n1", "a:1", node(gpus=[gpu(0)], incarnation="old", revision=10))
    rec = s.record("n1")
    assert rec is not None and len(rec.holds) == 1
    shown = PodShare("u1", "ns", "u1", "", ((0, 12 * GIB, 0),), reserved=True)
    s.set_state("n1", "a:1", node(gpus=[gpu(0, used=12)], incarnation="newer", revision=1, pods=[shown]))
    rec = s.record("n1")
    assert rec is not None and rec.holds == ()


def test_holds_expire_and_are_released() -> None:
    clock = Clock()
    s = ClusterState(clock)
    s.set_state("n1", "a:1", node(gpus=[gpu(0)]))
    s.hold("n1", hold("u1", expires=1010.0))
    s.hold("n1", hold("u2", gib=2, expires=1100.0))
    rec = s.record("n1")
    assert rec is not None and rec.entry.state is not None and rec.entry.state.gpus[0].memory_allocated == 14 * GIB
    clock.now = 1050.0
    s.expire()
    rec = s.record("n1")
    assert rec is not None and [h.pod_uid for h in rec.holds] == ["u2"]
    s.release("n1", "u2")
    rec = s.record("n1")
    assert rec is not None and rec.holds == () and rec.entry.state is not None
    assert rec.entry.state.gpus[0].memory_allocated == 0


def test_a_second_hold_for_the_same_pod_replaces_the_first() -> None:
    s = ClusterState(Clock())
    s.set_state("n1", "a:1", node(gpus=[gpu(0)]))
    s.hold("n1", hold("u1", gib=4))
    s.hold("n1", hold("u1", gib=6))
    rec = s.record("n1")
    assert rec is not None and rec.entry.state is not None and rec.entry.state.gpus[0].memory_allocated == 6 * GIB


def test_hold_on_an_unknown_node_is_ignored_and_holds_survive_a_down_stream() -> None:
    s = ClusterState(Clock())
    s.hold("nx", hold())
    assert s.entry("nx") is None
    s.set_state("n1", "a:1", node(gpus=[gpu(0)]))
    s.hold("n1", hold())
    s.set_down("n1", "a:1", "gone")
    s.set_state("n1", "a:1", node(gpus=[gpu(0)], revision=1))
    rec = s.record("n1")
    assert rec is not None and len(rec.holds) == 1


def test_concurrent_writers_and_readers() -> None:
    s = ClusterState(Clock())
    names = [f"n{i}" for i in range(20)]
    errors: list[BaseException] = []

    def write(k: int) -> None:
        try:
            for r in range(200):
                s.set_state(names[(k + r) % 20], "a:1", node(names[(k + r) % 20], revision=r))
                s.hold(names[r % 20], hold(f"u{k}-{r}"))
        except BaseException as e:
            errors.append(e)

    def read() -> None:
        try:
            for _ in range(2000):
                for n in names:
                    rec = s.record(n)
                    if rec is not None:
                        assert rec.entry.name == n
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(s.view().nodes) == 20


def test_changed_since_names_the_nodes_written_after_a_generation() -> None:
    s = ClusterState()
    g0 = s.generation
    s.set_state("a", "a:1", node("a"))
    s.set_state("b", "b:1", node("b"))
    g2 = s.generation
    assert s.changed_since(g0) == (g2, {"a", "b"})
    assert s.changed_since(g2) == (g2, set())
    s.set_down("a", "a:1", "gone")
    s.remove("b")
    s.remove("never-there")
    assert s.changed_since(g2) == (g2 + 2, {"a", "b"})


def test_changed_since_too_far_back_says_so() -> None:
    from cgpud.extender.state import CHANGE_LOG

    s = ClusterState()
    s.set_state("a", "a:1", node("a"))
    g1 = s.generation
    for r in range(CHANGE_LOG + 1):
        s.set_state("b", "b:1", node("b", revision=r))
    assert s.changed_since(g1)[1] is None
    assert s.changed_since(s.generation - 3)[1] == {"b"}


def test_a_pending_hold_answered_keeps_the_state_and_summary_but_goes_with_its_revision() -> None:
    clock = Clock()
    s = ClusterState(clock)
    s.set_state("n1", "a:1", node(gpus=[gpu(0)], revision=4))
    s.hold("n1", hold("u0", gib=1, revision=5))  # an earlier hold: its place is kept
    s.hold("n1", hold("u1", gib=4, incarnation="", revision=0))  # pending: the Reserve is under way
    pending = s.record("n1")
    generation = s.generation
    s.hold("n1", hold("u1", gib=4, revision=6))  # the Reserve's answer: same shares
    rec = s.record("n1")
    assert rec is not None and pending is not None
    assert rec.entry is pending.entry and rec.summary is pending.summary and s.generation == generation
    assert [(h.pod_uid, h.revision) for h in rec.holds] == [("u0", 5), ("u1", 6)]
    # The view at its revision takes both away.
    s.set_state("n1", "a:1", node(gpus=[gpu(0, used=5)], revision=6))
    rec = s.record("n1")
    assert rec is not None and rec.holds == () and rec.entry.state is not None
    assert rec.entry.state.gpus[0].memory_allocated == 5 * GIB
    # Other shares for the pod, or a hold that ran out meanwhile: the state is made again.
    s.hold("n1", hold("u2", gib=2, incarnation="", revision=0, expires=1010.0))
    s.hold("n1", hold("u3", gib=1, incarnation="", revision=0))
    clock.now = 1020.0
    s.hold("n1", hold("u3", gib=1, revision=7))
    rec = s.record("n1")
    assert rec is not None and rec.entry.state is not None and [h.pod_uid for h in rec.holds] == ["u3"]
    assert rec.entry.state.gpus[0].memory_allocated == 6 * GIB and s.generation > generation


def test_answers_follow_each_nodes_summary() -> None:
    s = ClusterState(Clock())
    s.set_state("n1", "a:1", node(gpus=[gpu(0)]))
    rec = s.record("n1")
    assert rec is not None and rec.summary is not None and s.answers["n1"] is rec.summary.rendered
    s.set_state("n1", "a:1", node(gpus=[gpu(0, used=2)], revision=2))
    rec = s.record("n1")
    assert rec is not None and rec.summary is not None and s.answers["n1"] is rec.summary.rendered
    s.set_down("n1", "a:1", "connection refused")  # no summary while down: no answers
    assert "n1" not in s.answers
    s.set_state("n1", "a:1", node(gpus=[gpu(0)], revision=3))
    assert "n1" in s.answers
    s.remove("n1")
    assert "n1" not in s.answers and s.record("n1") is None
