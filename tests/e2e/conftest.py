"""Fixtures for containers run by real runc (and containerd) against a real
cgpud on the simulated GPUs."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness.sim import write_sim_config
from tests.harness.daemon import Daemon, running_daemon
from tests.harness.containerd import Containerd, running_containerd
from tests.harness.nvml_total import build_nvml_total
from tests.harness.oci import Host, build_rootfs, default_spec, host_mounts, require_tools


@pytest.fixture(scope="session")
def rootfs_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_tools()
    return build_rootfs(tmp_path_factory.mktemp("rootfs") / "rootfs")


@pytest.fixture(scope="session")
def runc_spec() -> dict:
    require_tools()
    return default_spec()


@pytest.fixture
def gpu_env(tmp_path: Path, native: Path) -> dict[str, str]:
    """One simulated 16 GiB GPU in a directory of its own: containers get
    that directory and nothing else of the test's files."""
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(native / "sim")
    env["CGPU_SIM_CONFIG"] = str(write_sim_config(gpu / "sim.conf", gpus=1))
    env["CGPU_SIM_STATE"] = str(gpu / "sim.state")
    return env


@pytest.fixture
def host(tmp_path: Path, rootfs_template: Path, runc_spec: dict, gpu_env: dict[str, str]) -> Iterator[Host]:
    h = Host(rootfs_template, tmp_path / "gpu", gpu_env, tmp_path / "runc", runc_spec)
    yield h


@pytest.fixture
def cgpud(tmp_path: Path, gpu_env: dict[str, str]) -> Iterator[Daemon]:
    with running_daemon(tmp_path, gpu_env) as d:
        yield d


@pytest.fixture
def containerd(tmp_path: Path, cgpud: Daemon) -> Iterator[Containerd]:
    with running_containerd(tmp_path, cgpud) as c:
        yield c


@pytest.fixture
def nvml_total(tmp_path: Path) -> Path:
    """NVML's view from inside a container, built for the host's libc."""
    return build_nvml_total(tmp_path / "nvml_total")


@pytest.fixture
def mounts(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], list[str]]:
    """The host's mount table as this session's tests see it (host_mounts)."""
    ours = tmp_path_factory.getbasetemp()
    return lambda: host_mounts(ours)
