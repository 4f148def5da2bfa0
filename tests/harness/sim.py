"""A private simulated machine per test: its config file and environment,
cgpud's inventory of it, and the region tmpfs mounts cgpud leaves under a
directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from cgpud.node.inventory import Gpu, Inventory, MigDevice


def write_sim_config(
    path: Path, gpus: int = 2, mem: str = "16GiB", extra: str = "", placements: Sequence[str] = ()
) -> Path:
    """`placements`: more keys for each GPU's line (its PCIe place and links,
    cgpud/cli/sim_topology.py)."""
    lines = [extra] if extra else []
    for i in range(gpus):
        more = f" {placements[i]}" if i < len(placements) else ""
        lines.append(f'gpu name="NVIDIA H100 80GB HBM3" mem={mem} sms=132 cc=9.0{more}')
    path.write_text("\n".join(lines) + "\n")
    return path


def sim_env_in(dir: Path, native: Path, **config: object) -> dict[str, str]:
    """Environment for a subprocess that sees a fresh simulated machine kept
    in dir (by default 2 GPUs with 16 GiB each)."""
    dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(native / "sim")
    # The simulated driver's programs (nvidia-cuda-mps-control), found on
    # PATH as NVIDIA's are (cgpuctl sim env does the same).
    env["PATH"] = f"{native / 'sim'}:{env.get('PATH', '/usr/bin:/bin')}"
    env["CGPU_SIM_CONFIG"] = str(write_sim_config(dir / "sim.conf", **config))  # type: ignore[arg-type]
    env["CGPU_SIM_STATE"] = str(dir / "sim.state")
    return env


def region_mounts(under: Path) -> list[str]:
    """Mount points of cgpud's per-instance tmpfs under `under`."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4].encode().decode("unicode_escape")  # \040 and friends
        source = fields[fields.index("-") + 2]
        if source == "cgpu-region" and Path(point).is_relative_to(under):
            points.append(point)
    return points


def read_sim_inventory(env: dict[str, str]) -> Inventory:
    """cgpud's inventory of the simulated machine `env` names, read by
    `cgpud --inventory` in a process of its own (NVML is found through
    LD_LIBRARY_PATH when that process starts)."""
    proc = subprocess.run(
        [sys.executable, "-m", "cgpud.daemon.main", "--inventory"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    gpus = []
    for g in data["gpus"]:
        migs = tuple(MigDevice(**m) for m in g.pop("mig_devices"))
        g["compute_capability"] = tuple(g["compute_capability"])
        g["nvlink_peers"] = tuple(g["nvlink_peers"])
        g["pcie_levels"] = tuple(g["pcie_levels"])
        gpus.append(Gpu(**g, mig_devices=migs))
    return Inventory(data["driver_version"], data["cuda_driver_version"], tuple(gpus))
