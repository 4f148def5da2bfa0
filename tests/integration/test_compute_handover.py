"""The GPU is handed over when its holder goes idle (issue 17): a tenant that
works in bursts (2 ms of queued kernels, a cuCtxSynchronize, 10 ms idle, as
an inference server does) beside a saturating one must not leave the device
idle for the rest of its slice after each burst. A real cgpud in core_mem
mode, `cgpuctl run` tenants, busy time from the simulated GPU's own
accounting (tests/sharerun.py). The bound, 90 % busy over 3 s, is loose for
a noisy 2-core CI machine; bench/bench_compute.py --bursty holds the real
target (>= 95 % of the same processes run natively)."""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.sharerun import Scenario, ShareRig, TenantSpec

SECONDS = 3.0
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
    r = rig.run(scenario(policy))
    shares = [round(t.share, 1) for t in r.tenants]
    assert r.utilisation >= 90, (r.utilisation, shares)
    # The bursty tenant still gets its bursts through, not starved for the busy one.
    assert r.tenants[1].share >= 8, shares
    assert rig.daemon.cgpuctl("list", "--output", "json").stdout.strip() in ("[]", "")
