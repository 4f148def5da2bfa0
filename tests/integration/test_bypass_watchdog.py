"""The bypass watchdog end to end: a real cgpud (`--bypass-interval 0.2`)
on one simulated 16 GiB GPU, hostile tenants under `cgpuctl run --mem 1`
that go around libcgpu (an ELF-walking one, a static one, a musl one with
LD_PRELOAD dropped: tests/harness/bypass_build.py) and allocate 4 x 1 GiB, beside a
well-behaved neighbour (`cgpuctl run --mem 2 -- cgpu-burn` holding its
2 GiB through libcgpu).

Report mode reports each within 2 intervals of the allocation that took it
past its limit plus the slack (the tenant's CLOCK_REALTIME stamp against
the event's), and leaves it running; kill mode kills it within 2 intervals
and NVML shows its memory back; the neighbour is untouched either way. A
process of no instance is reported, never killed; an allow-listed one is
not reported. A tenant whose kernels skip the compute gate is reported over
its fixed share; a gated one with the same share is not."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cgpud.native import native_path
from tests.harness.bypass_watch import GIB, INTERVAL, Nvml, Tenant, bypass_command, bypass_events, bypass_listing
from tests.harness.bypass_watch import neighbour_command, run_plain, run_tenant, violations, wait_dead, wait_events
from tests.harness.bypass_watch import watch_flags
from tests.harness.sim import write_sim_config
from tests.harness.daemon import Daemon, running_daemon

pytestmark = pytest.mark.timing  # measures how soon a bypass is seen and killed

KINDS = ("elf", "static", "musl")
# What the test process may add to a measured death: it sees the pidfd turn
# readable when the scheduler next runs it (2 cores shared with cgpud, the
# tenants and the NVML probe).
OBSERVE = 0.1


@pytest.fixture
def gpu_env(tmp_path: Path, native: Path) -> dict[str, str]:
    """One simulated 16 GiB GPU: tenant and neighbour share it."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["LD_LIBRARY_PATH"] = str(native / "sim")
    env["CGPU_SIM_CONFIG"] = str(write_sim_config(tmp_path / "sim.conf", gpus=1))
    env["CGPU_SIM_STATE"] = str(tmp_path / "sim.state")
    return env


@pytest.fixture
def nvml(gpu_env: dict[str, str]) -> Iterator[Nvml]:
    probe = Nvml(gpu_env)
    yield probe
    probe.close()


def start_neighbour(d: Daemon, nvml: Nvml, where: Path) -> tuple[Tenant, int]:
    """The neighbour, once NVML shows its 2 GiB; and NVML's used memory then."""
    neighbour = run_tenant(d, "2", neighbour_command(2 * GIB), where)
    nvml.wait(lambda v: v["procs"].get(neighbour.pid) == 2 * GIB, 30, "the neighbour's 2 GiB")
    return neighbour, nvml.query()["used"]


def assert_untouched(d: Daemon, neighbour: Tenant, nvml: Nvml) -> None:
    assert neighbour.alive(), neighbour.errors()
    assert nvml.query()["procs"].get(neighbour.pid) == 2 * GIB
    assert not [e for e in bypass_events(d) if e["instance_id"] == neighbour.instance_id]


@contextmanager
def bypass_beside_a_neighbour(
    tmp_path: Path, gpu_env: dict[str, str], nvml: Nvml, mode: str, kind: str
) -> Iterator[tuple[Daemon, Tenant, int, Tenant, float]]:
    """cgpud watching in `mode`, the 2 GiB neighbour running, then a 1 GiB
    tenant that bypasses libcgpu by `kind`, until it crosses its limit.
    Yields cgpud, the neighbour, NVML's used memory with the neighbour
    alone, the tenant and when it crossed; both tenants are stopped however
    the test ends."""
    with running_daemon(tmp_path, gpu_env, *watch_flags(mode)) as d:
        neighbour, baseline = start_neighbour(d, nvml, tmp_path)
        tenant = run_tenant(d, "1", bypass_command(kind), tmp_path)
        try:
            yield d, neighbour, baseline, tenant, tenant.crossing(GIB)
        finally:
            tenant.stop()
            neighbour.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_report_mode_reports_a_bypass_within_two_intervals(
    kind: str, tmp_path: Path, gpu_env: dict[str, str], nvml: Nvml
) -> None:
    with bypass_beside_a_neighbour(tmp_path, gpu_env, nvml, "report", kind) as (d, neighbour, _, tenant, crossed):
        [event] = wait_events(d, lambda e: e["instance_id"] == tenant.instance_id, 10, "event for the tenant")
        assert event["kind"] == "memory_over_limit" and event["action"] == "reported", event
        assert tenant.pid in event["pids"] and event["limit_bytes"] == GIB and event["used_bytes"] > 1.5 * GIB
        assert event["time"] - crossed <= 2 * INTERVAL, (event["time"] - crossed, event)
        print(f"{kind}: reported {(event['time'] - crossed) * 1e3:.0f} ms after the crossing allocation")
        tenant.out.wait(lambda o: o.get("event") == "allocated" and o["total_bytes"] == 4 * GIB, 10, "the 4th GiB")
        # Rounds later: still running with its 4 GiB, reported once (again only after 60 s).
        time.sleep(5 * INTERVAL)
        assert tenant.alive(), tenant.errors()
        assert nvml.query()["procs"].get(tenant.pid) == 4 * GIB
        listing = bypass_listing(d)
        assert listing["watching"] is True, listing
        assert [e["instance_id"] for e in listing["events"]] == [tenant.instance_id], listing
        assert violations(d) == {tenant.instance_id: 1, neighbour.instance_id: 0}  # cgpuctl list
        assert_untouched(d, neighbour, nvml)


@pytest.mark.parametrize("kind", KINDS)
def test_kill_mode_kills_a_bypass_within_two_intervals_and_the_memory_returns(
    kind: str, tmp_path: Path, gpu_env: dict[str, str], nvml: Nvml
) -> None:
    with bypass_beside_a_neighbour(tmp_path, gpu_env, nvml, "kill", kind) as (d, neighbour, baseline, tenant, crossed):
        dead = wait_dead(tenant.pid, 10)
        assert dead is not None, f"tenant {tenant.pid} still runs 10 s after crossing its limit"
        assert dead - crossed <= 2 * INTERVAL + OBSERVE, dead - crossed
        [event] = wait_events(d, lambda e: e["instance_id"] == tenant.instance_id, 10, "the kill's event")
        print(
            f"{kind}: killed at {(event['time'] - crossed) * 1e3:.0f} ms, seen dead at "
            f"{(dead - crossed) * 1e3:.0f} ms after the crossing allocation"
        )
        assert event["kind"] == "memory_over_limit" and event["action"] == "killed", event
        assert event["killed"] == [tenant.pid] and event["time"] - crossed <= 2 * INTERVAL, event
        # cgpuctl run sees its child killed, and releases the instance.
        assert tenant.proc.wait(timeout=30) == 128 + 9
        view = nvml.wait(lambda v: v["used"] == baseline, 2, f"used memory back to {baseline}")
        assert tenant.pid not in view["procs"]
        listed = d.cgpuctl("list", "--output", "json")
        assert tenant.instance_id not in listed.stdout
        assert_untouched(d, neighbour, nvml)
        assert [e["instance_id"] for e in bypass_events(d)] == [tenant.instance_id]


def test_an_unknown_process_is_reported_not_killed_and_an_allowed_one_is_left_alone(
    tmp_path: Path, gpu_env: dict[str, str], nvml: Nvml
) -> None:
    """Kill mode: a GPU process of no instance (the bypass tool with no
    cgpuctl at all) is reported as unknown_process and keeps running; the
    same tool at an allow-listed path is not reported."""
    from tests.harness import bypass_build

    allowed_exe = tmp_path / "allowed" / "cgpu-bypass"
    allowed_exe.parent.mkdir()
    shutil.copy2(bypass_build.elf_bypass(), allowed_exe)
    hold = ["--resolve", "elf", "--alloc-mib", "256", "--count", "1", "--hold", "600"]
    with running_daemon(tmp_path, gpu_env, *watch_flags("kill", INTERVAL, "--bypass-allow", f"exe:{allowed_exe}")) as d:
        allowed = run_plain(gpu_env, [str(allowed_exe), *hold], tmp_path)
        unknown = run_plain(gpu_env, [str(bypass_build.elf_bypass()), *hold], tmp_path)
        try:
            allocated = [
                float(t.out.wait(lambda o: o.get("event") == "allocated", 10, "an allocation")["time"])
                for t in (allowed, unknown)
            ]
            [event] = wait_events(d, lambda e: e["kind"] == "unknown_process", 10, "an unknown_process event")
            assert event["pids"] == [unknown.pid] and event["instance_id"] == "", event
            assert event["action"] == "reported" and event["killed"] == [], event
            assert event["time"] - max(allocated) <= 2 * INTERVAL, event["time"] - max(allocated)
            time.sleep(5 * INTERVAL)
            assert unknown.alive() and allowed.alive()
            assert nvml.query()["procs"].get(unknown.pid) == 256 << 20
            assert [e["pids"] for e in bypass_events(d)] == [[unknown.pid]]
        finally:
            allowed.stop()
            unknown.stop()


@pytest.mark.parametrize("windows", [False, True], ids=["slices", "fixed_windows"])
def test_ungated_kernels_over_a_fixed_share_are_reported_and_gated_ones_are_not(
    tmp_path: Path, gpu_env: dict[str, str], nvml: Nvml, windows: bool
) -> None:
    """core_mem, policy fixed, two tenants of 20 % on one GPU running 1 ms
    kernels back to back: one with LD_PRELOAD removed (no gate), one through
    libcgpu. Only the first is over its share plus 20 points. With
    fixed_windows the engine charges nothing, and the tenant that skips its
    window is found the same way."""
    window = 2.0
    burn = [str(native_path("bin/cgpu-burn")), "--duration", "60", "--kernel-ns", "1000000"]
    with running_daemon(
        tmp_path,
        gpu_env,
        "--mode",
        "core_mem",
        "--compute-policy",
        "3",
        *(("--fixed-windows",) if windows else ()),
        *watch_flags("report", INTERVAL, "--bypass-compute-window", str(window)),
    ) as d:
        gated = run_tenant(d, "1", burn, tmp_path, core=20)
        ungated = run_tenant(d, "1", ["env", "-u", "LD_PRELOAD", *burn], tmp_path, core=20)
        try:
            nvml.wait(lambda v: ungated.pid in v["procs"] and gated.pid in v["procs"], 10, "both tenants' contexts")
            started = time.time()
            [event] = wait_events(
                d, lambda e: e["kind"] == "compute_over_share", window + 10, "a compute_over_share event"
            )
            assert event["instance_id"] == ungated.instance_id and event["pids"] == [ungated.pid], event
            assert event["time"] - started <= window + 2 * INTERVAL, event["time"] - started
            print(
                f"compute: reported {event['time'] - started:.2f} s after both ran, measured "
                f"{event['measured_percent']:.0f} % of a 20 % share"
            )
            assert event["measured_percent"] > 20 + 20 and event["allowed_percent"] == 20, event
            # A full window and more later, the gated tenant (at its share) is still not reported.
            time.sleep(max(0.0, started + window + 3 * INTERVAL - time.time()))
            assert gated.alive() and ungated.alive()
            assert {e["instance_id"] for e in bypass_events(d)} == {ungated.instance_id}
        finally:
            gated.stop()
            ungated.stop()


def test_forking_for_more_slack_gains_nothing(tmp_path: Path, gpu_env: dict[str, str], nvml: Nvml) -> None:
    """The slack is per process: a tenant that forks eight bypassing
    processes of 500 MiB each (3.9 GiB in a 1 GiB instance, under 1 GiB +
    8 x 512 MiB) gets the slack of four at most: once seven or eight hold
    their 500 MiB the round kills them (one left alone is within its limit)."""
    from tests.harness import bypass_build

    tool = f"{bypass_build.elf_bypass()} --resolve elf --alloc-mib 500 --count 1 --hold 600"
    script = f"for i in 1 2 3 4 5 6 7 8; do {tool} > /dev/null & done; wait"
    with running_daemon(tmp_path, gpu_env, *watch_flags("kill")) as d:
        tenant = run_tenant(d, "1", ["sh", "-c", script], tmp_path)
        try:
            event = wait_events(d, lambda e: e["instance_id"] == tenant.instance_id, 20, "the forked tenant's event")[0]
            assert event["kind"] == "memory_over_limit" and event["action"] == "killed", event
            assert event["used_bytes"] > GIB + 4 * 512 * 2**20, event  # past four slacks, under eight
            killed = event["killed"]
            assert len(killed) >= 7 and killed == event["pids"], event
            nvml.wait(lambda v: not set(v["procs"]) & set(killed), 5, "the forked processes' memory back")
        finally:
            tenant.stop()


def test_an_executable_name_that_is_not_utf8_is_reported_and_breaks_no_listing(
    tmp_path: Path, gpu_env: dict[str, str]
) -> None:
    """A process of no instance whose executable's name holds a byte that
    is not UTF-8 (0xff): the event carries the name as \\xff, and cgpuctl
    events, list and inspect still answer (a protobuf string refuses lone
    surrogates, which is what Python would make of that byte)."""
    from tests.harness import bypass_build

    odd = Path(os.fsdecode(bytes(tmp_path) + b"/gpu\xff-tool"))
    shutil.copy2(bypass_build.elf_bypass(), odd)
    with running_daemon(tmp_path, gpu_env, *watch_flags("report")) as d:
        tenant = run_plain(
            gpu_env, [str(odd), "--resolve", "elf", "--alloc-mib", "256", "--count", "1", "--hold", "600"], tmp_path
        )
        try:
            [event] = wait_events(d, lambda e: e["kind"] == "unknown_process", 10, "the odd name's event")
            assert event["pids"] == [tenant.pid] and "gpu\\xff-tool" in event["detail"], event
            assert d.cgpuctl("events").returncode == 0
            assert d.cgpuctl("list").returncode == 0
            assert d.cgpuctl("inspect", "-d").returncode == 0
        finally:
            tenant.stop()
