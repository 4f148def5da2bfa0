"""Fixtures of the real-cluster tests: the binaries (built once, cached
outside the clone) and one cluster for this folder's tests, shared by them in
order (starting one takes about half a minute); each test module leaves it
as it found it: drained, core_mem, cgpud running. Two nodes: node-1 has no
GPU role (no label, no cgpud) until test_two_nodes.py gives it one."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.realkube.build import KubeBinaries, build
from tests.realkube.cluster import RealCluster


@pytest.fixture(scope="session")
def kube_binaries() -> KubeBinaries:
    if os.geteuid() != 0:
        raise AssertionError("the real-cluster tests need root (network namespaces, containerd, kubelet)")
    return build()


@pytest.fixture(scope="package")  # gone before the tests after this folder: none of them expects a driver
def driver_device_nodes() -> Iterator[list[str]]:
    """What the NVIDIA driver makes on a GPU host, /dev/nvidiactl,
    /dev/nvidia-uvm(-tools) and /dev/nvidia<minor> for the simulated GPUs'
    minor numbers (0, 1), as character devices with the driver's major
    (195; uvm's is dynamic): containerd copies them into containers as
    cgpud's answers name them. Nothing opens them. Made only where the host
    has none (a real GPU host keeps its own), removed afterwards."""
    wanted = {
        "/dev/nvidiactl": 255,
        "/dev/nvidia-uvm": 254,
        "/dev/nvidia-uvm-tools": 253,
        "/dev/nvidia0": 0,
        "/dev/nvidia1": 1,
    }
    made = []
    try:
        if not Path("/dev/nvidiactl").exists():
            for path, minor in wanted.items():
                os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(195, minor))
                made.append(path)
        yield list(wanted)
    finally:
        for path in made:
            os.unlink(path)


@pytest.fixture(scope="package")
def cluster(kube_binaries: KubeBinaries, driver_device_nodes: list[str]) -> Iterator[RealCluster]:
    with RealCluster(kube_binaries, nodes=2, gpus=2) as c:  # node-1 joins in test_two_nodes.py
        yield c
