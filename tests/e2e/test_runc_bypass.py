"""The bypass watchdog against containers: the three hostile tenants of
tests/harness/bypass_build.py (ELF walk, static, musl), each in a real runc
container made through cgpu-runtime with a 1 GiB grant, allocating
4 x 1 GiB past libcgpu (/etc/ld.so.preload does not reach them), beside a
well-behaved 2 GiB neighbour container on the same simulated GPU. NVML on
the host lists them with host PIDs, as a real driver does; cgpud maps them
to their containers by cgroup.

Report mode: an event within 2 intervals of the crossing allocation, the
container runs on. Kill mode: the container's process is dead within 2
intervals (runc says stopped), NVML shows the memory back, and deleting the
container (its poststop hook) releases the instance. The neighbour runs on
with no event. A container run by plain runc (no instance) is reported as
an unknown process and never killed, unless an allow rule names its cgroup."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness import bypass_build
from tests.harness.bypass_watch import GIB, INTERVAL, SLACK, Nvml, bypass_events, violations, wait_dead, wait_events
from tests.harness.bypass_watch import watch_flags
from tests.harness.daemon import Daemon, running_daemon
from tests.harness.oci import Host, create, plain_create, runc
from tests.harness.wait import until

pytestmark = pytest.mark.slow  # tens of seconds to minutes each

KINDS = ("elf", "static", "musl")
OBSERVE = 0.1  # what the test process may add to a death it observes (see test_bypass_watchdog)
HOLD = ["--alloc-mib", "1024", "--count", "4", "--hold", "600"]


@dataclass
class Container:
    cid: str
    pid: int  # host PID of its process (runc state)
    instance_id: str
    log: Path  # its stdout and stderr

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def crossing(self, limit: int, timeout: float = 30) -> float:
        def past() -> dict[str, Any] | None:
            for o in self.lines():
                if o.get("event") == "allocated" and o["total_bytes"] > limit + SLACK:
                    return o
            return None

        line = until(
            past,
            timeout=timeout,
            interval=0.01,
            what=f"an allocation past the limit in {self.cid}",
            explain=lambda: self.log.read_text()[-2000:],
        )
        return float(line["time"])


def tenant_bundle(host: Host, where: Path, kind: str) -> Any:
    """A 1 GiB container running one bypass tenant, which the rootfs holds."""
    env = ("ALIYUN_COM_GPU_MEM_CONTAINER=1",)
    if kind == "musl":
        b = host.bundle(where, ["/usr/bin/cgpu-bypass", "--resolve", "link", *HOLD], (*env, *bypass_build.MUSL_ENV))
        bypass_build.musl_rootfs(b.rootfs)
        return b
    b = host.bundle(where, ["/usr/bin/cgpu-bypass", "--resolve", "elf" if kind == "elf" else "link", *HOLD], env)
    tool = bypass_build.elf_bypass() if kind == "elf" else bypass_build.static_bypass()
    (b.rootfs / "usr/bin/cgpu-bypass").unlink(missing_ok=True)  # hard-linked to the template: replace it
    shutil.copy2(tool, b.rootfs / "usr/bin/cgpu-bypass")
    return b


@contextmanager
def container(host: Host, d: Daemon, bundle: Any) -> Iterator[Container]:
    """Created and started through the shim; killed and deleted after."""
    cid = host.new_id("bypass")
    code, log = create(host, bundle, cid, d.relay)
    assert code == 0, log
    try:
        pid = json.loads(runc(host, "state", cid).stdout)["pid"]
        listed = json.loads(d.cgpuctl("list", "--output", "json").stdout)
        [inst] = [i for i in listed if pid in i["pids"]]
        assert runc(host, "start", cid, shim=True, relay=d.relay).returncode == 0
        yield Container(cid, pid, inst["id"], bundle.path / "stdio.log")
    finally:
        runc(host, "kill", cid, "KILL", shim=True, relay=d.relay)
        deleted = runc(host, "delete", "--force", cid, shim=True, relay=d.relay)
        assert deleted.returncode == 0, deleted.stderr


@contextmanager
def neighbour(host: Host, d: Daemon, nvml: Nvml, where: Path) -> Iterator[tuple[Container, int]]:
    """A 2 GiB container holding its 2 GiB through libcgpu; NVML's used
    memory once it does."""
    b = host.bundle(
        where,
        ["/usr/bin/cgpu-burn", "--alloc", "2048MiB", "--require-alloc", "--hold", "600"],
        ("ALIYUN_COM_GPU_MEM_CONTAINER=2",),
    )
    with container(host, d, b) as c:
        nvml.wait(lambda v: v["procs"].get(c.pid) == 2 * GIB, 30, "the neighbour container's 2 GiB")
        yield c, nvml.query()["used"]


def status(host: Host, cid: str) -> str:
    return str(json.loads(runc(host, "state", cid).stdout)["status"])


@pytest.fixture
def nvml(host: Host) -> Iterator[Nvml]:
    probe = Nvml(host.sim_env)
    yield probe
    probe.close()


def killed_in_time(d: Daemon, t: Container) -> tuple[float, float, dict[str, Any]]:
    """Kill mode's promise for a container past its limit: dead within two
    intervals of the crossing allocation, and an event naming its pid as
    killed. The crossing's and the death's times, and the event."""
    crossed = t.crossing(GIB)
    dead = wait_dead(t.pid, 10)
    assert dead is not None, (
        f"container {t.cid} (pid {t.pid}) still runs 10 s after crossing its limit: {bypass_events(d)}"
    )
    assert dead - crossed <= 2 * INTERVAL + OBSERVE, dead - crossed
    [event] = wait_events(d, lambda e: e["instance_id"] == t.instance_id, 10, "the kill's event")
    assert event["action"] == "killed" and event["killed"] == [t.pid], event
    return crossed, dead, event


@pytest.mark.parametrize("kind", KINDS)
def test_report_mode_reports_a_bypass_container(kind: str, tmp_path: Path, host: Host, nvml: Nvml) -> None:
    with (
        running_daemon(tmp_path, host.sim_env, *watch_flags("report")) as d,
        neighbour(host, d, nvml, tmp_path / "n") as (n, _),
        container(host, d, tenant_bundle(host, tmp_path / "t", kind)) as t,
    ):
        crossed = t.crossing(GIB)
        [event] = wait_events(d, lambda e: e["instance_id"] == t.instance_id, 10, "an event for the container")
        assert event["kind"] == "memory_over_limit" and event["action"] == "reported", event
        assert event["pids"] == [t.pid], event  # its host PID
        assert event["time"] - crossed <= 2 * INTERVAL, (event["time"] - crossed, event)
        print(f"{kind}: reported {(event['time'] - crossed) * 1e3:.0f} ms after the crossing allocation")
        time.sleep(5 * INTERVAL)
        assert status(host, t.cid) == "running" and status(host, n.cid) == "running"
        view = nvml.query()
        assert view["procs"].get(t.pid) == 4 * GIB and view["procs"].get(n.pid) == 2 * GIB
        assert [e["instance_id"] for e in bypass_events(d)] == [t.instance_id]
        assert violations(d) == {t.instance_id: 1, n.instance_id: 0}  # cgpuctl list


@pytest.mark.parametrize("kind", KINDS)
def test_kill_mode_stops_a_bypass_container(kind: str, tmp_path: Path, host: Host, nvml: Nvml) -> None:
    with (
        running_daemon(tmp_path, host.sim_env, *watch_flags("kill")) as d,
        neighbour(host, d, nvml, tmp_path / "n") as (n, baseline),
    ):
        with container(host, d, tenant_bundle(host, tmp_path / "t", kind)) as t:
            crossed, dead, event = killed_in_time(d, t)
            assert event["time"] - crossed <= 2 * INTERVAL, event
            print(
                f"{kind}: killed at {(event['time'] - crossed) * 1e3:.0f} ms, seen dead at "
                f"{(dead - crossed) * 1e3:.0f} ms after the crossing allocation"
            )
            assert status(host, t.cid) == "stopped"
            view = nvml.wait(lambda v: v["used"] == baseline, 2, f"used memory back to {baseline}")
            assert t.pid not in view["procs"]
        # Deleted (its poststop ran): the instance is released.
        listed = json.loads(d.cgpuctl("list", "--output", "json").stdout)
        assert [i["id"] for i in listed] == [n.instance_id]
        assert status(host, n.cid) == "running" and nvml.query()["procs"].get(n.pid) == 2 * GIB
        assert [e["instance_id"] for e in bypass_events(d)] == [t.instance_id]


@contextmanager
def plain_container(host: Host, bundle: Any, cid: str) -> Iterator[int]:
    """A container run by runc itself, not through cgpu-runtime: a GPU user
    cgpu never heard of. Yields its host PID."""
    code, log = plain_create(host, bundle, cid)
    assert code == 0, log
    try:
        assert runc(host, "start", cid).returncode == 0
        yield int(json.loads(runc(host, "state", cid).stdout)["pid"])
    finally:
        runc(host, "kill", cid, "KILL")
        deleted = runc(host, "delete", "--force", cid)
    assert deleted.returncode == 0, deleted.stderr


def test_a_container_outside_cgpu_is_reported_not_killed_and_an_allowed_cgroup_is_left_alone(
    tmp_path: Path, host: Host, nvml: Nvml
) -> None:
    """Kill mode. Two containers run by plain runc (no cgpu-runtime, no
    instance) allocate 256 MiB with the ELF-walking tool: the one whose
    cgroup an allow rule names (`cgroup:*/allowed-*`, runc puts a container
    in a cgroup named by its id) is not reported; the other is reported as
    unknown_process by its host PID and keeps running."""
    args = ["/usr/bin/cgpu-bypass", "--resolve", "elf", "--alloc-mib", "256", "--count", "1", "--hold", "600"]
    bundles = []
    for name in ("allowed", "plain"):
        b = host.bundle(tmp_path / name, args)
        (b.rootfs / "usr/bin/cgpu-bypass").unlink(missing_ok=True)
        shutil.copy2(bypass_build.elf_bypass(), b.rootfs / "usr/bin/cgpu-bypass")
        bundles.append(b)
    with (
        running_daemon(
            tmp_path, host.sim_env, *watch_flags("kill", INTERVAL, "--bypass-allow", "cgroup:*/allowed-*")
        ) as d,
        plain_container(host, bundles[0], host.new_id("allowed")) as allowed,
        plain_container(host, bundles[1], host.new_id("plain")) as plain,
    ):
        cgroup = Path(f"/proc/{allowed}/cgroup").read_text()
        assert "/allowed-" in cgroup, cgroup  # what the rule relies on
        nvml.wait(
            lambda v: v["procs"].get(allowed) == v["procs"].get(plain) == 256 << 20, 10, "both containers' 256 MiB"
        )
        [event] = wait_events(d, lambda e: e["kind"] == "unknown_process", 10, "an unknown_process event")
        assert event["pids"] == [plain] and event["instance_id"] == "", event
        assert event["action"] == "reported" and event["killed"] == [], event
        time.sleep(5 * INTERVAL)
        assert wait_dead(plain, 0) is None and wait_dead(allowed, 0) is None  # both still run
        assert [e["pids"] for e in bypass_events(d)] == [[plain]]


def exe_once_started(pid: int, timeout: float = 10) -> str:
    """/proc/<pid>/exe once the container's process has left runc's init:
    `runc start` returns before the init execs the container's program."""
    return until(
        lambda: exe if (exe := os.readlink(f"/proc/{pid}/exe")).startswith("/usr/bin/") else "",
        timeout=timeout,
        interval=0.01,
        what=f"pid {pid} to exec the container's program",
        explain=lambda: f"/proc/{pid}/exe is {os.readlink(f'/proc/{pid}/exe')}",
    )


def test_naming_the_binary_like_an_allowed_daemon_protects_nothing(tmp_path: Path, host: Host, nvml: Nvml) -> None:
    """The allow list names NVIDIA's daemons by executable (`*/Xorg`,
    `*/nvidia-persistenced`...). Inside a container, /proc/<pid>/exe is a
    path in the image, which the tenant chooses. Kill mode: a 1 GiB
    container whose bypass tool is /usr/bin/nvidia-persistenced is still
    killed, and a container outside cgpu whose tool is /usr/bin/Xorg is
    still reported."""
    tenant = host.bundle(
        tmp_path / "t", ["/usr/bin/nvidia-persistenced", "--resolve", "elf", *HOLD], ("ALIYUN_COM_GPU_MEM_CONTAINER=1",)
    )
    shutil.copy2(bypass_build.elf_bypass(), tenant.rootfs / "usr/bin/nvidia-persistenced")
    stranger = host.bundle(
        tmp_path / "s", ["/usr/bin/Xorg", "--resolve", "elf", "--alloc-mib", "256", "--count", "1", "--hold", "600"]
    )
    shutil.copy2(bypass_build.elf_bypass(), stranger.rootfs / "usr/bin/Xorg")
    with (
        running_daemon(tmp_path, host.sim_env, *watch_flags("kill")) as d,
        plain_container(host, stranger, host.new_id("xorg")) as xorg,
    ):
        assert exe_once_started(xorg) == "/usr/bin/Xorg"  # what cgpud reads: the image's path
        [unknown] = wait_events(d, lambda e: e["kind"] == "unknown_process", 10, "the Xorg container reported")
        assert unknown["pids"] == [xorg] and unknown["action"] == "reported", unknown
        with container(host, d, tenant) as t:
            assert exe_once_started(t.pid) == "/usr/bin/nvidia-persistenced"
            killed_in_time(d, t)
