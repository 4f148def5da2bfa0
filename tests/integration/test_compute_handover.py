"""The GPU is handed over when its holder goes idle (issue 17): a tenant that
works in bursts (2 ms of queued kernels, a cuCtxSynchronize, 10 ms idle, as
an inference server does) beside a saturating one must not leave the device
idle for the rest of its slice after each burst. A real cgpud in core_mem
mode, `cgpuctl run` tenants, busy time from the simulated GPU's own
accounting (tests/sharerun.py). The bound, 90 % busy over 3 s, is loose for
a noisy 2-core CI machine, and it holds the median of three runs: each
hand-over waits on a process being woken, so a stretch of slow wake-ups on
a shared machine can cost one run a few points (89.8 % once in CI, against
95-96 % here) where a slow hand-over costs every run.
bench/bench_compute.py --bursty holds the real target (>= 95 % of the same
processes run natively)."""
from __future__ import annotations

import os
import statistics
from collections.abc import Iterator

import pytest

from tests.sharerun import Scenario, ScenarioResult, ShareRig, TenantSpec

SECONDS = 3.0
BUSY = 90.0  # percent of wall time the device computes
SATURATING = TenantSpec(0)  # 200 us kernels over 4 streams, never idle
BURSTY = TenantSpec(0, burst_ms=2, gap_ms=10)


def scenario(policy: str) -> Scenario:
    return Scenario(f"bursty beside saturating, {policy}", policy, (SATURATING, BURSTY), SECONDS)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShareRig]:
    r = ShareRig(tmp_path_factory.mktemp("handover"), dict(os.environ))
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
