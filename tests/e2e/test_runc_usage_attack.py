"""A tenant inside a real runc container attacks the one region file it may
write, /run/cgpu/usage: it computes, truncates the file, then tries to fill
it. cgpud (core_mem, fixed policy) must stay up with the same pid, a 70 %
neighbour keep its share and finish, and the instance go away cleanly."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.harness.daemon import Daemon, make_daemon
from tests.harness.oci import Host, host_mounts, run
from tests.harness.workload import instances
from tests.harness.sharerun import Sampler, ShareRig, busy_percent, start_burn_tenant

# The burn runs first: a thread of the tenant's own waiting at its gate when
# the file goes would lose its demand with it and wait on (docs/compute.md).
SCRIPT = "\n".join(
    [
        "cgpu-burn --kernel-ns 200000 --streams 4 --duration 1 >/dev/null 2>&1 || echo BURN-FAILED",
        ": > /run/cgpu/usage && echo TRUNCATED",
        "sleep 1",  # cgpud's scheduler reads the truncated file meanwhile
        # 256 MiB at most: on a plain directory it would land on the state filesystem.
        "busybox head -c 268435456 /dev/zero > /run/cgpu/usage 2>/dev/null || echo FILL-REFUSED",
        "ls -l /run/cgpu/usage",
    ]
)


def _state_bytes(state: Path) -> int:
    """What cgpud's state directory holds on its own filesystem, the
    instances' tmpfs mounts below it left out. (The filesystem's free space
    would count every other test writing to it meanwhile.)"""
    dev, total = state.stat().st_dev, 0
    for root, dirs, files in os.walk(state):
        for name in [*dirs, *files]:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:  # cgpud's journal comes and goes
                continue
            if st.st_dev != dev and name in dirs:
                dirs.remove(name)  # a mount: not the state filesystem
            elif st.st_dev == dev:
                total += st.st_blocks * 512
    return total


@pytest.mark.timing  # the neighbour's 70 % is a measured share
def test_a_container_truncating_and_filling_its_usage_file_harms_nobody(tmp_path: Path, host: Host) -> None:
    d = make_daemon(tmp_path, host.sim_env, "--mode", "core_mem", "--compute-policy", "3")
    d.start()
    try:
        _attack_and_check(tmp_path, host, d)
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()
    # Every instance's tmpfs went with it (other tests' mounts may come and go meanwhile).
    assert [m for m in host_mounts() if str(tmp_path) in m] == []


def _attack_and_check(tmp_path: Path, host: Host, d: Daemon) -> None:
    assert d.proc is not None
    pid = d.proc.pid
    # Long enough to outlast the attack on a loaded machine (it takes about 3 s alone).
    neighbour = start_burn_tenant(d, "512MiB", 70, "--duration", "20", "--kernel-ns", "200000", "--streams", "4")
    sampler = Sampler(host.sim_env, 20)
    try:
        deadline = time.monotonic() + 60
        burn = ShareRig._burn_pid(neighbour, deadline)
        ShareRig._wait_running(sampler, [burn], deadline)
        b = host.bundle(
            tmp_path / "attacker",
            ["sh", "-c", SCRIPT],
            ("ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_CORE_PERCENTAGE=30"),
        )
        held_before = _state_bytes(d.state)
        started = time.monotonic_ns()
        out = run(host, b, host.new_id(), shim=True, relay=d.relay, timeout=120)
        ended = time.monotonic_ns()
        assert "TRUNCATED" in out.stdout and "FILL-REFUSED" in out.stdout, (out.stdout, out.stderr)
        assert "BURN-FAILED" not in out.stdout, out.stdout
        # Refused (ENOSPC) long before 256 MiB, and not on cgpud's state filesystem.
        assert _state_bytes(d.state) - held_before < 64 << 20
        assert d.proc.poll() is None and d.proc.pid == pid, f"cgpud died: {d.proc.returncode}"
        assert neighbour.poll() is None, "the neighbour ended before the attack was over"
        assert d.cgpuctl("inspect").returncode == 0
        assert neighbour.wait(timeout=120) == 0, neighbour.stderr.read().decode() if neighbour.stderr else ""
    finally:
        if neighbour.poll() is None:
            neighbour.terminate()
            neighbour.wait(timeout=60)
        sampler.stop()
    # The neighbour's own device time from the truncation on: its 70 %.
    share = busy_percent(sampler.samples, burn, started + 1_500_000_000, ended)
    assert abs(share - 70) <= 10, share
    assert instances(d) == []
    d.stop()
    d.start()  # a restart after all of that works
    assert d.cgpuctl("inspect").returncode == 0
