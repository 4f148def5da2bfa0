"""cgpud as deploy/cgpud-daemonset.yaml runs it, under the real DaemonSet
controller and kubelet (RealCluster.cgpud_daemonset lists what differs on
this machine and why): it lands on the labelled node, authenticates with
its pod's bound token (which deploy/cgpud-admission-policy.yaml checks),
registers with the kubelet, gives a pod its limit through CDI, and a
replacement pod after a delete keeps every instance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cgpud.node.model import GIB
from cgpud.kube.model import ANNOTATION_ASSIGNED, LABEL_MODE
from tests.harness.wait import until
from tests.realkube.cluster import WAIT, RealCluster, RealNode

# Minutes (slow). Beside other tests: its forwarding rule names only its own
# addresses and its driver's nodes are under its own dev_root.
pytestmark = pytest.mark.slow

MEM = "aliyun.com/gpu-mem"
SELECTOR = "app.kubernetes.io/name=cgpud"


def _cgpud_pods(cluster: RealCluster) -> list[dict]:
    return cluster.get("pods", "-n", "kube-system", "-l", SELECTOR)["items"]


def _listed(node: RealNode, socket: str) -> list[dict] | None:
    """`cgpuctl list` as JSON, or None while cgpud does not answer it."""
    out = node.cgpuctl("list", "--output", "json", socket=Path(socket))
    if out.returncode != 0:
        return None
    return list(json.loads(out.stdout))


def _running_cgpud(cluster: RealCluster, other_than: str = "") -> str:
    def running() -> str:
        return next(
            (
                p["metadata"]["name"]
                for p in _cgpud_pods(cluster)
                if p["status"].get("phase") == "Running"
                and p["metadata"]["name"] != other_than
                and all(c.get("ready") for c in p["status"].get("containerStatuses", []))
            ),
            "",
        )

    until(
        lambda: bool(running()),
        WAIT,
        interval=0.2,
        what="a running cgpud pod",
        explain=lambda: "\n".join(cluster.describe(p["metadata"]["name"], "kube-system") for p in _cgpud_pods(cluster)),
    )
    return running()


def test_cgpud_as_the_daemonset_gives_a_pod_its_limit_and_a_replaced_cgpud_pod_keeps_it(cluster: RealCluster) -> None:
    node = cluster.nodes[0]
    if node.cgpud is not None:  # one device plugin per node: the host service steps aside
        node.cgpud.stop()
        node.cgpud = None
    cluster.kubectl("label", "node", node.name, f"{LABEL_MODE}=core_mem", "--overwrite")
    ds = cluster.cgpud_daemonset(node)
    socket = next(a for a in ds["spec"]["template"]["spec"]["containers"][0]["command"] if a.endswith("cgpud.sock"))
    cluster.apply([ds])
    try:
        first = _running_cgpud(cluster)
        until(
            lambda: cluster.allocatable(node).get(MEM) == "32",
            WAIT,
            interval=0.2,
            what="the node's allocatable from the DaemonSet's cgpud",
            explain=lambda: cluster.kubectl("logs", "-n", "kube-system", first, check=False).stdout[-3000:],
        )
        cluster.apply([cluster.workload_pod("under-ds", "sleep 3600", {MEM: 2})])
        cluster.wait_pod("under-ds", ("Running",))
        out = cluster.kubectl("exec", "under-ds", "--", "sh", "-c", "cgpu-burn --alloc-until-fail 512MiB").stdout
        burn = json.loads(next(line for line in out.splitlines() if line.startswith('{"device"')))
        assert burn["mem_total_reported"] == 2 * GIB and burn["alloc"]["until_fail_bytes"] == 2 * GIB, burn
        # cgpud's Allocate wrote the pod's annotation with the pod's bound
        # token, through deploy/cgpud-admission-policy.yaml
        assert cluster.get("pod", "under-ds")["metadata"]["annotations"][ANNOTATION_ASSIGNED] == "true"
        listed = node.cgpuctl("list", "--output", "json", socket=socket)
        before = json.loads(listed.stdout)
        assert len(before) == 1, listed

        cluster.kubectl("delete", "pod", "-n", "kube-system", first, "--wait=true", timeout=120)
        second = _running_cgpud(cluster, other_than=first)
        assert second != first
        # A new cgpud may refuse a connection or two while its gRPC server
        # settles after READY; what must hold is that it lists what the old one did.
        until(
            lambda: _listed(node, socket) == before,
            WAIT,
            interval=0.2,
            what="the replacement listing the instance the old cgpud had",
            explain=lambda: (
                f"{node.cgpuctl('list', '--output', 'json', socket=socket)!r}\n"
                + cluster.kubectl("logs", "-n", "kube-system", second, check=False).stdout[-3000:]
            ),
        )
        out = cluster.kubectl("exec", "under-ds", "--", "sh", "-c", "cgpu-burn --alloc-until-fail 512MiB").stdout
        assert (
            json.loads(next(line for line in out.splitlines() if line.startswith('{"device"')))["alloc"][
                "until_fail_bytes"
            ]
            == 2 * GIB
        )
    finally:
        cluster.kubectl("delete", "pod", "under-ds", "--grace-period=1", "--wait=true", check=False, timeout=120)
        until(
            lambda: node.cgpuctl("list", "--output", "json", socket=socket).stdout.strip() in ("[]", ""),
            60,
            interval=0.2,
            what="the instance released",
        )
        cluster.kubectl("delete", "daemonset", "-n", "kube-system", "cgpud", "--wait=true", timeout=120)
        until(lambda: not _cgpud_pods(cluster), WAIT, interval=0.2, what="no cgpud pod")
