"""The seed's Kubernetes flows on a real cluster (tests/realkube/cluster.py):
real etcd, kube-apiserver, kube-controller-manager, kube-scheduler with
deploy/kube-scheduler-config.yaml and cgpu-scheduler as its extender, a
real kubelet and containerd 2 (CDI on), cgpud as the node's device plugin,
real kubectl. One node with two simulated 16 GiB GPUs; the tests share it,
in file order."""
from __future__ import annotations

import json
import re
import time

from cgpud.daemon.model import GIB
from tests.realkube.cluster import RealCluster, wait_until

MEM = "aliyun.com/gpu-mem"
CORE = "aliyun.com/gpu-core.percentage"
BURN = "cgpu-burn --alloc-until-fail 512MiB"
SHOW = f"echo MEM=$ALIYUN_COM_GPU_MEM_CONTAINER; nvml-total; {BURN}"


def _burn(logs: str) -> dict:
    return json.loads(next(line for line in logs.splitlines() if line.startswith('{"device"')))


def _instances(cluster: RealCluster) -> list[dict]:
    out = cluster.nodes[0].cgpuctl("list", "--output", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _run_pod(cluster: RealCluster, name: str, command: str, limits: dict, timeout: float = 120) -> str:
    cluster.apply([cluster.workload_pod(name, command, limits)])
    phase = cluster.wait_pod(name, ("Succeeded", "Failed"), timeout)
    logs = cluster.logs(name)
    assert phase == "Succeeded", f"{cluster.describe(name)}\n{logs}"
    return logs


def test_a_core_mem_node_shows_gpu_memory_and_core_percentage(cluster: RealCluster) -> None:
    node = cluster.nodes[0]
    cluster.start_cgpud(node)
    cluster.kubectl("label", "node", node.name, "ack.node.gpu.schedule=core_mem", "--overwrite")

    def shown() -> bool:
        a = cluster.allocatable(node)
        return a.get(MEM) == "32" and a.get(CORE) == "200"

    wait_until("the node's allocatable gpu-mem 32 and gpu-core.percentage 200", shown,
               explain=lambda: f"{cluster.allocatable(node)}\n{node.cgpud.tail() if node.cgpud else ''}")


def test_a_2_gib_pod_runs_and_sees_2_gib_in_the_driver_and_nvml(cluster: RealCluster) -> None:
    logs = _run_pod(cluster, "mem2", SHOW, {MEM: 2, CORE: 30})
    assert "MEM=2" in logs.splitlines(), logs
    assert f"NVML_TOTAL={2 * GIB}" in logs.splitlines(), logs
    burn = _burn(logs)
    assert burn["mem_total_reported"] == 2 * GIB and burn["alloc"]["until_fail_bytes"] == 2 * GIB, burn


def test_deleting_the_pod_frees_its_instance(cluster: RealCluster) -> None:
    cluster.apply([cluster.workload_pod("held", "sleep 3600", {MEM: 3})])
    cluster.wait_pod("held", ("Running",))
    uid = cluster.get("pod", "held")["metadata"]["uid"]

    def held() -> list[dict]:
        return [i for i in _instances(cluster) if uid in i["owner"]["id"]]

    [instance] = held()
    assert [g["memory_bytes"] for g in instance["grants"]] == [3 * GIB], instance
    cluster.kubectl("delete", "pod", "held", "--wait=true", timeout=120)
    wait_until("the instance of the deleted pod released", lambda: not held())
