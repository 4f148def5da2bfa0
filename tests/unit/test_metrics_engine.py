"""The engine's per-tenant accounting that /metrics reports (charged and
throttled time, grants, the 1 s achieved-share window), against real region
files with this test playing two tenants that always have work and fence
every closing at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.node.compute import ComputeScheduler
from cgpud.node.model import ComputePolicy, NodePolicy
from tests.harness.scheduled_tenant import FAST, OPEN, SEQ, Tenant
from tests.harness.wait import until


@pytest.fixture
def sched() -> Iterator[ComputeScheduler]:
    s = ComputeScheduler(1, FAST).start()
    yield s
    s.stop()


def _fence_promptly(tenants: list[tuple[Tenant, int]], stop: threading.Event) -> None:
    """Acknowledges every closing of each tenant's gate as soon as it is seen."""
    acked = {id(t): -1 for t, _ in tenants}
    while not stop.is_set():
        for t, ledger in tenants:
            gate = t.gate
            if not gate & OPEN and gate & SEQ != acked[id(t)]:
                t.ack(ledger)
                acked[id(t)] = gate & SEQ
        time.sleep(0.0002)


def test_charged_throttled_and_achieved_follow_the_fixed_shares(sched: ComputeScheduler, tmp_path: Path) -> None:
    sched.configure(NodePolicy(compute_policy=ComputePolicy.FIXED))
    a, b = Tenant(tmp_path, "a", 30), Tenant(tmp_path, "b", 20)
    sched.attach(a.instance, a.dir)
    sched.attach(b.instance, b.dir)
    stop = threading.Event()
    fencer = threading.Thread(target=_fence_promptly, args=([(a, a.watch()), (b, b.watch())], stop))
    fencer.start()
    try:
        a.want(1)
        b.want(1)
        started = time.monotonic()
        # The first window ends a second after the loop's first turn; the
        # second is the first with both tenants at work throughout.
        until(
            lambda: sched.tenant_metrics()["a"][0].window_ns > 0 and time.monotonic() - started > 2.1,
            5,
            interval=0.0005,
        )
        m = sched.tenant_metrics()
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        fencer.join()
    ma, mb = m["a"][0], m["b"][0]
    assert abs(ma.window_ns - 1e9) < 0.1e9
    assert abs(ma.achieved_percent - 30) <= 5, ma
    assert abs(mb.achieved_percent - 20) <= 5, mb
    for got, share in ((ma, 30), (mb, 20)):
        assert got.grants > 20  # a slice per 20 ms period
        assert abs(got.charged_ns / 1e9 - elapsed * share / 100) <= 0.1 * elapsed
        # Waiting at a closed gate for the rest of each period, at the loop's granularity.
        assert (100 - share - 15) / 100 * elapsed <= got.throttled_ns / 1e9 <= elapsed
    sched.detach("a")
    assert set(sched.tenant_metrics()) == {"b"}
    a.close()
    b.close()


def test_a_tenant_without_work_is_never_throttled_nor_charged(sched: ComputeScheduler, tmp_path: Path) -> None:
    sched.configure(NodePolicy(compute_policy=ComputePolicy.FIXED))
    idle = Tenant(tmp_path, "idle", 30)
    try:
        sched.attach(idle.instance, idle.dir)
        idle.watch()
        time.sleep(0.3)
        m = sched.tenant_metrics()["idle"][0]
        assert (m.charged_ns, m.throttled_ns, m.grants) == (0, 0, 0)
    finally:
        idle.close()
