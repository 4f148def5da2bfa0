"""cgpud restarted under load: 20 tenants on two simulated GPUs keep
allocating and launching while cgpud is killed (SIGKILL) or stopped
(SIGTERM) ten times, then replaced by a newer build (tests/harness/restart_build.py).

Ten tenants are memory-only (1 GiB: each round fills the limit and asks past
it, tests/harness/restart_tenant.py), ten have 1 GiB and a compute share under the
fixed policy, five per GPU (spread placement): one at 20 % that queues four
streams of kernels and could take far more, four at 15 % that launch and
synchronise one kernel at a time. That reserves 80 % of each GPU; the
memory-only tenants' short kernels run in the rest (under fixed they share
what is not reserved). GPU 0's queueing tenant is the one whose share is
measured, from the simulator's own accounting (cgpu-sim-stat --sample).

The contract (docs/operations.md, "Restarts and upgrades"): no allocation or
launch fails; no limit is lost (every round past the limit is refused, the
same instances with the same grants after every start); no launch waits
longer than STALL_BOUND_S; the share is back within SHARE_TOLERANCE points
over a 200 ms window within 1 s of the new cgpud's READY=1; a tenant started
after the upgrade gets the newer build's runtime files."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cgpud.cli.client import LocalClient
from cgpud.cli.run import instance_environment
from cgpud.node.model import ComputePolicy, Instance, Owner, OwnerKind, Request
from tests.harness.daemon import Daemon, make_daemon
from tests.harness.restart_build import ROOT, Build, newer_build
from tests.harness.sharerun import Sampler, _at, _busy
from tests.harness.wait import until

# Bounds how long a tenant's sync may stall across cgpud restarts (timing); takes a minute (slow).
pytestmark = [pytest.mark.timing, pytest.mark.slow]

GIB = 1 << 30
MS = 1_000_000
SECOND = 1_000_000_000
CORE = 20  # the measured tenant's share
SYNC_CORE = 15
# Documented in docs/operations.md. A launch with a share waits for its
# grant as always (up to ~150 ms at 15 % under fixed), and when cgpud is
# killed at most one more probe (50 ms); the rest is slack for 20 tenants
# on two shared cores.
STALL_BOUND_S = 1.0
# A memory-only instance under fixed waits for the unreserved pool: up to
# 0.34 s a launch here without any restart; the re-ask bounds it at 1.4 s.
POOL_STALL_BOUND_S = 1.4
# Allocation never talks to cgpud: only CPU contention shows.
ALLOC_BOUND_S = 0.25
RECOVERY_BOUND_S = 1.0
SHARE_TOLERANCE = 5.0  # percentage points, over a 200 ms window
WINDOW = 200 * MS
SAMPLE_MS = 20
# (signal, downtime in s): killed ones stay down long enough to show the share held without cgpud.
RESTARTS = [
    (signal.SIGKILL, 0.8),
    (signal.SIGTERM, 0.3),
    (signal.SIGKILL, 0.6),
    (signal.SIGTERM, 0.2),
    (signal.SIGKILL, 1.0),
    (signal.SIGTERM, 0.5),
    (signal.SIGKILL, 0.7),
    (signal.SIGTERM, 0.1),
    (signal.SIGKILL, 0.9),
    (signal.SIGTERM, 0.4),
]


@dataclass
class Tenant:
    name: str
    mode: str
    instance: Instance
    proc: subprocess.Popen[str]
    counts: dict[str, object] = field(default_factory=dict)


@dataclass
class Restart:
    how: str
    down_ns: int  # the signal was sent
    start_ns: int  # the new cgpud was started
    ready_ns: int  # its READY=1 arrived
    recovery_s: float | None = None
    open_share: float | None = None  # measured tenant, while cgpud was down


@pytest.fixture(scope="module")
def newer(tmp_path_factory: pytest.TempPathFactory) -> Build:
    t0 = time.monotonic()
    build = newer_build(tmp_path_factory.mktemp("newer") / "cgpu")
    print(f"\nnewer build {build.version} made in {time.monotonic() - t0:.1f} s")
    return build


def _adopted(client: LocalClient) -> dict[str, tuple[object, ...]]:
    """What must not change across a restart: every instance's owner,
    grants, state and PIDs, its region directory and grants file (the
    same inode: the one its processes have mapped)."""
    out: dict[str, tuple[object, ...]] = {}
    for i in client.list():
        region = client.region_dir(i.id)
        assert region is not None
        out[i.id] = (i.owner, i.grants, i.state, i.pids, region, (region / "grants").stat().st_ino)
    return out


def _launch(
    client: LocalClient,
    name: str,
    mode: str,
    instance: Instance,
    base_env: dict[str, str],
    preload: str | None,
    args: tuple[str, ...],
) -> Tenant:
    region = client.region_dir(instance.id)
    assert region is not None
    gpu_memory = {g.gpu.index: g.gpu.memory for g in client.node_info().gpus}
    env = instance_environment(instance, region, gpu_memory, base_env)
    if preload:
        env["LD_PRELOAD"] = preload
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.harness.restart_tenant", mode, *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Tenant(name, mode, instance, proc)


def _spawn(client: LocalClient, name: str, mode: str, core: int, base_env: dict[str, str], *args: str) -> Tenant:
    """A process instance as `cgpuctl run` makes one, bound to the tenant."""
    instance = client.create(Request(Owner(OwnerKind.PROCESS, f"restart-{name}"), GIB, 1, core), pid=os.getpid())
    t = _launch(client, name, mode, instance, base_env, None, args)
    t.instance = client.bind(instance.id, (os.getpid(), t.proc.pid))
    return t


def _wait_ready(t: Tenant) -> None:
    assert t.proc.stdout is not None
    ready, _, _ = select.select([t.proc.stdout], [], [], 30)
    assert ready, f"{t.name} did not start"
    line = t.proc.stdout.readline()
    assert line == "ready\n", f"{t.name}: {line!r} {t.proc.stderr.read() if t.proc.stderr else ''}"


def _finish(t: Tenant) -> None:
    t.proc.send_signal(signal.SIGTERM)
    out, err = t.proc.communicate(timeout=20)
    assert t.proc.returncode == 0, f"{t.name} exited with {t.proc.returncode}: {err[-3000:]}"
    t.counts = json.loads(out.strip().splitlines()[-1])


def _share(samples: list[tuple[int, int, dict[int, int]]], pid: int, lo: int, hi: int) -> float:
    a, b = _at(samples, lo), _at(samples, hi)
    return 100.0 * (_busy(b, pid) - _busy(a, pid)) / max(1, b[0] - a[0])


def _recovery(samples: list[tuple[int, int, dict[int, int]]], pid: int, ready_ns: int, target: float) -> float | None:
    """Seconds from READY=1 to the first 200 ms window whose share, and the
    next window's, are within SHARE_TOLERANCE of the target."""

    def ok(lo: int) -> bool:
        return abs(_share(samples, pid, lo, lo + WINDOW) - target) <= SHARE_TOLERANCE

    t = ready_ns
    while t + 2 * WINDOW <= samples[-1][0]:
        if ok(t) and ok(t + WINDOW):
            return (t - ready_ns) / SECOND
        t += SAMPLE_MS * MS
    return None


def _wait_samples_past(sampler: Sampler, t_ns: int) -> None:
    until(
        lambda: sampler.samples and sampler.samples[-1][0] >= t_ns,
        timeout=30,
        interval=0.02,
        what=f"a GPU sample at {t_ns} ns or later",
        explain=lambda: f"the GPU sampler stopped; last sample at {[s[0] for s in sampler.samples[-1:]]} ns",
    )


def _stop_daemon(d: Daemon, how: signal.Signals) -> None:
    assert d.proc is not None
    if how is signal.SIGKILL:
        d.kill()
    else:
        d.stop()


@pytest.fixture
def daemon(tmp_path: Path, sim_env: dict[str, str]) -> Iterator[Daemon]:
    d = make_daemon(tmp_path, sim_env, "--mode", "core_mem", "--placement", "spread", "--sweep-interval", "1")
    d.start()
    yield d
    if d.proc and d.proc.poll() is None:
        d.stop()


def test_twenty_tenants_keep_their_limits_and_shares_through_ten_restarts_and_an_upgrade(
    daemon: Daemon, newer: Build, sim_env: dict[str, str]
) -> None:
    d = daemon
    base_env = dict(sim_env, PYTHONPATH=str(ROOT))
    tenants: list[Tenant] = []
    late: Tenant | None = None
    sampler: Sampler | None = None
    restarts: list[Restart] = []
    try:
        with LocalClient(d.socket) as client:
            client.set_compute_policy(ComputePolicy.FIXED)
            # Spread placement alternates GPUs: queue0 and the even ones on GPU 0.
            for gpu in range(2):
                tenants.append(
                    _spawn(client, f"queue{gpu}", "compute", CORE, base_env, "--streams", "4", "--sync-every", "16")
                )
            tenants += [_spawn(client, f"sync{i}", "compute", SYNC_CORE, base_env) for i in range(8)]
            tenants += [_spawn(client, f"mem{i}", "mem", 0, base_env, "--kernel-ns", "100000") for i in range(10)]
            before = _adopted(client)
        for t in tenants:
            _wait_ready(t)
        measured = tenants[0]
        assert measured.instance.grants[0].gpu_index == 0
        assert tenants[1].instance.grants[0].gpu_index == 1
        assert sorted(t.instance.grants[0].gpu_index for t in tenants[:10]) == [0] * 5 + [1] * 5
        pid = measured.proc.pid
        sampler = Sampler(d.env, SAMPLE_MS)
        time.sleep(1.5)
        t0 = time.monotonic_ns()
        time.sleep(1.0)
        baseline = _share(sampler.samples, pid, t0, time.monotonic_ns())

        plan = [(how, down, None) for how, down in RESTARTS] + [(signal.SIGTERM, 0.3, newer)]
        for how, down, build in plan:
            down_ns = time.monotonic_ns()
            _stop_daemon(d, how)
            time.sleep(down)
            if build is not None:
                d.env = build.env(d.env)
            start_ns = time.monotonic_ns()
            d.start()
            ready_ns = time.monotonic_ns()
            label = "upgrade" if build else how.name
            restarts.append(Restart(label, down_ns, start_ns, ready_ns))
            with LocalClient(d.socket) as client:
                after = _adopted(client)
            assert after == before, f"after {label}: instances changed"
            _wait_samples_past(sampler, ready_ns + RECOVERY_BOUND_S * SECOND + 2 * WINDOW)

        # A tenant started after the upgrade gets the newer build's runtime
        # files, as a container would from the CDI spec, and is limited.
        with LocalClient(d.socket) as client:
            device = client.create(Request(Owner(OwnerKind.DEVICE, "restart-late"), GIB), pid=None)
            spec = json.loads(client.cdi_spec())
        edits = next(x for x in spec["devices"] if x["name"] == device.id)["containerEdits"]
        lib = next(Path(m["hostPath"]) for m in edits["mounts"] if m["hostPath"].endswith("libcgpu.so"))
        hook = Path(edits["hooks"][0]["path"])
        assert lib.read_bytes() == newer.native("lib/libcgpu.so").read_bytes()
        assert hook.read_bytes() == newer.native("bin/cgpu-hook").read_bytes()
        assert newer.version.encode() in hook.read_bytes()
        with LocalClient(d.socket) as client:
            late = _launch(client, "late", "mem", device, base_env, str(lib), ("--kernel-ns", "100000"))
        _wait_ready(late)
        time.sleep(1.0)
        _finish(late)
        with LocalClient(d.socket) as client:
            client.release(device.id)
    finally:
        for t in tenants + ([late] if late else []):
            if t.proc.poll() is None and not t.counts:
                try:
                    _finish(t)
                except (AssertionError, ValueError, subprocess.TimeoutExpired):
                    t.proc.kill()
        if sampler is not None:
            sampler.stop()
    assert late is not None and sampler is not None
    listed = d.cgpuctl("list")
    assert listed.returncode == 0, listed.stderr
    assert all(t.instance.id in listed.stdout for t in tenants), listed.stdout
    with LocalClient(d.socket) as client:
        for t in tenants:
            client.release(t.instance.id)

    samples = sampler.samples
    for r in restarts:
        r.recovery_s = _recovery(samples, pid, r.ready_ns, CORE)
        if r.how == "SIGKILL":
            r.open_share = _share(samples, pid, r.down_ns + 300 * MS, r.start_ns)

    def worst(key: str, mode: str) -> tuple[float, str]:
        return max((int(t.counts[key]) / SECOND, t.name) for t in tenants + [late] if t.mode == mode)

    stall, stall_at = worst("worst_launch_gap_ns", "compute")
    pool_stall, pool_at = worst("worst_launch_gap_ns", "mem")
    alloc, alloc_at = worst("worst_alloc_call_ns", "mem")
    recoveries = [r.recovery_s for r in restarts]
    print(
        f"\nrestart under load: 20 tenants, 10 restarts and an upgrade; baseline share {baseline:.1f} % "
        f"(fixed {CORE} %)\n  worst launch stall {stall * 1000:.0f} ms ({stall_at}; memory-only, from the "
        f"unreserved pool: {pool_stall * 1000:.0f} ms, {pool_at}); worst allocation call {alloc * 1000:.1f} ms"
    )
    stalled = next(t for t in tenants if t.name == stall_at)
    at = int(stalled.counts["worst_launch_gap_at_ns"])
    near = min(restarts, key=lambda r: abs(at - r.down_ns))
    print(
        f"  the worst stall ended {(at - near.down_ns) / MS:+.0f} ms from a {near.how} "
        f"(READY at {(near.ready_ns - near.down_ns) / MS:+.0f} ms)"
    )
    for r in restarts:
        rec = "never" if r.recovery_s is None else f"{r.recovery_s * 1000:.0f} ms"
        extra = f", share while down {r.open_share:.0f} %" if r.open_share is not None else ""
        print(
            f"  {r.how:8} start to READY {(r.ready_ns - r.start_ns) / MS:4.0f} ms, share back {rec} after READY{extra}"
        )

    for t in tenants + [late]:
        c = t.counts
        assert c["launch_errors"] == 0 and c["alloc_errors"] == 0, (t.name, c["errors"])
        assert c["past_limit_granted"] == 0, (t.name, c["errors"])
        if t.mode == "mem":
            assert c["total"] == GIB, (t.name, c["total"])
            assert int(c["rounds"]) > (2 if t is late else 100), (t.name, c["rounds"])
        else:
            assert int(c["launches"]) > 1000, (t.name, c["launches"])
    assert abs(baseline - CORE) <= SHARE_TOLERANCE, baseline
    assert stall < STALL_BOUND_S, (stall, stall_at)
    assert pool_stall < POOL_STALL_BOUND_S, (pool_stall, pool_at)
    assert alloc < ALLOC_BOUND_S, (alloc, alloc_at)
    assert all(r is not None and r < RECOVERY_BOUND_S for r in recoveries), recoveries
    # cgpud killed: under fixed each tenant paces itself to its own window
    # (issue 39), so the queueing tenant keeps its share (it took 60-74 %
    # when the gates failed open).
    assert all(
        r.open_share is not None and abs(r.open_share - CORE) <= SHARE_TOLERANCE for r in restarts if r.how == "SIGKILL"
    ), [r.open_share for r in restarts]
