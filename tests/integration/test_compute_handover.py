"""The GPU is handed over when its holder goes idle (issue 17): a tenant that
works in bursts (2 ms of queued kernels, a cuCtxSynchronize, 10 ms idle, as
an inference server does) beside a saturating one must not leave the device
idle for the rest of its slice after each burst. A real cgpud in core_mem
mode, `cgpuctl run` tenants, busy time from the simulated GPU's own
accounting (tests/harness/sharerun.py). The bound, 90 % busy over 3 s, is loose for
a noisy 2-core CI machine, and it holds the median of three runs: each
hand-over waits on a process being woken, so a stretch of slow wake-ups on
a shared machine can cost one run a few points (89.8 % once in CI, against
95-96 % here) where a slow hand-over costs every run.
bench/bench_compute.py --bursty holds the real target (>= 95 % of the same
processes run natively). The idle grace is learned per instance: read from
cgpud's metrics while the tenants run, the bursty tenant loses it and a
tenant that synchronises after every kernel keeps it."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud._scheduler import lib as slib
from tests.harness.net import free_port
from tests.harness.promscrape import scrape
from tests.harness.sharerun import Scenario, ScenarioResult, ShareRig, TenantSpec

pytestmark = pytest.mark.timing  # measures compute shares and hand-over times

SECONDS = 3.0
BUSY = 90.0  # percent of wall time the device computes
SATURATING = TenantSpec(0)  # 200 us kernels over 4 streams, never idle
BURSTY = TenantSpec(0, burst_ms=2, gap_ms=10)
# Idle for a host round trip after each of its kernels: the hand-over must
# not take the GPU from it at every synchronisation.
SYNCING = TenantSpec(0, kernel_ns=20_000, streams=1, sync_every=1)
FULL_GRACE_S = slib.CGPU_ENGINE_IDLE_GRACE_NS / 1e9
SHORT_GRACE_S = slib.CGPU_ENGINE_IDLE_GRACE_SHORT_NS / 1e9


def scenario(policy: str) -> Scenario:
    return Scenario(f"bursty beside saturating, {policy}", policy, (SATURATING, BURSTY), SECONDS)


class MetricsRig(ShareRig):
    """A ShareRig whose cgpud also serves its metrics."""

    def __init__(self, workdir: Path, port: int) -> None:
        super().__init__(workdir, dict(os.environ), "--metrics-listen", f"127.0.0.1:{port}")
        self.metrics_port = port


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetricsRig]:
    r = MetricsRig(tmp_path_factory.mktemp("handover"), free_port())
    yield r
    r.close()


def test_natively_the_pair_keeps_the_device_busy(rig: ShareRig) -> None:
    """The baseline the hand-over is measured against: without cgpu the
    saturating tenant fills every gap, and the bursty one runs its bursts."""
    r = rig.run(scenario("preemptive"), native=True)
    shares = [round(t.share, 1) for t in r.tenants]
    assert r.utilisation >= 97, (r.utilisation, shares)
    assert 10 <= r.tenants[1].share <= 25, shares  # about 2 of every 12 ms


@pytest.mark.parametrize("policy", ["preemptive", "weighted", "fair"])
def test_an_idle_holder_hands_the_gpu_over(rig: ShareRig, policy: str) -> None:
    runs: list[ScenarioResult] = []
    # The median of three is known once two runs agree on the side of the bound.
    while len(runs) < 3:
        runs.append(rig.run(scenario(policy)))
        over = sum(r.utilisation >= BUSY for r in runs)
        if over >= 2 or len(runs) - over >= 2:
            break
    seen = [(round(r.utilisation, 1), [round(t.share, 1) for t in r.tenants]) for r in runs]
    assert over >= 2, seen  # the median of three at or over the bound
    # The bursty tenant still gets its bursts through, not starved for the busy one.
    assert statistics.median(r.tenants[1].share for r in runs) >= 8, seen
    assert rig.daemon.cgpuctl("list", "--output", "json").stdout.strip() in ("[]", "")


@pytest.mark.parametrize("sync", ["streams", "events", "query", "none"])
def test_an_idle_holder_hands_over_however_it_waits_for_its_work(rig: ShareRig, sync: str) -> None:
    """Issue 39: tenants with the shares users ask for (30/70), the bursty
    one waiting for its bursts over two streams by stream synchronisation,
    events, cuStreamQuery polling, or not at all. None of these tells
    libcgpu that the whole queue is empty (74-79 % busy before); its fence
    watcher, asked by cgpud while the other tenant waits, learns it with a
    real synchronisation of its own."""
    bursty = TenantSpec(30, kernel_ns=300_000, streams=2, burst_ms=6, gap_ms=20, burst_sync=sync)
    sc = Scenario(
        f"bursty ({sync}) beside saturating, fair 30/70",
        "fair",
        (TenantSpec(70, kernel_ns=500_000, streams=2), bursty),
        SECONDS,
    )
    runs: list[ScenarioResult] = []
    while len(runs) < 3:
        runs.append(rig.run(sc))
        over = sum(r.utilisation >= BUSY for r in runs)
        if over >= 2 or len(runs) - over >= 2:
            break
    seen = [(round(r.utilisation, 1), [round(t.share, 1) for t in r.tenants]) for r in runs]
    assert over >= 2, seen
    assert statistics.median(r.tenants[1].share for r in runs) >= 8, seen


def graces_while_running(rig: MetricsRig, sc: Scenario, looks: int = 3) -> list[list[float]]:
    """Runs `sc` and reads every instance's idle grace (seconds) from cgpud's
    metrics `looks` times while it runs, once the tenants have been at it
    for a while."""
    seen: list[list[float]] = []

    def look() -> None:
        time.sleep(2.0)  # start-up, the first grants, a few hand-overs
        for _ in range(looks):
            seen.append([v for _, v in scrape(rig.metrics_port).get("cgpu_instance_idle_grace_seconds", [])])
            time.sleep(0.4)

    looker = threading.Thread(target=look)
    looker.start()
    try:
        rig.run(sc)
    finally:
        looker.join()
    return seen


def test_a_tenant_that_stays_idle_after_its_bursts_is_passed_over_at_once(rig: MetricsRig) -> None:
    """The grace is learned per instance (docs/compute.md): the bursty
    tenant never comes back to its gate within 100 us of losing the GPU, so
    it loses the grace; the saturating one is never idle and keeps it."""
    sc = Scenario("bursty beside saturating, longer", "preemptive", (SATURATING, BURSTY), 4.0)
    seen = graces_while_running(rig, sc)
    assert all(sorted(g) == [SHORT_GRACE_S, FULL_GRACE_S] for g in seen), seen


def test_a_tenant_that_synchronises_after_every_kernel_keeps_the_grace(rig: MetricsRig) -> None:
    """Back at its gate microseconds after each synchronisation: passed over
    at once there, it would lose the GPU a millisecond into each grant and
    wait out the other's slice every time. It keeps the full grace (a rare
    slow wake-up may cost it the grace for one hand-over, which it wins back
    at the next: hence the majority of looks)."""
    sc = Scenario("syncing beside saturating", "preemptive", (SYNCING, SATURATING), 4.0)
    seen = graces_while_running(rig, sc)
    assert sum(g == [FULL_GRACE_S, FULL_GRACE_S] for g in seen) >= 2, seen
