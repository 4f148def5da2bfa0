"""Fixtures for libcgpu.so tests: instance regions written by the daemon's
own writer, and environments that preload the library on the simulated GPUs."""
from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from cgpud.daemon.region import DeviceLimit, InstanceLimits, write_region

GIB = 1 << 30


def sim_uuid(index: int) -> str:
    """UUID of simulated GPU `index` under the default config lines."""
    return f"GPU-5c1a0000-0000-4000-8000-{0xC90000 + index:012x}"


Instance = Callable[..., dict[str, str]]


@pytest.fixture
def libcgpu(native: Path) -> Path:
    return native / "lib" / "libcgpu.so"


@pytest.fixture
def instance(tmp_path: Path, sim_env: dict[str, str], libcgpu: Path) -> Instance:
    """instance({0: 4 * GIB}) -> environment of a process in an instance
    holding 4 GiB of simulated GPU 0."""
    made = 0

    def make(limits: dict[int, int], log_level: int = 0) -> dict[str, str]:
        nonlocal made
        made += 1
        region = tmp_path / f"region{made}"
        devices = tuple(DeviceLimit(sim_uuid(g), mem, g) for g, mem in limits.items())
        write_region(region, InstanceLimits(f"test-{made}", devices, log_level=log_level))
        env = dict(sim_env, LD_PRELOAD=str(libcgpu), CGPU_REGION_DIR=str(region))
        env.pop("CGPU_LOG_LEVEL", None)
        return env

    return make


def build_c(tmp_path: Path, source: str, name: str, *flags: str) -> Path:
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / name
    subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-o", str(out), str(src), *flags], check=True)
    return out
