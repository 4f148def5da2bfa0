"""Compute isolation when things go wrong, with a real cgpud in core_mem mode
and `cgpuctl run --core N -- cgpu-burn` tenants (libcgpu.so preloaded):
cgpud killed with SIGKILL while a tenant waits at its closed gate, cgpud
away for 10 s under load (issue 39: fixed shares hold without it), and a
kernel far longer than the fence timeout. Device time comes from the
simulated GPU's own per-process accounting."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cgpud._region import ffi, lib
from cgpud.native import native_path
from tests.harness.daemon import BIN
from tests.harness.freeze import freeze_with_gate_closed
from tests.harness.sharerun import Sampler, Scenario, ShareRig, TenantSpec, _at, _busy
from tests.harness.wait import until

OPEN = int(lib.CGPU_GATE_OPEN)


def _share(sampler: Sampler, pid: int, start_ns: int, end_ns: int) -> float:
    a, b = _at(sampler.samples, start_ns), _at(sampler.samples, end_ns)
    return 100.0 * (_busy(b, pid) - _busy(a, pid)) / (b[0] - a[0])


def _wait_samples_past(sampler: Sampler, t_ns: int, timeout: float = 30) -> None:
    until(
        lambda: sampler.samples and sampler.samples[-1][0] >= t_ns,
        timeout=timeout,
        interval=0.02,
        what=f"a GPU sample at {t_ns} ns or later",
        explain=lambda: f"the GPU sampler stopped; last sample at {[s[0] for s in sampler.samples[-1:]]} ns",
    )


def _gate_reader(pid: int) -> Callable[[], int]:
    """Slot 0's gate word in the grants file of the tenant process `pid`."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    region = next(v.split(b"=", 1)[1] for v in environ if v.startswith(b"CGPU_REGION_DIR=")).decode()
    with open(Path(region) / "grants", "rb") as f:
        m = mmap.mmap(f.fileno(), ffi.sizeof("struct cgpu_grants"), mmap.MAP_SHARED, mmap.PROT_READ)
    grants = ffi.from_buffer("struct cgpu_grants *", m)
    return lambda: int(grants.device[0].gate)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[ShareRig]:
    r = ShareRig(tmp_path, dict(os.environ))
    yield r
    if r.daemon.proc and r.daemon.proc.poll() is None:
        r.close()


def _stop(run: subprocess.Popen[bytes]) -> None:
    if run.poll() is None:
        run.send_signal(signal.SIGTERM)
    run.wait(timeout=60)


def test_a_tenant_at_a_closed_gate_keeps_its_share_when_cgpud_is_killed_and_is_gated_again_after_restart(
    rig: ShareRig,
) -> None:
    assert rig.daemon.cgpuctl("policy", "set", "fixed").returncode == 0
    run = rig._start(TenantSpec(30))
    sampler = Sampler(rig.env, 20)
    try:
        pid = rig._burn_pid(run, time.monotonic() + 60)
        rig._wait_running(sampler, [pid], time.monotonic() + 60)
        gate = _gate_reader(pid)
        assert rig.daemon.proc
        freeze_with_gate_closed(rig.daemon.proc.pid, gate)
        rig.daemon.kill()
        killed = time.monotonic_ns()
        assert not gate() & OPEN
        # Nobody opens that gate again, yet within the probe interval
        # (50 ms) the tenant launches again: in its own window of each
        # period, its share (all of the GPU before issue 39).
        _wait_samples_past(sampler, killed + 1_500_000_000)
        orphaned = _share(sampler, pid, killed + 500_000_000, killed + 1_500_000_000)
        assert 25 <= orphaned <= 35, orphaned
        assert not gate() & OPEN

        # A restarted cgpud takes the instance back and gates it again.
        rig.daemon.start()
        restarted = time.monotonic_ns()
        _wait_samples_past(sampler, restarted + 2_500_000_000)
        gated = _share(sampler, pid, restarted + 500_000_000, restarted + 2_500_000_000)
        assert 20 < gated < 40, gated
        assert run.poll() is None
    finally:
        _stop(run)
        sampler.stop()
    err = run.stderr.read().decode() if run.stderr else ""
    assert err.count("compute scheduler (cgpud) is gone") == 1, err


LONG = TenantSpec(30, kernel_ns=200_000_000, streams=1)


def test_a_200ms_kernel_under_a_30_percent_share_is_charged_in_full(rig: ShareRig) -> None:
    """Each 200 ms kernel outlives the 50 ms fence timeout fourfold: the
    tenant is charged until its fence really comes, so it keeps to 30 %
    over time instead of running a kernel each time it is granted."""
    assert rig.daemon.cgpuctl("policy", "set", "fixed").returncode == 0
    run = rig._start(LONG)
    sampler = Sampler(rig.env, 50)
    try:
        pid = rig._burn_pid(run, time.monotonic() + 60)
        rig._wait_running(sampler, [pid], time.monotonic() + 60)
        start = time.monotonic_ns() + 1_000_000_000
        _wait_samples_past(sampler, start + 6_000_000_000, timeout=60)
        share = _share(sampler, pid, start, start + 6_000_000_000)
    finally:
        _stop(run)
        sampler.stop()
    # 6 s hold 30 kernels' time; at 30 % nine of them run, give or take the
    # one in progress at each end of the interval.
    assert 20 <= share <= 37, share


@pytest.mark.parametrize(
    ("policy", "tenants", "long_range", "neighbour_min"),
    [
        ("fixed", (LONG, TenantSpec(70)), (20, 37), 45),
        ("soft", (LONG, TenantSpec(70)), (20, 37), 60),
        ("preemptive", (TenantSpec(0, kernel_ns=200_000_000, streams=1), TenantSpec(0)), (40, 60), 40),
    ],
    ids=["fixed 30/70", "soft 30/70", "preemptive"],
)
def test_a_neighbour_of_200ms_kernels_keeps_its_share(
    rig: ShareRig, policy: str, tenants: tuple[TenantSpec, ...], long_range: tuple[float, float], neighbour_min: float
) -> None:
    """While the long kernel runs, nobody else is granted (a grant would be
    charged for time the neighbour cannot use), and the long kernel's
    tenant pays it back in full. Fixed leaves the neighbour short of its
    70 %: the reservation its periods lost to the kernel is not made up."""
    r = rig.run(Scenario(policy, policy, tenants, 6.0, (50, 50) if policy == "preemptive" else ()))
    long, neighbour = (round(t.share, 1) for t in r.tenants)
    assert long_range[0] <= long <= long_range[1], (long, neighbour)
    assert neighbour >= neighbour_min, (long, neighbour)


@contextmanager
def _cpu_hogs(n: int) -> Iterator[None]:
    """n processes that spin on the CPU until the block ends."""
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


@pytest.mark.timing  # it loads every core: the parallel pass's other tests would feel it
def test_a_neighbour_starved_of_cpu_keeps_its_share_beside_200ms_kernels_under_soft(rig: ShareRig) -> None:
    """With the CPU loaded three times over (as a tenant that also spins on
    the CPU loads it), the neighbour's threads come back to its gate late
    after each of its synchronisations. Each such gap handed the tenant that
    owed for its 200 ms kernels its next one, and wiped the neighbour's
    credit: 51-68 % instead of 30. The GPU now waits up to a slice for a
    neighbour that has just gone quiet before it lends to a debtor."""
    with _cpu_hogs(3 * (os.cpu_count() or 1)):
        r = rig.run(Scenario("soft", "soft", (LONG, TenantSpec(70)), 6.0, ()))
    long, neighbour = (round(t.share, 1) for t in r.tenants)
    assert 20 <= long <= 37, (long, neighbour)
    assert neighbour >= 50, (long, neighbour)


@pytest.mark.timing  # measures shares
def test_a_tenant_of_200ms_kernels_beside_short_bursts_under_soft_is_not_held_off_an_idle_gpu(rig: ShareRig) -> None:
    """The neighbour works 1 ms in every 9: each of its gaps is short, so
    the tenant that owes for its 200 ms kernels would wait in every one,
    and waiting repays nothing. Unbounded, that held it to 7-9 % with the
    GPU 17-19 % busy; the GPU idles for debtors at most a slice a period."""
    bursty = TenantSpec(70, kernel_ns=100_000, streams=1, burst_ms=1, gap_ms=8)
    r = rig.run(Scenario("soft", "soft", (LONG, bursty), 6.0, ()))
    long, neighbour = (round(t.share, 1) for t in r.tenants)
    assert long >= 80 and r.utilisation >= 85, (long, neighbour, r.utilisation)


AWAY_S = 10.0
# How long one launch may wait as cgpud goes away: a thread at the closed
# gate has waited up to a period (100 ms) for its grant already, finds
# cgpud gone within its 50 ms probe, then waits at most for its own window
# (under a period) and its queue's drain, plus a late wake-up on a loaded
# machine. The 30 % tenant's longest: 74-186 ms in twelve runs, 274 once in CI.
AWAY_STALL_BOUND_MS = 300.0


def _timed_tenant(rig: ShareRig, core: int, seconds: float) -> subprocess.Popen[bytes]:
    """A saturating tenant that ends by itself and prints its report
    (max_launch_ms: its longest launch call)."""
    burn = [str(native_path("bin/cgpu-burn")), "--duration", f"{seconds:g}", "--kernel-ns", "200000", "--streams", "4"]
    cmd = [str(BIN / "cgpuctl"), "--socket", str(rig.daemon.socket), "run", "--mem", "512MiB", "--core", str(core)]
    return subprocess.Popen([*cmd, "--", *burn], env=rig.daemon.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.timing  # with the CPU loaded 3x over, 27/64 (each tenant paces itself, and late)
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_fixed_shares_hold_while_cgpud_is_away_for_10_s(rig: ShareRig, how: str) -> None:
    """Issue 39: under `fixed`, 30/70 tenants keep their shares within 5
    points while cgpud is down for 10 s, killed or stopped (99.8 % for the
    30 % tenant before: fail open), and no launch waits past the bound.
    Each paces itself to the window cgpud tiled for it while it ran."""
    assert rig.daemon.cgpuctl("policy", "set", "fixed").returncode == 0
    runs = [_timed_tenant(rig, core, 16.0) for core in (30, 70)]
    sampler = Sampler(rig.env, 20)
    try:
        pids = [rig._burn_pid(run, time.monotonic() + 60) for run in runs]
        rig._wait_running(sampler, pids, time.monotonic() + 60)
        time.sleep(2.0)
        before = time.monotonic_ns()
        if how == "SIGKILL":
            rig.daemon.kill()
        else:
            rig.daemon.stop()
        away = time.monotonic_ns()
        time.sleep(AWAY_S)
        back = time.monotonic_ns()
        rig.daemon.start()
        _wait_samples_past(sampler, back)
        shares = [_share(sampler, pid, away + 500_000_000, back) for pid in pids]
        held = [_share(sampler, pid, before - 1_500_000_000, before) for pid in pids]
        print(f"cgpud {how}: shares {held} with it, {shares} over {AWAY_S:g} s without it")
        reports = []
        for r in runs:
            out, err = r.communicate(timeout=60)
            assert r.returncode == 0, err
            reports.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for r in runs:
            _stop(r)
        sampler.stop()
    assert abs(shares[0] - 30) <= 5 and abs(shares[1] - 70) <= 5, shares
    stalls = [rep["max_launch_ms"] for rep in reports]
    print(f"cgpud {how}: longest launch call {stalls} ms (30 %, 70 %)")
    assert max(stalls) < AWAY_STALL_BOUND_MS, stalls
    assert all(not rep["errors"] for rep in reports), reports
