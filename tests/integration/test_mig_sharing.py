"""cgpud on a machine with GPUs in MIG mode, in cgpu mode, as a host user
meets it through cgpuctl: a share lands on the GPU outside MIG mode, and on
a machine whose GPUs are all in MIG mode it is refused in one line that
says what to ask for instead, with nothing made (docs/modes.md, "MIG")."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from tests.harness.daemon import make_daemon
from tests.harness.sim import sim_env_in
from tests.harness.simrun import py_env
from tests.harness.wait import until


def _instances(daemon) -> list[dict]:
    out = daemon.cgpuctl("list", "--output", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_share_goes_to_the_gpu_outside_mig_mode(tmp_path, native):
    env = sim_env_in(tmp_path / "sim", native, mem="80GiB", placements=["mig=7g.80gb"])
    daemon = make_daemon(tmp_path, env, "--mode", "cgpu")
    daemon.start()
    try:
        # Inside: the share's only CUDA device is GPU 1 with the 4 GiB limit.
        run = daemon.cgpuctl("run", "--mem", "4", "--", "cgpu-burn", "--alloc-until-fail=1GiB")
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert out["mem_total_reported"] == 4 << 30 and out["alloc"]["until_fail_count"] == 4
    finally:
        daemon.stop()


def test_a_machine_all_in_mig_mode_refuses_a_share_in_one_line(tmp_path, native):
    env = sim_env_in(tmp_path / "sim", native, mem="80GiB", placements=["mig=3g.40gb,3g.40gb"] * 2)
    daemon = make_daemon(tmp_path, env, "--mode", "cgpu")
    daemon.start()
    try:
        run = daemon.cgpuctl("run", "--mem", "4", "--", "true")
        assert run.returncode != 0 and run.stderr.count("\n") == 1, run.stderr
        assert "every GPU of this node is in MIG mode" in run.stderr
        assert "nvidia.com/mig-<profile>" in run.stderr
        assert _instances(daemon) == []
    finally:
        daemon.stop()


HOLD = """
import sys
from cudapy import Driver
cu = Driver(); cu.init_device(0)
assert cu.alloc(1 << 30)[0] == "CUDA_SUCCESS"
print("held", flush=True)
sys.stdin.readline()
"""


def test_the_bypass_watchdog_leaves_processes_on_mig_devices_alone(tmp_path, native):
    """With kill_unknown, a process of no instance on the shared GPU is
    killed; one on a MIG device (a pod's whole MIG device, cgpu's business
    nowhere) is not, though NVML lists it on its GPU."""
    env = sim_env_in(tmp_path / "sim", native, mem="80GiB", placements=["mig=3g.40gb"])
    daemon = make_daemon(
        tmp_path,
        env,
        "--mode",
        "cgpu",
        "--bypass-interval",
        "0.2",
        "--bypass-action",
        "kill",
        "--bypass-kill-unknown",
        "true",
    )
    daemon.start()
    mig_uuid = "MIG-5c1a0000-0000-4000-8000-000000a10001"  # the 3g.40gb: GPU instance 1
    tenants = {
        name: subprocess.Popen(
            [sys.executable, "-c", HOLD],
            env=py_env(dict(env, CUDA_VISIBLE_DEVICES=visible)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, visible in (("mig", mig_uuid), ("shared", "1"))
    }
    try:
        for t in tenants.values():
            assert t.stdout.readline().strip() == "held"  # type: ignore[union-attr]
        until(lambda: tenants["shared"].poll() is not None, 20, interval=0.1, what="the shared GPU's stray killed")
        assert tenants["shared"].returncode == -signal.SIGKILL
        time.sleep(1.0)  # five more rounds
        assert tenants["mig"].poll() is None
    finally:
        for t in tenants.values():
            t.kill()
            t.wait(10)
        daemon.stop()


def test_with_mig_share_each_mig_device_is_shared_within_its_own_memory(tmp_path, native):
    """mig_share: a MIG device is one of the node's GPUs. A 4 GiB share on
    it holds its process to 4 GiB (libcgpu, by the MIG UUID), more than its
    instance has is refused, and an instance fills at its own size."""
    env = sim_env_in(tmp_path / "sim", native, mem="80GiB", placements=["mig=3g.40gb,1g.10gb"] * 2)
    daemon = make_daemon(tmp_path, env, "--mode", "cgpu", "--mig-share", "true")
    daemon.start()
    try:
        run = daemon.cgpuctl("run", "--mem", "4", "--", "cgpu-burn", "--alloc-until-fail=1GiB")
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert out["mem_total_reported"] == 4 << 30 and out["alloc"]["until_fail_count"] == 4
        too_big = daemon.cgpuctl("run", "--mem", "40", "--", "true")
        assert too_big.returncode != 0 and too_big.stderr.count("\n") == 1, too_big.stderr
        assert "the largest GPU on this node has 40448 MiB" in too_big.stderr
        assert _instances(daemon) == []
        gpus = json.loads(daemon.cgpuctl("inspect", "--output", "json").stdout)["gpus"]
        # The GPUs in MIG mode are full (their MIG devices hold their memory); the MIG devices follow.
        assert [(g["index"], g["uuid"][:4], g["total_bytes"] >> 20, g["allocated_bytes"] >> 20) for g in gpus] == [
            (0, "GPU-", 81920, 81920),
            (1, "GPU-", 81920, 81920),
            (2, "MIG-", 40448, 0),
            (3, "MIG-", 9984, 0),
            (4, "MIG-", 40448, 0),
            (5, "MIG-", 9984, 0),
        ]
    finally:
        daemon.stop()
