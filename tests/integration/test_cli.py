"""cgpuctl and cgpud as a user runs them: real processes, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("prog", ["cgpuctl", "cgpud"])
def test_help_and_version(prog):
    assert _run(prog, "--help").returncode == 0
    version = _run(prog, "--version")
    assert version.returncode == 0 and version.stdout.startswith(f"{prog} 0.")


@pytest.fixture
def private_runtime_dir(tmp_path) -> dict[str, str]:
    return dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))


def test_sim_env_makes_programs_see_the_simulated_gpus(private_runtime_dir, tmp_path):
    exports = _run("cgpuctl", "sim", "env", "--gpus", "3", "--mem", "8GiB", env=private_runtime_dir)
    assert exports.returncode == 0, exports.stderr
    script = exports.stdout + "cgpu-burn --alloc 2GiB\n"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=private_runtime_dir, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["total_mem"] == 8 << 30 and out["alloc"]["granted_bytes"] == 2 << 30
    state = next(line for line in exports.stdout.splitlines() if "CGPU_SIM_STATE" in line).split('"')[1]
    reset = subprocess.run(
        ["bash", "-c", exports.stdout + "cgpuctl sim reset"],
        capture_output=True,
        text=True,
        env=dict(private_runtime_dir, PATH=f"{BIN}:{os.environ['PATH']}"),
        timeout=60,
    )
    assert reset.returncode == 0 and reset.stdout.strip() == f"cleared {state}"
    assert not Path(state).exists()


def test_inventory_reads_the_gpus_through_nvml(sim_env):
    proc = _run("cgpud", "--inventory", env=sim_env)
    assert proc.returncode == 0, proc.stderr
    inv = json.loads(proc.stdout)
    assert [g["memory_total"] for g in inv["gpus"]] == [16 << 30, 16 << 30]
    assert [g["sm_count"] for g in inv["gpus"]] == [132, 132]
    assert inv["labels"] == {
        "aliyun.accelerator/nvidia_name": "NVIDIA-H100-80GB-HBM3",
        "aliyun.accelerator/nvidia_mem": "16384MiB",
        "aliyun.accelerator/nvidia_count": "2",
    }


def test_inventory_without_a_driver_says_what_to_fix(tmp_path):
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))
    proc = _run("cgpud", "--inventory", env=env)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "libnvidia-ml.so.1" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sim", "env", "--mem", "lots"], "bad memory size 'lots'"),
        (["sim", "env", "--gpus", "99"], "--gpus must be between 1 and 16"),
        (["sim", "demo", "--mem", "8GiB"], "use --mem 40GiB or more"),
    ],
)
def test_bad_arguments_give_one_line_and_change_nothing(private_runtime_dir, tmp_path, args, message):
    proc = _run("cgpuctl", *args, env=private_runtime_dir)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("cgpuctl: ") and message in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / f"cgpu-sim-{os.getuid()}").exists() or "demo" in args
