"""deploy/cgpud-rbac.yaml and deploy/cgpud-admission-policy.yaml on a real
API server: cgpud's ServiceAccount token, bound to its node's Node as a
DaemonSet pod's token is bound to its node, may change what cgpud changes
on its own node and nothing else. Each test plays root on that node using
cgpud's credentials with real kubectl."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.kube.model import ANNOTATION_ASSIGNED, ANNOTATION_CAPACITY_ADDRESS, LABEL_MODE
from tests.realkube.cluster import RealCluster, kubeconfig

# Minutes (slow). Beside other tests: its forwarding rule names only its own
# addresses and its driver's nodes are under its own dev_root.
pytestmark = pytest.mark.slow

OTHER = "node-elsewhere"  # a second Node with no kubelet: what a compromised node would reach for


@pytest.fixture(scope="module")
def setting(cluster: RealCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    node = cluster.nodes[0]
    cluster.apply([{"apiVersion": "v1", "kind": "Node", "metadata": {"name": OTHER, "labels": {LABEL_MODE: "cgpu"}}}])
    mine = cluster.workload_pod("on-mine", "sleep 3600", node=node.name)
    theirs = cluster.workload_pod("on-theirs", "sleep 3600")
    theirs["spec"]["nodeName"] = OTHER  # bound there; no kubelet runs it
    cluster.apply([mine, theirs])
    cluster.wait_pod("on-mine", ("Running",))
    d = tmp_path_factory.mktemp("admission")
    server = cluster.api_url("127.0.0.1")
    bound = cluster.token("cgpud", "kube-system", "--bound-object-kind", "Node", "--bound-object-name", node.name)
    yield {
        "bound": kubeconfig(d / "bound", server, cluster.pki.ca, token=bound),
        "unbound": kubeconfig(d / "unbound", server, cluster.pki.ca, token=cluster.token("cgpud")),
    }
    cluster.kubectl("delete", "pod", "on-mine", "on-theirs", "--grace-period=0", "--force", "--wait=false")
    cluster.kubectl("delete", "node", OTHER)


def _as_cgpud(
    cluster: RealCluster, setting: dict[str, Path], *args: str, which: str = "bound"
) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(*args, kubeconfig=setting[which], check=False)


def _patch(kind: str, name: str, body: dict) -> list[str]:
    return ["patch", kind, name, "--type", "merge", "-p", json.dumps(body)]


def _denied(done: subprocess.CompletedProcess[str], message: str) -> None:
    assert done.returncode != 0, done.stdout
    assert message in done.stderr, done.stderr


def test_cgpud_may_write_its_own_nodes_capacity_address_and_card_labels(cluster: RealCluster, setting) -> None:
    node = cluster.nodes[0]
    done = _as_cgpud(
        cluster,
        setting,
        *_patch(
            "node",
            node.name,
            {
                "metadata": {
                    "annotations": {ANNOTATION_CAPACITY_ADDRESS: f"{node.ip}:9455"},
                    "labels": {
                        "aliyun.accelerator/nvidia_count": "2",
                        "nvidia.com/mig.capable": "false",  # GPU feature discovery's, as the MIG strategies write
                        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                    },
                }
            },
        ),
    )
    assert done.returncode == 0, done.stderr


def test_cgpud_may_not_relabel_its_own_node_to_another_mode(cluster: RealCluster, setting) -> None:
    done = _as_cgpud(
        cluster, setting, *_patch("node", cluster.nodes[0].name, {"metadata": {"labels": {LABEL_MODE: "share"}}})
    )
    _denied(done, "cgpud may change only its Node's card labels")
    assert cluster.get("node", cluster.nodes[0].name)["metadata"]["labels"].get(LABEL_MODE) != "share"


def test_cgpud_may_not_point_another_nodes_capacity_address_anywhere(cluster: RealCluster, setting) -> None:
    done = _as_cgpud(
        cluster,
        setting,
        *_patch(
            "node", OTHER, {"metadata": {"annotations": {ANNOTATION_CAPACITY_ADDRESS: f"{cluster.nodes[0].ip}:9455"}}}
        ),
    )
    _denied(done, f"cgpud on node {cluster.nodes[0].name} may change only its own Node")


def test_cgpud_may_mark_a_pod_of_its_node_assigned_and_change_nothing_else(cluster: RealCluster, setting) -> None:
    done = _as_cgpud(
        cluster, setting, *_patch("pod", "on-mine", {"metadata": {"annotations": {ANNOTATION_ASSIGNED: "true"}}})
    )
    assert done.returncode == 0, done.stderr
    _denied(
        _as_cgpud(cluster, setting, *_patch("pod", "on-mine", {"metadata": {"labels": {"owned": "yes"}}})),
        "cgpud may change only a pod's ALIYUN_COM_GPU_MEM_ASSIGNED annotation",
    )
    _denied(
        _as_cgpud(cluster, setting, "set", "image", "pod/on-mine", "main=evil.example/miner:1"),
        "cgpud may change only a pod's ALIYUN_COM_GPU_MEM_ASSIGNED annotation",
    )


def test_cgpud_may_not_touch_a_pod_on_another_node(cluster: RealCluster, setting) -> None:
    done = _as_cgpud(
        cluster, setting, *_patch("pod", "on-theirs", {"metadata": {"annotations": {ANNOTATION_ASSIGNED: "true"}}})
    )
    _denied(done, f"cgpud on node {cluster.nodes[0].name} may change only pods bound to that node")


def test_a_cgpud_token_bound_to_no_node_may_change_nothing(cluster: RealCluster, setting) -> None:
    done = _as_cgpud(
        cluster,
        setting,
        *_patch("pod", "on-mine", {"metadata": {"annotations": {ANNOTATION_ASSIGNED: "true"}}}),
        which="unbound",
    )
    _denied(done, "cgpud's credentials name no node")


def test_rbac_gives_cgpud_no_delete_and_no_secrets(cluster: RealCluster, setting) -> None:
    _denied(_as_cgpud(cluster, setting, "delete", "pod", "on-theirs"), "Forbidden")
    _denied(_as_cgpud(cluster, setting, "get", "secrets", "-n", "kube-system"), "Forbidden")


def test_cgpud_may_record_events_about_pods_only_as_its_own_node(cluster: RealCluster, setting) -> None:
    node = cluster.nodes[0]

    def event(name: str, host: str) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": name, "namespace": "default"},
                "involvedObject": {"kind": "Pod", "name": "on-mine", "namespace": "default"},
                "reason": "CgpuAnnotationInvalid",
                "message": "m",
                "type": "Warning",
                "source": {"component": "cgpud", "host": host},
            }
        )

    ok = cluster.kubectl("create", "-f", "-", kubeconfig=setting["bound"], input=event("e-own", node.name), check=False)
    assert ok.returncode == 0, ok.stderr
    forged = cluster.kubectl(
        "create", "-f", "-", kubeconfig=setting["bound"], input=event("e-forged", OTHER), check=False
    )
    _denied(forged, "cgpud may record only events about pods, as its own node")
