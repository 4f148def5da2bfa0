"""Fixtures of the real-cluster tests: the binaries (built once, cached
outside the clone) and one cluster for this folder's tests, shared by them in
order (starting one takes about half a minute); each test module leaves it
as it found it: drained, core_mem, cgpud running. Two nodes: node-1 has no
GPU role (no label, no cgpud) until test_two_nodes.py gives it one."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.realkube.build import KubeBinaries, build
from tests.realkube.cluster import RealCluster


@pytest.fixture(scope="session")
def kube_binaries() -> KubeBinaries:
    if os.geteuid() != 0:
        raise AssertionError("the real-cluster tests need root (network namespaces, containerd, kubelet)")
    return build()


@pytest.fixture(scope="package")
def cluster(kube_binaries: KubeBinaries) -> Iterator[RealCluster]:
    with RealCluster(kube_binaries, nodes=2, gpus=2) as c:  # node-1 joins in test_two_nodes.py
        yield c
