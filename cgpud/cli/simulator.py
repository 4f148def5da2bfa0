"""`cgpuctl sim`: the simulated GPUs that development, CI and demos run on.
This module only writes the simulator's configuration and names its files;
the simulation itself lives in csrc/simgpu."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from cgpud.cli.sim_topology import placement
from cgpud.errors import CgpuError, UsageError
from cgpud.native import native_path
from cgpud.units import GIB, MIB

MAX_GPUS = 16  # SIM_MAX_GPUS in csrc/simgpu/simstate.h: GPUs and MIG devices together
# The MIG profiles the simulator has (csrc/simgpu/simmig.c; an H100 80GB's).
MIG_PROFILES = ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")


@dataclass(frozen=True)
class SimMachine:
    """A simulated machine: identical GPUs described by one config file."""

    gpus: int = 2
    memory: int = 80 * GIB
    name: str = "NVIDIA H100 80GB HBM3"
    sms: int = 132
    nvlink: bool = False  # all GPUs linked to each other
    topology: str = ""  # a machine shape of sim_topology.TOPOLOGIES: PCIe tree and NVLinks
    mig: str = ""  # every GPU in MIG mode with these instances ("1g.10gb,3g.40gb"; "on": none)

    def validate(self) -> None:
        if not 1 <= self.gpus <= MAX_GPUS:
            raise UsageError(f"--gpus must be between 1 and {MAX_GPUS}, got {self.gpus}")
        if self.memory < MIB:
            raise UsageError("--mem must be at least 1MiB")
        if self.sms < 1:
            raise UsageError("--sms must be at least 1")
        if '"' in self.name or "\n" in self.name:
            raise UsageError("--name must not contain quotes or newlines")
        if self.topology:
            placement(self.topology, self.gpus)
        if self.mig:
            self._validate_mig()

    def _validate_mig(self) -> None:
        if (self.memory, self.sms) != (80 * GIB, 132):
            raise UsageError("--mig needs the H100 80GB shape (--mem 80GiB --sms 132): its MIG profiles are simulated")
        profiles = [] if self.mig == "on" else self.mig.split(",")
        unknown = [p for p in profiles if p not in MIG_PROFILES]
        if unknown:
            raise UsageError(f"--mig: unknown MIG profile {unknown[0]!r}: use {', '.join(MIG_PROFILES)} or 'on'")
        if self.gpus * (1 + len(profiles)) > MAX_GPUS:
            raise UsageError(f"--mig: {self.gpus} GPUs with {len(profiles)} MIG devices each exceed {MAX_GPUS} devices")

    def config_text(self) -> str:
        lines = ["# simulated GPUs written by `cgpuctl sim env`; format: docs/simulated-gpu.md"]
        shape = placement(self.topology, self.gpus) if self.topology else ()
        for i in range(self.gpus):
            line = f'gpu name="{self.name}" mem={self.memory}B sms={self.sms}'
            peers = [str(j) for j in range(self.gpus) if j != i]
            if self.nvlink and peers:
                line += " nvlink=" + ",".join(peers)
            if shape:
                line += " " + shape[i]
            if self.mig:
                line += f" mig={self.mig}"
            lines.append(line)
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class SimFiles:
    config: Path
    state: Path


def _runtime_dir() -> Path:
    import tempfile

    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"cgpu-sim-{os.getuid()}"


def files_for(machine: SimMachine) -> SimFiles:
    """One config and one state per distinct machine, so switching machines
    never meets a state made for another configuration."""
    import hashlib

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
    return (
        "\n".join(
            [
                f'export LD_LIBRARY_PATH="{lib}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"',
                f'export CGPU_SIM_CONFIG="{files.config}"',
                f'export CGPU_SIM_STATE="{files.state}"',
                # The simulated driver's own programs (nvidia-cuda-mps-control) too,
                # where NVIDIA's driver installs its own.
                f'export PATH="{tools}:{lib}:$PATH"',
            ]
        )
        + "\n"
    )


def reset(state: Path) -> bool:
    """Forget all simulated device state (memory held, execution history).
    Processes still attached keep their old mapping until they exit."""
    try:
        state.unlink()
    except FileNotFoundError:
        return False
    return True


MAX_XID = 999  # NVML reports 999 for an XID it cannot name


@dataclass(frozen=True)
class Fault:
    """One fault to inject into a simulated GPU: an XID, the GPU falling off
    the bus (reported as XID 79, then NVML answers GPU_IS_LOST), or a reset
    that brings a lost GPU back."""

    gpu: int
    xid: int | None = None
    lost: bool = False
    recover: bool = False

    def sim_stat_args(self) -> list[str]:
        """cgpu-sim-stat's arguments for the fault; checks it first."""
        if self.gpu < 0:
            raise UsageError(f"--gpu must be 0 or more, got {self.gpu}")
        if (self.xid is not None) + self.lost + self.recover != 1:
            raise UsageError("give exactly one of --xid N, --lost, --recover")
        if self.xid is not None:
            if not 1 <= self.xid <= MAX_XID:
                raise UsageError(f"--xid must be between 1 and {MAX_XID}, got {self.xid}")
            return ["--xid", str(self.gpu), str(self.xid)]
        return ["--lost" if self.lost else "--recover", str(self.gpu)]


def inject_fault(files: SimFiles, fault: Fault) -> dict[str, object]:
    """Inject `fault` into the machine of `files`; returns the GPU's fault
    state as the simulator reports it ({"index", "lost", "xids"})."""
    import subprocess

    args = fault.sim_stat_args()
    env = dict(os.environ, CGPU_SIM_CONFIG=str(files.config), CGPU_SIM_STATE=str(files.state))
    proc = subprocess.run(
        [str(native_path("bin/cgpu-sim-stat")), *args], env=env, capture_output=True, text=True, timeout=30
    )
    if proc.returncode != 0:
        message = proc.stderr.strip().removeprefix("cgpu-sim-stat: ")
        raise (UsageError if proc.returncode == 2 else CgpuError)(f"cannot inject the fault: {message}")
    state: dict[str, object] = json.loads(proc.stdout)
    return state
