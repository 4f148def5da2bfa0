"""Fixtures for libcgpu.so tests: instance regions written by the daemon's
own writer, and environments that preload the library on the simulated GPUs.
No compute scheduler runs in these tests: a test that gates launches plays
its part on the grants file (GrantsView)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cgpud.node.region import DeviceLimit, InstanceLimits, write_region
from tests.harness.grants import GIB, GrantsView, grants_bytes, sim_uuid, write_grants

Instance = Callable[..., dict[str, str]]


@pytest.fixture
def libcgpu(native: Path) -> Path:
    return native / "lib" / "libcgpu.so"


@pytest.fixture
def instance(tmp_path: Path, sim_env: dict[str, str], libcgpu: Path) -> Instance:
    """instance({0: 4 * GIB}) -> environment of a process in an instance
    holding 4 GiB of simulated GPU 0, with no compute control (ungated)."""
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


@pytest.fixture
def gated(tmp_path: Path, sim_env: dict[str, str], libcgpu: Path) -> Iterator[Callable[..., tuple[dict, GrantsView]]]:
    """gated([word, ...], gpus=[g, ...]) -> (environment, GrantsView) of an
    instance holding 4 GiB of each simulated GPU g (slot i for gpus[i]),
    with the given gate words; None for no grants file, bytes for a
    damaged one."""
    made: list[GrantsView] = []
    count = itertools.count()

    def make(
        gates: list[int] | bytes | None, gpus: tuple[int, ...] = (0,), env: dict[str, str] | None = None
    ) -> tuple[dict[str, str], GrantsView | None]:
        region = tmp_path / f"gated{next(count)}"
        devices = tuple(DeviceLimit(sim_uuid(g), 4 * GIB, g) for g in gpus)
        write_region(region, InstanceLimits(region.name, devices))
        write_grants(region, grants_bytes(gates) if isinstance(gates, list) else gates)
        env = dict(env or sim_env, LD_PRELOAD=str(libcgpu), CGPU_REGION_DIR=str(region))
        env.pop("CGPU_LOG_LEVEL", None)
        view = GrantsView(region) if isinstance(gates, list) else None
        if view:
            made.append(view)
        return env, view

    yield make
    for view in made:
        view.close()
