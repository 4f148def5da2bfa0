"""The deb under a real systemd (issue 42): systemd 252 booted as PID 1 of
a Debian 12 container (tests/harness/systemd_root.py), the package
installed with `dpkg -i` as a host installs it, the simulated GPU given to
cgpud.service by a drop-in.

- Installing enables and starts cgpud; READY=1 arrived (a Type=notify unit
  is `active` only after it), and `cgpuctl doctor` is clean.
- A cgpud whose loop is stopped (SIGSTOP) is killed by the watchdog and
  restarted; the instance is adopted and its tenant keeps its limit.
- `kill -9` of cgpud: Restart=on-failure brings it back; a tenant that
  allocates and launches throughout notices nothing, and a compute share
  is back within 1 s of the new READY=1.
- An upgrade with `dpkg -i` while tenants run: prerm stops, postinst
  starts the new cgpud, which adopts the instances; the old version's
  runtime files stay while its instances live.
- remove stops and disables the service and keeps the state; purge
  deletes the state and the conffile.
- The rpm, installed by the root's own rpm (Debian's 4.18; its database
  knows none of the root's packages, so --nodeps): %post enables, and
  %posttrans starts cgpud; a reinstall runs the upgrade branches (%pre
  stops it, %posttrans starts the new one); `rpm -e` stops and disables it
  and keeps the state.

Figures (the watchdog's restart time, each outage) are printed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cgpud.node.model import GIB
from tests.harness.oci import build_rootfs
from tests.harness.systemd_root import BootedRoot, booted_systemd, give_simulated_gpu
from tests.packaging.conftest import NEW, OLD, Packages

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
UNIT = "cgpud.service"


@contextmanager
def booted(tmp_path: Path) -> Iterator[tuple[BootedRoot, dict[str, str]]]:
    with booted_systemd(tmp_path) as root:
        yield root, give_simulated_gpu(root)


def install(root: BootedRoot, deb: Path) -> subprocess.CompletedProcess[str]:
    out = root.run("dpkg", "-i", root.copy_in(deb, f"/root/{deb.name}"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr + root.journal(UNIT)
    return out


def state(root: BootedRoot) -> dict[str, str]:
    return root.show(
        UNIT, "ActiveState", "SubState", "MainPID", "NRestarts", "ActiveEnterTimestampMonotonic", "UnitFileState"
    )


def wait_for(root: BootedRoot, ok: Callable[[dict[str, str]], bool], what: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        s = state(root)
        if ok(s):
            return s
        assert time.monotonic() < deadline, f"{what} not within {timeout} s: {s}\n{root.journal(UNIT)}"
        time.sleep(0.1)


def test_installing_enables_and_starts_cgpud_which_is_ready_and_doctor_is_clean(
    packages: Packages, tmp_path: Path
) -> None:
    with booted(tmp_path) as (root, env):
        install(root, packages.new_deb)
        s = state(root)
        assert (s["ActiveState"], s["SubState"], s["UnitFileState"]) == ("active", "running", "enabled"), s
        assert root.systemctl("is-active", UNIT).stdout.strip() == "active"
        # Type=notify: `active` is reached only at READY=1.
        assert root.show(UNIT, "Type")["Type"] == "notify"
        assert int(s["ActiveEnterTimestampMonotonic"]) > 0
        doctor = root.run("cgpuctl", "doctor", env=env)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        burn = root.run("cgpuctl", "run", "--mem", "1", "--", "cgpu-burn", "--alloc-until-fail", "256MiB", env=env)
        assert burn.returncode == 0, burn.stderr + root.journal(UNIT)
        got = json.loads(burn.stdout)
        assert got["mem_total_reported"] == 1 * GIB and got["alloc"]["until_fail_count"] == 4, got
        assert root.run("cgpud", "--version").stdout.strip().endswith(NEW)


# A tenant of tests/harness/restart_tenant.py, run by the root's python3.
TENANT_FILES = ("__init__.py", "harness/__init__.py", "harness/restart_tenant.py", "harness/cudapy.py")
CORE = 30  # the compute tenant's fixed share
TOLERANCE = 5.0  # points
WINDOW_NS = 200_000_000


def put_tenant(root: BootedRoot, env: dict[str, str]) -> dict[str, str]:
    for rel in TENANT_FILES:
        dest = root.host_path(f"/sim/tenant/tests/{rel}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((REPO / "tests" / rel).read_bytes())
    return {**env, "PYTHONPATH": "/sim/tenant"}


def start_tenant(root: BootedRoot, env: dict[str, str], mode: str, *args: str) -> subprocess.Popen[str]:
    core = ["--core", str(CORE)] if mode == "compute" else []
    t = root.start(
        "cgpuctl",
        "run",
        "--mem",
        "1",
        *core,
        "--",
        "python3",
        "-m",
        "tests.harness.restart_tenant",
        mode,
        *args,
        env=env,
    )
    assert t.stdout is not None
    line = t.stdout.readline()
    assert line.strip() == "ready", line + (t.stderr.read() if t.stderr and t.poll() is not None else "")
    return t


def finish_tenant(root: BootedRoot, t: subprocess.Popen[str], mode: str) -> dict[str, object]:
    """SIGTERM to the tenant of `mode` (the python3 under cgpuctl), then its counts."""
    pids = [
        pid
        for pid, argv in processes(root)
        if argv[:1] == ["python3"] and "tests.harness.restart_tenant" in argv and mode in argv
    ]
    assert pids, "the tenant is gone"
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    out, err = t.communicate(timeout=60)
    assert t.returncode == 0, err
    counts: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return counts


def start_container(root: BootedRoot, name: str, script: str) -> subprocess.Popen[str]:
    """A runc container through the package's cgpu-runtime, asking for 1 GiB
    as `docker run -e ALIYUN_COM_GPU_MEM_CONTAINER=1` does; `script` runs in
    busybox sh, with /sim (the simulated GPU's state) mounted."""
    bundle = root.host_path(f"/root/{name}")
    build_rootfs(bundle / "rootfs")
    out = root.run("runc", "spec", "--bundle", f"/root/{name}")
    assert out.returncode == 0, out.stderr
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["sh", "-c", script]
    spec["process"]["env"] += ["CGPU_SIM_CONFIG=/sim/sim.conf", "CGPU_SIM_STATE=/sim/sim.state"]
    spec["process"]["env"] += ["ALIYUN_COM_GPU_MEM_CONTAINER=1"]
    spec["root"] = {"path": "rootfs", "readonly": False}
    spec["mounts"].append({"destination": "/sim", "type": "bind", "source": "/sim", "options": ["rbind", "rw"]})
    (bundle / "config.json").write_text(json.dumps(spec))
    # nspawn mounts this machine's cgroup v1 controllers read-only inside
    # the container: runc is told to carry on without them (--rootless).
    wrapper = root.host_path("/usr/local/sbin/runc-in-nspawn")
    if not wrapper.exists():
        wrapper.write_text('#!/bin/sh\nexec /usr/sbin/runc --rootless=true "$@"\n')
        wrapper.chmod(0o755)
    return root.start(
        "/usr/bin/cgpu-runtime",
        "run",
        "--bundle",
        f"/root/{name}",
        name,
        env=root.environment(CGPU_REAL_RUNTIME="/usr/local/sbin/runc-in-nspawn"),
    )


# Waits for /sim/go, then allocates to its limit: 1 GiB held exactly.
WAIT_THEN_ALLOCATE = "while [ ! -e /sim/go ]; do sleep 0.05; done; cgpu-burn --alloc-until-fail 256MiB"


def container_held_its_limit(c: subprocess.Popen[str]) -> None:
    out, err = c.communicate(timeout=60)
    assert c.returncode == 0, out + err
    burn = json.loads(out)
    assert burn["mem_total_reported"] == 1 * GIB and burn["alloc"]["until_fail_count"] == 4, burn


def assert_undisturbed(counts: dict[str, object]) -> None:
    assert counts["alloc_errors"] == 0 and counts["past_limit_granted"] == 0, counts
    assert counts["launch_errors"] == 0, counts


def restarted(root: BootedRoot, before: dict[str, str], what: str, timeout: float) -> dict[str, str]:
    """The unit's state once a cgpud other than `before`'s main process is active."""
    return wait_for(
        root, lambda s: s["MainPID"] not in ("0", before["MainPID"]) and s["ActiveState"] == "active", what, timeout
    )


def main_pid(root: BootedRoot) -> int:
    return int(state(root)["MainPID"])


def processes(root: BootedRoot) -> list[tuple[int, list[str]]]:
    """(PID on this machine, argv) of every process in the container."""
    ns = Path(f"/proc/{root.leader}/ns/pid").readlink()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "ns" / "pid").readlink() == ns:
                found.append((int(proc.name), (proc / "cmdline").read_text().split("\0")[:-1]))
        except OSError:
            continue
    return found


def host_pid(root: BootedRoot, pid_inside: int) -> int:
    """The PID this machine knows a process of the container by."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        nspid = next((line.split()[1:] for line in text.splitlines() if line.startswith("NSpid:")), [])
        if len(nspid) == 2 and nspid[1] == str(pid_inside):
            if Path(f"/proc/{nspid[0]}/ns/pid").readlink() == Path(f"/proc/{root.leader}/ns/pid").readlink():
                return int(nspid[0])
    raise AssertionError(f"no process of the container has PID {pid_inside}")


def test_a_stalled_cgpud_is_killed_by_the_watchdog_and_the_new_one_adopts_the_tenant(
    packages: Packages, tmp_path: Path
) -> None:
    with booted(tmp_path) as (root, env):
        install(root, packages.new_deb)
        env = put_tenant(root, env)
        tenant = start_tenant(root, env, "mem", "--kernel-ns", "1000")
        before = state(root)
        stalled_at = time.monotonic()
        os.kill(host_pid(root, int(before["MainPID"])), signal.SIGSTOP)
        after = restarted(root, before, "a new cgpud after the watchdog", timeout=120)
        ready_s = int(after["ActiveEnterTimestampMonotonic"]) / 1e6 - stalled_at
        journal = root.journal(UNIT, 200)
        assert "Watchdog timeout" in journal and "SIGABRT" in journal, journal
        assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1
        listed = root.run("cgpuctl", "list", env=env)
        assert listed.returncode == 0 and listed.stdout.count("\n") >= 2, listed.stdout + listed.stderr
        time.sleep(1)  # rounds against the adopted instance
        counts = finish_tenant(root, tenant, "mem")
        assert_undisturbed(counts)
        print(f"\nwatchdog: stall (SIGSTOP) to the new READY=1 {ready_s:.1f} s; tenant {counts['rounds']} rounds")


class Sampler:
    """The simulated GPU's busy time, sampled inside the container
    (`cgpu-sim-stat --sample`, CLOCK_MONOTONIC, which the container shares
    with this machine and its systemd)."""

    def __init__(self, root: BootedRoot, env: dict[str, str]) -> None:
        self.proc = root.start("cgpu-sim-stat", "--sample", "0", "50", "0", env=env)
        self.samples: list[tuple[int, int]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            s = json.loads(line)
            self.samples.append((s["now_ns"], s["busy_ns"]))

    def share(self, lo_ns: int, hi_ns: int) -> float:
        """Percent of [lo, hi] the GPU computed, from the samples around it."""
        a = max((s for s in self.samples if s[0] <= lo_ns), default=self.samples[0])
        b = max((s for s in self.samples if s[0] <= hi_ns), default=self.samples[0])
        return 100.0 * (b[1] - a[1]) / max(1, b[0] - a[0])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def configure(root: BootedRoot, text: str) -> None:
    """An operator's edit of the conffile, then a restart to take it."""
    conf = root.host_path("/etc/cgpu/config.toml")
    conf.write_text(conf.read_text() + text)
    out = root.systemctl("restart", UNIT)
    assert out.returncode == 0, out.stderr + root.journal(UNIT)


def test_kill_9_brings_cgpud_back_and_its_tenants_notice_nothing(packages: Packages, tmp_path: Path) -> None:
    with booted(tmp_path) as (root, env):
        install(root, packages.new_deb)
        configure(root, '\nmode = "core_mem"\ncompute_policy = 3\n')  # fixed
        env = put_tenant(root, env)
        mem = start_tenant(root, env, "mem", "--kernel-ns", "1000")
        compute = start_tenant(root, env, "compute", "--kernel-ns", "200000", "--streams", "2", "--sync-every", "8")
        container = start_container(root, "crash", WAIT_THEN_ALLOCATE)
        sampler = Sampler(root, env)
        try:
            time.sleep(2)
            assert container.poll() is None, container.communicate()
            before = state(root)
            t0 = time.monotonic_ns()
            held = sampler.share(t0 - 1_500_000_000, t0)
            killed_at = time.monotonic_ns()
            os.kill(host_pid(root, int(before["MainPID"])), signal.SIGKILL)
            after = restarted(root, before, "cgpud restarted after kill -9", timeout=60)
            ready_ns = int(after["ActiveEnterTimestampMonotonic"]) * 1000
            assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1
            time.sleep(2.5)
            root.host_path("/sim/go").touch()
            container_held_its_limit(container)
            down = sampler.share(killed_at + 300_000_000, ready_ns)
            # Seconds from READY=1 to the first 200 ms window within TOLERANCE of
            # the share before the kill (on a loaded machine a Python tenant
            # launches too slowly for its whole 30 %, before and after alike).
            back = next(
                (
                    (lo - ready_ns) / 1e9
                    for lo in range(ready_ns, ready_ns + 2_000_000_000, 50_000_000)
                    if abs(sampler.share(lo, lo + WINDOW_NS) - held) <= TOLERANCE
                ),
                None,
            )
            mem_counts = finish_tenant(root, mem, "mem")
            compute_counts = finish_tenant(root, compute, "compute")
        finally:
            sampler.stop()
            if container.poll() is None:
                container.kill()
        assert_undisturbed(mem_counts)
        assert compute_counts["launch_errors"] == 0, compute_counts
        assert CORE / 2 <= held <= CORE + TOLERANCE, held  # paced to its share, not above it
        assert back is not None and back <= 1.0, (back, held, down)
        print(
            f"\nkill -9: {(ready_ns - killed_at) / 1e9:.2f} s to the new READY=1 (RestartSec=1s), "
            f"share {held:.1f} % before, {down:.1f} % while down, back within {back:.2f} s of READY"
        )


def test_an_upgrade_while_tenants_run_restarts_cgpud_and_keeps_the_old_runtime_while_it_is_used(
    packages: Packages, tmp_path: Path
) -> None:
    with booted(tmp_path) as (root, env):
        install(root, packages.old_deb)
        env = put_tenant(root, env)
        old_pid = main_pid(root)
        mem = start_tenant(root, env, "mem", "--kernel-ns", "1000")
        container = start_container(root, "upgrade", WAIT_THEN_ALLOCATE)
        try:
            old_runtime = root.host_path(f"/var/lib/cgpud/runtime/{OLD}")
            deadline = time.monotonic() + 30
            while not old_runtime.is_dir():
                assert time.monotonic() < deadline, "no runtime directory of the old version"
                time.sleep(0.1)
            out = install(root, packages.new_deb)
            s = state(root)
            assert (s["ActiveState"], s["UnitFileState"]) == ("active", "enabled"), s
            assert int(s["MainPID"]) != old_pid
            assert root.run("cgpud", "--version").stdout.strip().endswith(NEW), out.stdout
            assert root.host_path(f"/var/lib/cgpud/runtime/{NEW}").is_dir()
            time.sleep(3)  # a sweep or two of the new cgpud: the container still uses the old files
            assert old_runtime.is_dir()
            root.host_path("/sim/go").touch()
            container_held_its_limit(container)
            counts = finish_tenant(root, mem, "mem")
        finally:
            if container.poll() is None:
                container.kill()
        assert_undisturbed(counts)
        # Unused now: the sweep removes the old version's files.
        deadline = time.monotonic() + 20
        while old_runtime.exists():
            assert time.monotonic() < deadline, "the old runtime directory outlived its last instance"
            time.sleep(0.2)


def test_remove_stops_and_keeps_the_state_and_purge_deletes_it(packages: Packages, tmp_path: Path) -> None:
    with booted(tmp_path) as (root, _env):
        install(root, packages.new_deb)
        configure(root, "\n# kept by remove\n")
        assert root.host_path("/var/lib/cgpud/cgpud.db").is_file()
        out = root.run("dpkg", "-r", "cgpu")
        assert out.returncode == 0, out.stdout + out.stderr
        s = state(root)
        assert s["ActiveState"] == "inactive" and s["UnitFileState"] in ("", "not-found"), s
        assert not root.host_path("/usr/bin/cgpud").exists()
        assert root.host_path("/var/lib/cgpud/cgpud.db").is_file()
        assert "# kept by remove" in root.host_path("/etc/cgpu/config.toml").read_text()
        out = root.run("dpkg", "-P", "cgpu")
        assert out.returncode == 0, out.stdout + out.stderr
        for gone in ("/var/lib/cgpud", "/etc/cgpu", "/run/cgpud"):
            assert not root.host_path(gone).exists(), gone
        # Nothing left mounted under the state directory.
        mounts = Path(f"/proc/{root.leader}/mounts").read_text()
        assert "/var/lib/cgpud" not in mounts, mounts


def test_the_rpms_scriptlets_enable_start_restart_and_stop_cgpud(packages: Packages, tmp_path: Path) -> None:
    with booted(tmp_path) as (root, env):
        rpm = root.copy_in(packages.new_rpm, f"/root/{packages.new_rpm.name}")
        out = root.run("rpm", "-i", "--nodeps", rpm, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        s = state(root)
        assert (s["ActiveState"], s["SubState"], s["UnitFileState"]) == ("active", "running", "enabled"), (
            s,
            root.journal(UNIT),
        )
        doctor = root.run("cgpuctl", "doctor", env=env)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        # $1 is 2 in a reinstall, as in an upgrade: %pre stops, %posttrans starts.
        first = s["MainPID"]
        out = root.run("rpm", "-U", "--replacepkgs", "--nodeps", rpm, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        s = state(root)
        assert s["ActiveState"] == "active" and s["MainPID"] not in ("0", first), s
        out = root.run("rpm", "-e", "--nodeps", "cgpu")
        assert out.returncode == 0, out.stdout + out.stderr
        s = state(root)
        assert s["ActiveState"] == "inactive" and s["UnitFileState"] in ("", "not-found"), s
        assert root.host_path("/var/lib/cgpud/cgpud.db").is_file()
