"""`cgpuctl sim`: the simulated GPUs that development, CI and demos run on.
This module only writes the simulator's configuration and names its files;
the simulation itself lives in csrc/simgpu."""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cgpud.errors import UsageError
from cgpud.native import native_path
from cgpud.units import GIB, MIB

MAX_GPUS = 16  # SIM_MAX_GPUS in csrc/simgpu/simstate.h


@dataclass(frozen=True)
class SimMachine:
    """A simulated machine: identical GPUs described by one config file."""

    gpus: int = 2
    memory: int = 80 * GIB
    name: str = "NVIDIA H100 80GB HBM3"
    sms: int = 132
    nvlink: bool = False  # all GPUs linked to each other

    def validate(self) -> None:
        if not 1 <= self.gpus <= MAX_GPUS:
            raise UsageError(f"--gpus must be between 1 and {MAX_GPUS}, got {self.gpus}")
        if self.memory < MIB:
            raise UsageError("--mem must be at least 1MiB")
        if self.sms < 1:
            raise UsageError("--sms must be at least 1")
        if '"' in self.name or "\n" in self.name:
            raise UsageError("--name must not contain quotes or newlines")

    def config_text(self) -> str:
        lines = ["# simulated GPUs written by `cgpuctl sim env`; format: docs/simulated-gpu.md"]
        for i in range(self.gpus):
            line = f'gpu name="{self.name}" mem={self.memory}B sms={self.sms}'
            peers = [str(j) for j in range(self.gpus) if j != i]
            if self.nvlink and peers:
                line += " nvlink=" + ",".join(peers)
            lines.append(line)
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class SimFiles:
    config: Path
    state: Path


def _runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"cgpu-sim-{os.getuid()}"


def files_for(machine: SimMachine) -> SimFiles:
    """One config and one state per distinct machine, so switching machines
    never meets a state made for another configuration."""
    text = machine.config_text()
    tag = hashlib.sha256(text.encode()).hexdigest()[:12]
    shm = Path("/dev/shm")
    state_dir = shm if shm.is_dir() and os.access(shm, os.W_OK) else _runtime_dir()
    return SimFiles(config=_runtime_dir() / f"{tag}.conf", state=state_dir / f"cgpu-sim-{os.getuid()}-{tag}.state")


def write_config(machine: SimMachine) -> SimFiles:
    machine.validate()
    files = files_for(machine)
    files.config.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = files.config.with_suffix(".tmp")
    tmp.write_text(machine.config_text())
    tmp.replace(files.config)
    return files


def env_exports(files: SimFiles) -> str:
    """Shell lines that point any CUDA/NVML program at the simulated GPUs."""
    lib = native_path("sim/libcuda.so.1").parent
    tools = native_path("bin/cgpu-burn").parent
    return "\n".join(
        [
            f'export LD_LIBRARY_PATH="{lib}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"',
            f'export CGPU_SIM_CONFIG="{files.config}"',
            f'export CGPU_SIM_STATE="{files.state}"',
            f'export PATH="{tools}:$PATH"',
        ]
    ) + "\n"


def reset(state: Path) -> bool:
    """Forget all simulated device state (memory held, execution history).
    Processes still attached keep their old mapping until they exit."""
    try:
        state.unlink()
    except FileNotFoundError:
        return False
    return True
