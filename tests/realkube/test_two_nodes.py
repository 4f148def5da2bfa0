"""Two GPU nodes, each a kubelet, containerd and cgpud in a network
namespace of its own: kube-scheduler and cgpu-scheduler place across them,
and a node whose capacity address is pointed at the other's is refused."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from cgpud.node.model import GIB
from cgpud.kube.model import ANNOTATION_CAPACITY_ADDRESS, ANNOTATION_GPU_INDEX, LABEL_MODE
from tests.harness.wait import until
from tests.realkube.cluster import WAIT, RealCluster

# Minutes (slow). Beside other tests: its forwarding rule names only its own
# addresses and its driver's nodes are under its own dev_root.
pytestmark = pytest.mark.slow

MEM = "aliyun.com/gpu-mem"


def _connected(cluster: RealCluster, name: str) -> bool:
    return bool(cluster.extender_nodes().get(name, {}).get("connected"))


def test_pods_too_big_to_share_a_gpu_spread_over_both_nodes_gpus(cluster: RealCluster) -> None:
    first, second = cluster.nodes
    cluster.gpu_node(first)
    cluster.gpu_node(second)
    until(
        lambda: all(_connected(cluster, n.name) for n in cluster.nodes),
        WAIT,
        interval=0.2,
        what="both nodes in cgpu-scheduler's view",
    )
    until(lambda: cluster.allocatable(second).get(MEM) == "32", WAIT, interval=0.2, what=f"{second.name}'s allocatable")
    names = [f"big-{i}" for i in range(4)]  # 12 GiB each: one per 16 GiB GPU, four GPUs in all
    cluster.apply([cluster.workload_pod(n, "sleep 3600", {MEM: 12}) for n in names])
    try:
        for n in names:
            cluster.wait_pod(n, ("Running",), 120)
        placed = [
            (
                cluster.get("pod", n)["spec"]["nodeName"],
                cluster.get("pod", n)["metadata"]["annotations"][ANNOTATION_GPU_INDEX],
            )
            for n in names
        ]
        assert len(set(placed)) == 4 and Counter(node for node, _ in placed) == {first.name: 2, second.name: 2}, placed
        # The one on node-1's GPU 0: the simulated driver lists every GPU of
        # its node whatever device nodes a container has, so a container on
        # GPU 1 finds its GPU at ordinal 1 here (a real driver shows it only
        # the GPUs whose nodes it has: cgpud's CDI spec names just its own).
        on_second = next(n for n, p in zip(names, placed) if p == (second.name, "0"))
        out = cluster.kubectl("exec", on_second, "--", "sh", "-c", "cgpu-burn --alloc-until-fail 1GiB").stdout
        burn = json.loads(next(line for line in out.splitlines() if line.startswith('{"device"')))
        assert burn["alloc"]["until_fail_bytes"] == 12 * GIB, burn
        cluster.apply([cluster.workload_pod("one-too-many", "sleep 3600", {MEM: 12})])
        until(
            lambda: any(
                e.get("reason") == "FailedScheduling"
                for e in cluster.get("events", "--field-selector", "involvedObject.name=one-too-many")["items"]
            ),
            WAIT,
            interval=0.2,
            what="the fifth pod refused",
        )
        assert cluster.pod_phase("one-too-many") == "Pending"
    finally:
        cluster.kubectl("delete", "pods", "--all", "--grace-period=1", "--wait=true", timeout=120)


def test_with_pick_at_filter_kube_scheduler_binds_where_the_filter_picked_without_prioritize(
    cluster: RealCluster,
) -> None:
    """The real kube-scheduler, left one node by the filter, scores nothing
    (prioritize included) and binds there: binpack puts the pods together.
    Without the option the same pods cost it 3 prioritize calls."""
    first, second = cluster.nodes
    cluster.gpu_node(first)
    cluster.gpu_node(second)
    cluster.restart_extender("--pick-at-filter")
    try:
        until(
            lambda: all(_connected(cluster, n.name) for n in cluster.nodes),
            WAIT,
            interval=0.2,
            what="both nodes in the new cgpu-scheduler's view",
        )
        names = [f"picked-{i}" for i in range(3)]
        for n in names:  # one at a time: each pod's filter sees the last one's hold or reservation
            cluster.apply([cluster.workload_pod(n, "sleep 3600", {MEM: 2})])
            cluster.wait_pod(n, ("Running",), 120)
        placed = {
            (
                cluster.get("pod", n)["spec"]["nodeName"],
                cluster.get("pod", n)["metadata"]["annotations"][ANNOTATION_GPU_INDEX],
            )
            for n in names
        }
        assert len(placed) == 1, placed  # one node, one GPU: binpack, as prioritize would have scored it
        requests = cluster.extender_inspect()["requests"]
        assert requests["prioritize"] == 0 and requests["bind"] == 3 and requests["filter"] >= 3, requests
    finally:
        cluster.kubectl("delete", "pods", "--all", "--grace-period=1", "--wait=true", timeout=120)
        cluster.restart_extender()


def test_a_node_whose_capacity_address_names_the_other_node_is_refused(cluster: RealCluster) -> None:
    first, second = cluster.nodes
    until(
        lambda: all(_connected(cluster, n.name) for n in cluster.nodes),
        WAIT,
        interval=0.2,
        what="both nodes in cgpu-scheduler's view",
    )
    # Root on the API (or a node allowed to write it) points node-1 at node-0's cgpud.
    cluster.kubectl("annotate", "node", second.name, f"{ANNOTATION_CAPACITY_ADDRESS}={first.ip}:9455", "--overwrite")
    try:
        until(lambda: not _connected(cluster, second.name), 30, interval=0.2, what=f"{second.name} refused")
        assert _connected(cluster, first.name)
    finally:
        cluster.kubectl(
            "annotate", "node", second.name, f"{ANNOTATION_CAPACITY_ADDRESS}={second.ip}:9455", "--overwrite"
        )
        until(lambda: _connected(cluster, second.name), 60, interval=0.2, what=f"{second.name} back")
        assert second.cgpud is not None
        second.cgpud.stop()
        cluster.kubectl("label", "node", second.name, f"{LABEL_MODE}-")
