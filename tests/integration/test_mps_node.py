"""An mps node: a real cgpud in mps mode on the simulated GPUs sets each
GPU's compute mode to EXCLUSIVE_PROCESS through NVML, runs one
nvidia-cuda-mps-control per GPU, restarts one that dies, adopts them across
its own restart, and gives `cgpuctl run` tenants the MPS variables (thread
percentage from --core, pinned memory limit from --mem) with libcgpu's
limits on top. Shares are read from the simulation's own accounting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.native import native_path
from tests.harness.bypass_watch import bypass_events
from tests.harness.daemon import Daemon, running_daemon
from tests.harness.sharerun import Sampler
from tests.harness.wait import until

pytestmark = pytest.mark.timing  # measures shares of the GPU's work

BURN = str(native_path("bin/cgpu-burn"))


@pytest.fixture
def node(tmp_path: Path, sim_env: dict[str, str]) -> Iterator[Daemon]:
    with running_daemon(tmp_path, sim_env, "--mode", "mps") as d:
        yield d


def modes(env: dict[str, str]) -> list[int]:
    script = (
        "import json, pynvml as n\nn.nvmlInit()\n"
        "print(json.dumps([n.nvmlDeviceGetComputeMode(n.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]))"
    )
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout))


def mps_list(env: dict[str, str]) -> list[int]:
    script = (
        "import json, pynvml as n\nn.nvmlInit()\nh = n.nvmlDeviceGetHandleByIndex(0)\n"
        "print(json.dumps(sorted(p.pid for p in n.nvmlDeviceGetMPSComputeRunningProcesses(h))))"
    )
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout))


def pid_file(d: Daemon, gpu: int) -> Path:
    return d.socket.parent / "mps" / str(gpu) / "pipe" / "nvidia-cuda-mps-control.pid"


def daemon_pid(d: Daemon, gpu: int) -> int:
    return int(pid_file(d, gpu).read_text())


def run(d: Daemon, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return d.cgpuctl("run", *args, timeout=timeout)


def test_an_mps_node_makes_each_gpu_exclusive_to_its_own_mps_daemon(node: Daemon) -> None:
    assert modes(node.env) == [3, 3]
    pids = [daemon_pid(node, g) for g in (0, 1)]
    assert pids[0] != pids[1] and all(Path(f"/proc/{p}").exists() for p in pids)
    # A tenant is an MPS client of its GPU's daemon, with its core share and memory.
    r = run(node, "--mem", "2GiB", "--core", "30", "--", "env")
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    assert Path(env["CUDA_MPS_PIPE_DIRECTORY"]) == pid_file(node, int(env["ALIYUN_COM_GPU_MEM_IDX"])).parent
    # A process that is not a client cannot take a GPU that MPS holds.
    tenant = node.start_cgpuctl("run", "--mem", "2GiB", "--", BURN, "--duration", "3", "--kernel-ns", "200000")
    try:
        until(lambda: len(mps_list(node.env)) == 1, timeout=10, what="the tenant listed as an MPS client")
        alone = {**node.env, "CUDA_MPS_PIPE_DIRECTORY": "/nonexistent"}
        r2 = subprocess.run([BURN, "--launches", "1"], env=alone, capture_output=True, text=True, timeout=60)
        assert r2.returncode != 0 and "CUDA_ERROR_DEVICE_UNAVAILABLE" in r2.stderr
    finally:
        assert tenant.wait(timeout=30) == 0
    node.stop()
    assert modes(node.env) == [0, 0]  # given back
    until(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), timeout=10, what="the daemons gone")


def test_two_tenants_30_70_get_their_shares_through_mps(node: Daemon) -> None:
    burn = [BURN, "--duration", "4", "--kernel-ns", "200000", "--streams", "4"]
    tenants = [
        node.start_cgpuctl("run", "--mem", "2GiB", "--core", str(core), "--gpus", "1", "--", *burn) for core in (30, 70)
    ]
    sampler = Sampler(node.env, 100)
    try:
        time.sleep(3.2)
    finally:
        sampler.stop()
    assert [t.wait(timeout=30) for t in tenants] == [0, 0]
    first = next(s for s in sampler.samples if s[0] >= sampler.samples[0][0] + 1_000_000_000)
    last = sampler.samples[-1]
    wall = last[0] - first[0]
    shares = sorted(100 * (last[2][p] - first[2].get(p, 0)) / wall for p in last[2] if last[2][p] > first[2].get(p, 0))
    print(f"cgpud mps node, 30/70: {[round(s, 1) for s in shares]} % of GPU 0's work")
    assert len(shares) == 2, shares  # both on one GPU (binpack)
    assert abs(shares[0] - 30) <= 4 and abs(shares[1] - 70) <= 4, shares
    # The bypass watchdog (a round a second) took neither the server nor
    # the clients for processes going around libcgpu.
    assert bypass_events(node) == []


def test_libcgpu_limits_hold_under_mps_whatever_the_tenant_sets(node: Daemon) -> None:
    """The pinned memory limit is the tenant's own env; libcgpu's 1 GiB is not."""
    r = run(
        node,
        "--mem",
        "1GiB",
        "--",
        "env",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G",
        BURN,
        "--alloc-until-fail",
        "256MiB",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["alloc"]["until_fail_count"] <= 4  # 1 GiB at most


def test_a_tenant_cannot_raise_its_thread_percentage_through_its_env(node: Daemon) -> None:
    """The driver takes the client's env as given; libcgpu lowers it to the
    instance's share before the program starts."""
    tenant = node.start_cgpuctl(
        "run",
        "--mem",
        "2GiB",
        "--core",
        "30",
        "--",
        "env",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100",
        BURN,
        "--duration",
        "3",
        "--kernel-ns",
        "200000",
        "--streams",
        "4",
        stdout=subprocess.DEVNULL,
    )
    sampler = Sampler(node.env, 100)
    try:
        time.sleep(2.5)
    finally:
        sampler.stop()
    assert tenant.wait(timeout=30) == 0
    first = next(s for s in sampler.samples if s[0] >= sampler.samples[0][0] + 1_000_000_000)
    last = sampler.samples[-1]
    share = 100 * (last[1] - first[1]) / (last[0] - first[0])
    print(f"a --core 30 tenant that sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100: {share:.1f} % of the GPU")
    assert abs(share - 30) <= 4, share


def test_a_dead_daemon_is_restarted_and_serves_again(node: Daemon) -> None:
    old = daemon_pid(node, 0)
    os.kill(old, signal.SIGKILL)
    until(lambda: pid_file(node, 0).exists() and daemon_pid(node, 0) != old, timeout=10, what="the daemon restarted")
    r = run(node, "--mem", "2GiB", "--core", "50", "--", BURN, "--launches", "2", "--kernel-ns", "1000000")
    assert r.returncode == 0, r.stderr
    assert "MPS control daemon died" in node.log.read_text()


def test_a_restarted_cgpud_adopts_the_running_daemons(node: Daemon) -> None:
    before = [daemon_pid(node, g) for g in (0, 1)]
    node.kill()
    assert modes(node.env) == [3, 3]  # nothing ran cgpud's stop
    node.start()
    assert [daemon_pid(node, g) for g in (0, 1)] == before
    assert "MPS control daemon adopted" in node.log.read_text()
    r = run(node, "--mem", "2GiB", "--", BURN, "--launches", "1")
    assert r.returncode == 0, r.stderr


def test_an_mps_node_without_mps_installed_does_not_start_and_says_why(tmp_path: Path, sim_env: dict[str, str]) -> None:
    from tests.harness.daemon import BIN, make_daemon

    env = dict(sim_env, PATH=":".join(p for p in sim_env["PATH"].split(":") if not p.endswith("/sim")))
    d = make_daemon(tmp_path, env, "--mode", "mps")
    r = subprocess.run([str(BIN / "cgpud"), *d.args], env=d.env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "nvidia-cuda-mps-control is not on cgpud's PATH" in r.stderr, r.stderr
    assert modes(sim_env) == [0, 0]  # nothing left exclusive


def test_tenants_keep_their_mps_server_across_cgpud_restarts_and_stops(tmp_path: Path, sim_env: dict[str, str]) -> None:
    """kill -9 of cgpud, then a clean stop, each while a tenant computes:
    the tenant's server lives on (the daemon is adopted, then kept for its
    client with its GPU exclusive); once the tenant is gone the next stop
    quits the daemon and gives the mode back."""
    from tests.harness.daemon import make_daemon

    d = make_daemon(tmp_path, sim_env, "--mode", "mps")
    d.start()
    out = tmp_path / "burn.json"
    burn = f"{BURN} --duration 4 --kernel-ns 200000 > {out}"
    tenant = d.start_cgpuctl("run", "--mem", "2GiB", "--core", "50", "--", "sh", "-c", burn, stderr=subprocess.PIPE)
    try:
        until(lambda: len(mps_list(d.env)) == 1, timeout=10, what="the tenant listed as an MPS client")
        daemon0 = daemon_pid(d, 0)
        d.kill()
        d.start()
        assert daemon_pid(d, 0) == daemon0
        d.stop()
        assert "MPS control daemon kept for its clients" in d.log.read_text()
        assert Path(f"/proc/{daemon0}").exists() and modes(d.env)[0] == 3
        assert mps_list(d.env) and tenant.poll() is None  # still computing
    finally:
        tenant.wait(timeout=30)  # cgpuctl itself fails at the end: its cgpud is stopped
    burned = json.loads(out.read_text())
    assert burned["errors"] == [] and burned["launches"] > 0  # its work done, through the restarts
    d.start()
    assert daemon_pid(d, 0) == daemon0  # adopted again
    d.stop()
    until(lambda: not Path(f"/proc/{daemon0}").exists(), timeout=10, what="the idle daemon quit")
    assert modes(d.env) == [0, 0]
