"""NVIDIA MPS on the simulated GPUs, driven as on a real host: the
`nvidia-cuda-mps-control` the simulated driver ships (found on PATH like
NVIDIA's), its pipe and log directories, its stdin commands, and
saturating `cgpu-burn` clients whose shares of the GPU's work are read from
the simulation's own accounting (`cgpu-sim-stat --sample`).

Used by tests/integration/test_sim_mps.py and bench/bench_mps.py."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cgpud.native import native_path
from tests.harness.sharerun import Sampler

CONTROL = "nvidia-cuda-mps-control"


def mps_env(env: Mapping[str, str], dir: Path) -> dict[str, str]:
    """`env` with MPS's pipe and log directories under `dir` and the
    simulated driver's tools (nvidia-cuda-mps-control) first on PATH."""
    out = dict(env)
    for sub in ("pipe", "log"):
        (dir / sub).mkdir(parents=True, exist_ok=True)
    out["CUDA_MPS_PIPE_DIRECTORY"] = str(dir / "pipe")
    out["CUDA_MPS_LOG_DIRECTORY"] = str(dir / "log")
    out["PATH"] = f"{native_path('sim/libcuda.so.1').parent}:{out.get('PATH', '/usr/bin:/bin')}"
    return out


def control(env: Mapping[str, str], *commands: str) -> str:
    """The control daemon's answers to `commands`, given on stdin."""
    r = subprocess.run(
        [CONTROL], input="".join(c + "\n" for c in commands), env=dict(env), capture_output=True, text=True, timeout=30
    )
    if r.returncode != 0:
        raise AssertionError(f"{CONTROL} failed ({r.returncode}): {r.stderr}")
    return r.stdout


def start_daemon(env: Mapping[str, str]) -> int:
    """`nvidia-cuda-mps-control -d`; its pid, from the pid file it writes."""
    r = subprocess.run([CONTROL, "-d"], env=dict(env), capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise AssertionError(f"{CONTROL} -d failed ({r.returncode}): {r.stderr}")
    return int((Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / "nvidia-cuda-mps-control.pid").read_text())


def stop_daemon(env: Mapping[str, str], pid: int) -> None:
    """`echo quit | nvidia-cuda-mps-control`, then wait until it is gone."""
    control(env, "quit")
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


@dataclass(frozen=True)
class Client:
    """One saturating client: its own environment on top of the shared one."""

    env: Mapping[str, str]
    kernel_ns: int = 200_000
    streams: int = 4


def start_clients(env: Mapping[str, str], clients: Sequence[Client], seconds: float) -> list[subprocess.Popen[str]]:
    burn = str(native_path("bin/cgpu-burn"))
    procs = []
    for c in clients:
        args = [burn, "--duration", f"{seconds:g}", "--kernel-ns", str(c.kernel_ns), "--streams", str(c.streams)]
        procs.append(
            subprocess.Popen(args, env={**env, **c.env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return procs


def measured_shares(
    env: Mapping[str, str], clients: Sequence[Client], seconds: float, settle: float = 0.5
) -> tuple[list[float], float]:
    """Each client's percent of GPU 0's work over `seconds` once all run
    (after `settle`), and the GPU's total, from the simulation's per-process
    accounting sampled every 100 ms."""
    procs = start_clients(env, clients, settle + seconds + 1.5)
    sampler = Sampler(dict(env), 100)
    try:
        time.sleep(settle + seconds + 0.3)
    finally:
        sampler.stop()
    outs = [p.communicate(timeout=30) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise AssertionError(f"a client failed ({p.returncode}): {err}")
    first = next(s for s in sampler.samples if s[0] >= sampler.samples[0][0] + int(settle * 1e9))
    last = next(s for s in reversed(sampler.samples) if s[0] <= first[0] + int(seconds * 1e9) + 50_000_000)
    wall = last[0] - first[0]
    shares = [100 * (last[2].get(p.pid, 0) - first[2].get(p.pid, 0)) / wall for p in procs]
    return shares, 100 * (last[1] - first[1]) / wall
