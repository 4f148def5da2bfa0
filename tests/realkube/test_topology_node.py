"""A topology node in a real cluster: a cluster of its own whose node has
4 simulated GPUs in two NVLink-bridged pairs on two sockets
(`nvlink2x2`, cgpud/cli/sim_topology.py). Pods ask for aliyun.com/gpu;
the real kubelet asks cgpud's GetPreferredAllocation which GPUs to give
and cgpud answers by how they are joined (cgpud.node.topology).

One pod takes one GPU (GPU 0: all four are alike then); cgpud reads that
from the kubelet's pod-resources and cgpu-scheduler's view shows it. A
second pod that asks for two (filtered and scored by cgpu-scheduler's
second extender entry, bound by kube-scheduler) gets the linked pair 2-3,
not GPUs 1 and 2 (the next in GPU order, on two sockets with no link)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cgpud.kube.model import ANNOTATION_GPU_INDEX, LABEL_MODE, Resource
from tests.harness.wait import until
from tests.realkube.build import KubeBinaries
from tests.realkube.cluster import WAIT, RealCluster

GPU = Resource.GPU_TOPOLOGY.value
SHOW_INDEX = f'echo "IDX=${ANNOTATION_GPU_INDEX}"'


@pytest.fixture(scope="module")
def topology_cluster(kube_binaries: KubeBinaries) -> Iterator[RealCluster]:
    with RealCluster(kube_binaries, nodes=1, gpus=4, topology="nvlink2x2") as c:
        node = c.nodes[0]
        c.start_cgpud(node)
        c.kubectl("label", "node", node.name, f"{LABEL_MODE}=topology", "--overwrite")
        until(
            lambda: c.allocatable(node).get(GPU) == "4",
            WAIT,
            interval=0.2,
            what=f"allocatable {GPU}: 4",
            explain=lambda: f"{c.allocatable(node)}\n{node.cgpud.tail() if node.cgpud else ''}",
        )
        yield c


def _index(logs: str) -> str:
    return next(line.removeprefix("IDX=") for line in logs.splitlines() if line.startswith("IDX="))


def test_two_gpus_go_to_the_linked_pair_the_kubelet_is_told_of(topology_cluster: RealCluster) -> None:
    c = topology_cluster
    c.apply([c.workload_pod("one", f"{SHOW_INDEX}; sleep 3600", {GPU: 1})])
    c.wait_pod("one", ("Running",))
    until(lambda: "IDX=" in c.logs("one"), WAIT, interval=0.2, what="pod one's index in its log")
    assert _index(c.logs("one")) == "0"
    # cgpud keeps no instance for a whole GPU: its sweep reads the kubelet's
    # pod-resources, and cgpu-scheduler's view of the node shows GPU 0 taken.
    node = c.nodes[0].name

    def held() -> list[int]:
        return [g["instances"] for g in c.extender_view().get(node, {}).get("gpus", [])]

    until(
        lambda: held() == [1, 0, 0, 0],
        WAIT,
        interval=0.2,
        what="GPU 0 held in cgpu-scheduler's view",
        explain=lambda: str(held()),
    )
    pods = c.extender_view()[node]["pods"]
    assert [(p["pod_namespace"], p["pod_name"], p["gpus"][0][0]) for p in pods] == [("default", "one", 0)], pods
    c.apply([c.workload_pod("two", SHOW_INDEX, {GPU: 2})])
    phase = c.wait_pod("two", ("Succeeded", "Failed"), 120)
    logs = c.logs("two")
    assert phase == "Succeeded", f"{c.describe('two')}\n{logs}"
    assert _index(logs) == "2,3", logs  # GPU order would have given 1,2: no link, two sockets
