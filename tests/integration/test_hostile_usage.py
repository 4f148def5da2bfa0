"""A hostile process attacks one tenant's usage file (the one region file a
container may write) while neighbours compute: truncated, grown to a huge
sparse size with a broken header, filled with data, scribbled on. cgpud runs
in core_mem mode with two `cgpuctl run` tenants at 30 % and 70 % (fixed
policy); the attacker is a separate process, as a tenant inside its own
container would be. cgpud must stay up (same pid), the neighbour keep its
share and finish, `cgpuctl inspect` answer, the sweep and a restart repair
the file, and the state filesystem (SQLite) see none of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud._region import ffi
from cgpud.node.region import usage_problem
from tests.harness.sharerun import Sampler, ShareRig, TenantSpec, busy_percent, start_burn_tenant
from tests.harness.teardown import terminate
from tests.harness.wait import until

pytestmark = pytest.mark.slow  # tens of seconds to minutes each

USAGE_SIZE = ffi.sizeof("struct cgpu_usage")
MIB = 1 << 20

# The attacker: a plain process with the file open read-write, as the
# container's bind mount gives it. Prints how many bytes it managed to write.
ATTACKER = r"""
import os, sys
path, attack = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR)
written = 0
if attack in ("truncate",):
    os.ftruncate(fd, 0)
if attack in ("grow-sparse",):
    os.ftruncate(fd, 1 << 40)
if attack in ("grow-sparse", "scribble"):
    os.pwrite(fd, b"\xff" * 4096, 0)
if attack == "fill":
    chunk = b"x" * (1 << 20)
    try:
        while written < (256 << 20):
            written += os.pwrite(fd, chunk, os.fstat(fd).st_size)
    except OSError as e:
        print("refused:", e.strerror, file=sys.stderr)
print(written)
"""

ATTACKS = ("truncate", "grow-sparse", "fill", "scribble")


def attack(path: Path, how: str) -> int:
    out = subprocess.run([sys.executable, "-c", ATTACKER, str(path), how], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[ShareRig]:
    # cgpud's state directory on a tmpfs of its own, so that its free space
    # (which the fill attack must not eat) moves only with this test, not
    # with what other tests on the machine write meanwhile.
    state = tmp_path / "state"
    state.mkdir()
    private = os.geteuid() == 0
    if private:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,mode=0700", "cgpu-test-state", str(state)], check=True)
    r = ShareRig(tmp_path, dict(os.environ))
    try:
        yield r
    finally:
        if r.daemon.proc is not None and r.daemon.proc.poll() is None:
            r.close()
        if private:  # with the region tmpfs mounted inside it
            subprocess.run(["umount", "--lazy", str(state)], check=True)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts, ended whatever happens to it."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    terminate(*started, timeout=60)


def _instances(rig: ShareRig) -> list[dict]:
    out = rig.daemon.cgpuctl("list", "--output", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout or "[]")


def _region_of(rig: ShareRig, core: int) -> Path:
    ids = [i["id"] for i in _instances(rig) if i["grants"][0]["core_percent"] == core]
    assert len(ids) == 1, _instances(rig)
    return rig.daemon.state / "instances" / ids[0]


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# timing: it holds the neighbour to its measured 70 %, which a tenant short of
# CPU beside other workers cannot fill (once 60.0 in a parallel pass).
@pytest.mark.timing
@pytest.mark.parametrize("how", ATTACKS)
def test_an_attacked_usage_file_harms_neither_cgpud_nor_the_neighbour(rig: ShareRig, procs: list, how: str) -> None:
    d = rig.daemon
    assert d.proc is not None
    pid = d.proc.pid
    assert d.cgpuctl("policy", "set", "fixed").returncode == 0
    # An idle instance too: nothing in it touches its file, so it is still
    # there for the sweep and the restart to repair whatever the burning
    # victim does after the attack. It has a share, so the scheduler holds
    # its file mapped too and meets a truncation of it for certain (the
    # victim's own library may die of its truncated file, and its instance
    # go, before the scheduler reads the victim's).
    idle = d.start_cgpuctl(
        "run",
        "--mem",
        "256MiB",
        "--core",
        "5",
        "--",
        "sleep",
        "600",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    victim = rig._start(TenantSpec(25))
    procs += [idle, victim]
    sampler = Sampler(rig.env, 20)
    neighbour_run: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 60
        victim_pid = rig._burn_pid(victim, deadline)
        until(lambda: len(_instances(rig)) == 2, 60.0, interval=0.05)
        target, idle_region = _region_of(rig, 25), _region_of(rig, 5)
        neighbour_run = start_burn_tenant(d, "512MiB", 70, "--duration", "5", "--kernel-ns", "200000", "--streams", "4")
        procs.append(neighbour_run)
        pids = [victim_pid, rig._burn_pid(neighbour_run, deadline)]
        rig._wait_running(sampler, pids, deadline)
        free_before = _free_bytes(d.state)

        attacked_at = time.monotonic_ns()
        written = attack(target / "usage", how)
        attack(idle_region / "usage", how)
        time.sleep(1.5)  # the neighbour computes on while cgpud meets the damage
        measured_at = time.monotonic_ns()
        assert neighbour_run.poll() is None, "the neighbour ended before its share was measured"

        assert d.proc.poll() is None and d.proc.pid == pid, f"cgpud died: {d.proc.returncode}"
        inspect = d.cgpuctl("inspect")
        assert inspect.returncode == 0, inspect.stderr
        assert neighbour_run.wait(timeout=120) == 0, neighbour_run.stderr.read().decode()
        if how == "fill":
            assert written < MIB, f"a tenant wrote {written} bytes into its usage file"
            assert free_before - _free_bytes(d.state) < 16 * MIB
        # The sweep (every 2 s here) puts the idle instance's file right.
        until(
            lambda: usage_problem(idle_region) is None,
            60.0,
            interval=0.05,
            explain=lambda: str(usage_problem(idle_region)),
        )
        assert os.stat(idle_region / "usage").st_size == USAGE_SIZE
        if how == "truncate":
            # cgpud's scheduler met the cut-off file (its guard read zeros)
            # and mapped the repaired one afresh.
            until(
                lambda: '"remapped": true' in d.log.read_text(),
                60.0,
                interval=0.05,
                explain=lambda: str(d.log.read_text()[-3000:]),
            )
    finally:
        terminate(*(p for p in (victim, neighbour_run) if p is not None), timeout=60, kill=False)
        sampler.stop()
    # Fixed shares: the neighbour had its 70 % after the attack as before it.
    share = busy_percent(sampler.samples, pids[1], attacked_at + 200_000_000, measured_at)
    assert abs(share - 70) <= 10, share

    # The same damage while cgpud is down: the restart repairs it.
    d.stop()
    attack(idle_region / "usage", how)
    d.start()
    assert usage_problem(idle_region) is None
    assert d.cgpuctl("inspect").returncode == 0
    # SQLite took no harm: a new instance is admitted and recorded.
    out = d.cgpuctl("run", "--mem", "256MiB", "--", "true")
    assert out.returncode == 0, out.stderr


def test_a_tenant_whose_own_file_is_wiped_while_it_waits_at_its_gate_still_finishes(rig: ShareRig, procs: list) -> None:
    """A process of the instance zeroes the usage file over and over: a
    thread waiting at the closed gate loses its demand with it, and cgpud
    would never grant it again. The thread asks again, so the run ends."""
    d = rig.daemon
    assert d.cgpuctl("policy", "set", "fixed").returncode == 0
    victim = start_burn_tenant(d, "256MiB", 30, "--duration", "3", "--kernel-ns", "200000")
    procs.append(victim)
    rig._burn_pid(victim, time.monotonic() + 60)
    until(lambda: len(_instances(rig)) == 1, 60.0, interval=0.05)
    usage = _region_of(rig, 30) / "usage"
    fd = os.open(usage, os.O_RDWR)
    try:
        # Held 70 % of the time at its closed gate: some of these land
        # while its launching thread waits there.
        for _ in range(40):
            os.pwrite(fd, bytes(USAGE_SIZE), 0)
            time.sleep(0.025)
    finally:
        os.close(fd)
    try:
        rc = victim.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("the tenant hung at its gate after its usage file was wiped") from None
    assert rc == 0, victim.stderr.read().decode()
    assert d.proc is not None and d.proc.poll() is None
