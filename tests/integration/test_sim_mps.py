"""The simulated GPUs' MPS as a real host has it: `nvidia-cuda-mps-control
-d` and its stdin commands, a server it starts for the first client, clients
whose kernels run at once within their active thread percentages, the
pinned memory limit, EXCLUSIVE_PROCESS set through NVML refusing a process
that is not a client, and NVML listing the server and its clients."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.native import native_path
from tests.harness.mps import Client, control, measured_shares, mps_env, start_clients, start_daemon, stop_daemon

pytestmark = pytest.mark.timing  # measures shares of the GPU's work


@pytest.fixture
def mps(sim_env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    """A control daemon for GPU 0 (CUDA_VISIBLE_DEVICES in its environment,
    as NVIDIA advises) and the environment its clients need."""
    env = mps_env(sim_env, tmp_path / "mps")
    pid = start_daemon({**env, "CUDA_VISIBLE_DEVICES": "0"})
    yield env
    stop_daemon(env, pid)


def nvml(env: dict[str, str], code: str) -> object:
    """Run `code` (which sets `out`) with pynvml initialised on the simulated GPUs; `out`."""
    script = (
        f"import json, pynvml as n\nn.nvmlInit()\nh = n.nvmlDeviceGetHandleByIndex(0)\n{code}\nprint(json.dumps(out))"
    )
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def burn(env: dict[str, str], *args: str) -> tuple[int, dict[str, object], str]:
    r = subprocess.run([str(native_path("bin/cgpu-burn")), *args], env=env, capture_output=True, text=True, timeout=60)
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else {}), r.stderr


def test_the_daemon_starts_answers_and_quits(sim_env: dict[str, str], tmp_path: Path) -> None:
    env = mps_env(sim_env, tmp_path / "mps")
    pid = start_daemon(env)
    pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert (pipe / "control").is_socket()
    assert control(env, "get_server_list") == ""  # no client yet: no server
    assert control(env, "get_default_active_thread_percentage") == "100.0\n"
    assert control(env, "set_default_active_thread_percentage 40") == "40.0\n"
    assert control(env, "get_default_active_thread_percentage") == "40.0\n"
    assert "Unknown command" in control(env, "make_me_root")
    second = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, capture_output=True, text=True, timeout=30)
    assert second.returncode != 0 and "already running" in second.stderr
    stop_daemon(env, pid)
    assert not Path(f"/proc/{pid}").exists()
    assert not (pipe / "control").exists() and not (pipe / "nvidia-cuda-mps-control.pid").exists()
    assert "Starting control daemon" in (tmp_path / "mps" / "log" / "control.log").read_text()


def test_clients_30_70_run_at_once_within_their_percentages(mps: dict[str, str]) -> None:
    clients = [Client({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}), Client({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70"})]
    shares, total = measured_shares(mps, clients, seconds=2.0)
    print(f"MPS 30/70: {shares[0]:.1f} / {shares[1]:.1f} % of the GPU's work, GPU {total:.1f} %")
    assert abs(shares[0] - 30) <= 3 and abs(shares[1] - 70) <= 3, shares
    assert total >= 95, total


def test_without_mps_the_same_clients_time_slice_evenly(sim_env: dict[str, str]) -> None:
    """The baseline: no daemon, so CUDA_MPS_ACTIVE_THREAD_PERCENTAGE means
    nothing and the driver time-slices the two contexts."""
    clients = [Client({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}), Client({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70"})]
    env = {**sim_env, "CUDA_MPS_PIPE_DIRECTORY": "/nonexistent/mps"}
    shares, total = measured_shares(env, clients, seconds=2.0)
    assert abs(shares[0] - 50) <= 8 and abs(shares[1] - 50) <= 8, shares
    assert total >= 95, total


def test_a_kernel_at_p_percent_takes_100_over_p_times_as_long(mps: dict[str, str]) -> None:
    rc, full, err = burn(
        {**mps, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}, "--launches", "5", "--kernel-ns", "20000000"
    )
    assert rc == 0, err
    rc, quarter, err = burn(
        {**mps, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}, "--launches", "5", "--kernel-ns", "20000000"
    )
    assert rc == 0, err
    ratio = float(quarter["wall_s"]) / float(full["wall_s"])  # type: ignore[arg-type]
    assert 3.6 <= ratio <= 4.4, (full["wall_s"], quarter["wall_s"])


def test_oversubscribed_clients_share_the_sms_by_their_percentages(mps: dict[str, str]) -> None:
    """Two clients at 100 % ask for twice the GPU: each gets half of it."""
    clients = [Client({}), Client({})]
    shares, total = measured_shares(mps, clients, seconds=1.5)
    assert all(abs(s - 50) <= 5 for s in shares), shares
    assert 95 <= total <= 100.5 and sum(shares) <= 100.5, (total, shares)  # never more than the GPU


def test_a_client_cannot_raise_its_percentage_above_the_daemons(sim_env: dict[str, str], tmp_path: Path) -> None:
    env = mps_env(sim_env, tmp_path / "mps")
    pid = start_daemon({**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"})
    try:
        shares, _ = measured_shares(env, [Client({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"})], seconds=1.5)
        assert abs(shares[0] - 40) <= 3, shares
        lower, _ = measured_shares(env, [Client({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "20"})], seconds=1.5)
        assert abs(lower[0] - 20) <= 3, lower  # lowering it is the client's to do
    finally:
        stop_daemon(env, pid)


def test_the_pinned_memory_limit_bounds_a_clients_device_memory(mps: dict[str, str]) -> None:
    rc, out, err = burn({**mps, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"}, "--alloc-until-fail", "256MiB")
    assert rc == 0, err
    alloc = out["alloc"]
    assert isinstance(alloc, dict)
    assert 6 <= alloc["until_fail_count"] <= 8, alloc  # 2 GiB less the context's memory
    rc, out, err = burn(mps, "--alloc-until-fail", "1GiB")
    assert rc == 0, err
    assert out["alloc"]["until_fail_count"] >= 14  # type: ignore[index]


def test_exclusive_process_refuses_a_process_that_is_not_a_client(mps: dict[str, str]) -> None:
    assert (
        nvml(
            mps,
            "n.nvmlDeviceSetComputeMode(h, n.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS); out = n.nvmlDeviceGetComputeMode(h)",
        )
        == 3
    )
    client = start_clients(mps, [Client({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"})], 3.0)[0]
    try:
        time.sleep(0.5)
        server = int(control(mps, "get_server_list").split()[0])
        assert control(mps, f"get_client_list {server}").split() == [str(client.pid)]
        lists = nvml(
            mps,
            "out = [sorted(p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)), "
            "sorted(p.pid for p in n.nvmlDeviceGetMPSComputeRunningProcesses(h))]",
        )
        assert lists == [sorted([server, client.pid]), [client.pid]]
        alone = {**mps, "CUDA_MPS_PIPE_DIRECTORY": str(Path(mps["CUDA_MPS_PIPE_DIRECTORY"]).parent / "none")}
        rc, _, err = burn(alone, "--launches", "1", "--kernel-ns", "1000")
        assert rc != 0 and "CUDA_ERROR_DEVICE_UNAVAILABLE" in err
        rc, _, err = burn(mps, "--launches", "1", "--kernel-ns", "1000")  # another client is welcome
        assert rc == 0, err
    finally:
        client.communicate(timeout=30)
        nvml(mps, "n.nvmlDeviceSetComputeMode(h, n.NVML_COMPUTEMODE_DEFAULT); out = 0")
    assert client.returncode == 0


def test_a_client_sees_only_its_servers_gpu(mps: dict[str, str]) -> None:
    rc, _, err = burn(mps, "--device", "1", "--launches", "1")
    assert rc != 0 and "CUDA_ERROR_INVALID_DEVICE" in err
    rc, _, err = burn(mps, "--device", "0", "--launches", "1")
    assert rc == 0, err


def test_a_server_that_cannot_get_its_gpu_fails_its_clients_at_once(mps: dict[str, str]) -> None:
    """EXCLUSIVE_PROCESS with a process that is not a client on the GPU:
    the server cannot make its context, and the client's cuInit says why
    (no server started again and again until the client gives up)."""
    nvml(mps, "n.nvmlDeviceSetComputeMode(h, n.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS); out = 0")
    alone = {**mps, "CUDA_MPS_PIPE_DIRECTORY": str(Path(mps["CUDA_MPS_PIPE_DIRECTORY"]).parent / "none")}
    holder = start_clients(alone, [Client({})], 4.0)[0]
    try:
        time.sleep(0.5)
        started = time.monotonic()
        rc, _, err = burn(mps, "--launches", "1")
        assert rc != 0 and "CUDA_ERROR_DEVICE_UNAVAILABLE" in err, err
        assert time.monotonic() - started < 5
        log = (Path(mps["CUDA_MPS_LOG_DIRECTORY"]) / "control.log").read_text()
        assert log.count("Starting new server") == 1, log
    finally:
        holder.communicate(timeout=30)
        nvml(mps, "n.nvmlDeviceSetComputeMode(h, n.NVML_COMPUTEMODE_DEFAULT); out = 0")
    assert holder.returncode == 0
