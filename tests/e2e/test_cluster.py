"""The cluster side end to end, several nodes on one machine
(tests/harness/cluster.py): real cgpud processes in network namespaces, each with
its own simulated GPUs and state, serving the Capacity API over TLS on its
own address; cgpu-scheduler as a real process watching them all; the test
plays kube-scheduler (filter -> prioritize -> bind, the extender JSON with
NodeNames) and each node's kubelet (Allocate); a fake API server takes the
annotations and Bindings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from cgpud.api.cgpu.v1 import capacity_pb2 as cap
from cgpud.api.cgpu.v1 import capacity_pb2_grpc as cap_grpc
from cgpud.kube.model import ANNOTATION_ASSIGNED, ANNOTATION_ASSUME_TIME, ANNOTATION_CAPACITY_ADDRESS
from cgpud.kube.model import ANNOTATION_GPU_INDEX, Resource
from tests.harness.cluster import Cluster, Extender, Outcome, post_json, schedule, schedule_once, share_pod
from tests.harness.daemon import BIN
from tests.harness.tls import make_pki
from tests.harness.api_server import node_json
from tests.harness.wait import until

pytestmark = pytest.mark.slow  # tens of seconds to minutes each

GIB = 1 << 30
NODES, GPUS, GPU_GIB, POD_GIB = 8, 2, 16, 4
CAPACITY = NODES * GPUS * GPU_GIB // POD_GIB  # 64 pods fill the cluster exactly


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(nodes=NODES, gpus=GPUS, gpu_memory=f"{GPU_GIB}GiB") as c:
        yield c


@pytest.fixture(scope="module")
def extender(cluster: Cluster) -> Iterator[Extender]:
    e = cluster.start_extender()
    cluster.wait_connected(e)
    yield e
    e.stop()


def submit(
    cluster: Cluster, extender: Extender, pods: Sequence[dict[str, Any]], threads: int = 8
) -> dict[str, tuple[Outcome, list[Outcome]]]:
    """The pods are created at once, then scheduled by `threads` workers
    (kube-scheduler's parallel binds); each retried until bound."""
    assert cluster.api is not None
    for pod in pods:
        cluster.api.state.add_pod(pod)
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(lambda p: schedule(extender.url, p, cluster.names), pods))
    return {p["metadata"]["name"]: r for p, r in zip(pods, results)}


def bound_pods(cluster: Cluster) -> dict[str, list[dict[str, Any]]]:
    """Node name -> the pods bound to it, from the API server, in the order
    they were bound (their ASSUME_TIME): the order a kubelet admits them,
    and the one cgpud's Allocate serves same-size pods in (gpushare's rule:
    an Allocate of n GiB is for the oldest assumed pod asking n GiB)."""
    assert cluster.api is not None
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in cluster.names}
    with cluster.api.state.lock:
        pods = [json.loads(json.dumps(p)) for p in cluster.api.state.pods.values()]
    for pod in pods:
        node = pod["spec"].get("nodeName")
        if node:
            out[node].append(pod)
    for node_pods in out.values():
        node_pods.sort(key=lambda p: int(p["metadata"]["annotations"].get(ANNOTATION_ASSUME_TIME, "0")))
    return out


def allocate_all(cluster: Cluster, by_node: dict[str, list[dict[str, Any]]]) -> None:
    """Every node's kubelet admits its pods (one at a time per node, the
    nodes side by side)."""

    def admit(node: str) -> None:
        for pod in by_node[node]:
            cluster.allocate(cluster.index(node), pod["metadata"]["namespace"], pod["metadata"]["name"])

    with ThreadPoolExecutor(len(by_node)) as pool:
        list(pool.map(admit, by_node))


def owner(pod: dict[str, Any], container: str = "main") -> str:
    meta = pod["metadata"]
    return f"{meta['uid']}/{meta['namespace']}/{meta['name']}/{container}"


def check_within_capacity(view: cap.NodeView) -> None:
    for g in view.gpus:
        assert 0 <= g.memory_allocated_bytes <= g.memory_total_bytes, (view.node_name, g)
        assert g.instances <= g.max_instances, (view.node_name, g)


def test_64_pods_at_once_fill_8_nodes_exactly_nothing_over_capacity_and_the_kubelets_admit_them_all(
    cluster: Cluster, extender: Extender
) -> None:
    assert cluster.api is not None
    # Each cgpud wrote where its Capacity API is on its Node.
    for node in cluster.nodes:
        annotations = cluster.api.state.node(node.name)["metadata"].get("annotations", {})
        assert annotations.get(ANNOTATION_CAPACITY_ADDRESS) == node.capacity_address

    pods = [share_pod(f"fill-{i:02d}", POD_GIB) for i in range(CAPACITY)]
    results = submit(cluster, extender, pods)
    unbound = {name: r for name, r in results.items() if r[0].node is None}
    assert not unbound, unbound
    # Every pod bound once, where the extender said; each node full.
    assert sorted(b[1] for b in cluster.api.state.bindings) == sorted(results)
    by_node = bound_pods(cluster)
    assert {n: len(p) for n, p in by_node.items()} == {n: CAPACITY // NODES for n in cluster.names}
    for node, node_pods in by_node.items():
        for pod in node_pods:
            assert results[pod["metadata"]["name"]][0].node == node
            notes = pod["metadata"]["annotations"]
            assert notes[ANNOTATION_ASSIGNED] == "false" and int(notes[ANNOTATION_ASSUME_TIME]) > 0
            assert int(notes[ANNOTATION_GPU_INDEX]) in range(GPUS)

    # The nodes' own word: nothing over capacity, every GiB held by a
    # reservation of a pod bound there, on the GPU its annotation names.
    for i, node in enumerate(cluster.nodes):
        view = cluster.get_node(i)
        check_within_capacity(view)
        assert [g.memory_allocated_bytes for g in view.gpus] == [GPU_GIB * GIB] * GPUS
        reserved = {r.pod_uid: [(s.gpu_index, s.memory_bytes) for s in r.shares] for r in view.reservations}
        assert reserved == {
            p["metadata"]["uid"]: [(int(p["metadata"]["annotations"][ANNOTATION_GPU_INDEX]), POD_GIB * GIB)]
            for p in by_node[node.name]
        }

    # Full: one more pod fits nowhere, and each node says why.
    extra = share_pod("one-too-many", POD_GIB)
    cluster.api.state.add_pod(extra)
    outcome = schedule_once(extender.url, extra, cluster.names)
    assert outcome.node is None and outcome.stage == "filter"
    assert set(outcome.failed) == set(cluster.names) and all(outcome.failed.values())
    cluster.api.state.delete_pod("default", "one-too-many")

    # The kubelets: Allocate for every pod on its node.
    allocate_all(cluster, by_node)
    for i, node in enumerate(cluster.nodes):
        instances = cluster.instances(i)
        expected = {owner(p): int(p["metadata"]["annotations"][ANNOTATION_GPU_INDEX]) for p in by_node[node.name]}
        assert {x["owner"]["id"]: x["grants"][0]["gpu"] for x in instances} == expected
        assert all([g["memory_bytes"] for g in x["grants"]] == [POD_GIB * GIB] for x in instances)
        view = cluster.get_node(i)
        assert list(view.reservations) == []  # leaked: 0
        check_within_capacity(view)
        assert [g.memory_allocated_bytes for g in view.gpus] == [GPU_GIB * GIB] * GPUS
        assert len(view.pod_instances) == CAPACITY // NODES
    for node_pods in bound_pods(cluster).values():
        for pod in node_pods:
            assert pod["metadata"]["annotations"][ANNOTATION_ASSIGNED] == "true"


def test_bad_extender_input_is_refused_with_a_clear_error_and_changes_nothing(
    cluster: Cluster, extender: Extender
) -> None:
    assert cluster.api is not None
    before = [(v.incarnation, v.revision) for v in map(cluster.get_node, range(NODES))]
    bindings = len(cluster.api.state.bindings)

    status, body = post_json(f"{extender.url}/filter", b'{"Pod": {"metadata": ')
    assert status == 400 and "JSON" in body["Error"], body
    status, body = post_json(f"{extender.url}/filter", {"Pod": "not a pod", "NodeNames": cluster.names})
    assert status == 400 and body["Error"], body
    status, body = post_json(f"{extender.url}/prioritize", [1, 2, 3])
    assert status == 400 and body["Error"], body
    status, body = post_json(f"{extender.url}/bind", {"PodName": 7})
    assert status == 400 and body["Error"], body

    pod = cluster.api.state.add_pod(share_pod("stray", 1))
    status, body = post_json(
        f"{extender.url}/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["node-0", "no-such-node"]}
    )
    assert status == 200, body
    failed = {**(body.get("FailedNodes") or {}), **(body.get("FailedAndUnresolvableNodes") or {})}
    assert "unknown" in failed["no-such-node"]
    assert "no-such-node" not in (body.get("NodeNames") or [])
    status, body = post_json(
        f"{extender.url}/bind",
        {"PodName": "stray", "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": "no-such-node"},
    )
    assert status == 200 and "unknown" in body["Error"], body
    assert "nodeName" not in cluster.api.state.pod("default", "stray")["spec"]
    cluster.api.state.delete_pod("default", "stray")

    assert [(v.incarnation, v.revision) for v in map(cluster.get_node, range(NODES))] == before
    assert len(cluster.api.state.bindings) == bindings


def test_capacity_api_across_the_network_refuses_untrusted_clients_and_oversized_reserves(cluster: Cluster) -> None:
    assert cluster.pki is not None
    before = cluster.get_node(3)
    request = cap.ReserveRequest(
        pod_uid="u-big",
        pod_namespace="default",
        pod_name="big",
        shares=[cap.Share(gpu_index=0, memory_bytes=(GPU_GIB + 1) * GIB)],
    )
    with cluster.capacity_channel(3) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            cap_grpc.CapacityStub(channel).Reserve(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.value.details()

    untrusted = cluster.capacity_channel(3, cert=cluster.pki.untrusted_cert, key=cluster.pki.untrusted_key)
    anonymous = grpc.secure_channel(
        cluster.nodes[3].capacity_address, grpc.ssl_channel_credentials(root_certificates=cluster.pki.ca.read_bytes())
    )
    plaintext = grpc.insecure_channel(cluster.nodes[3].capacity_address)
    for channel in (untrusted, anonymous, plaintext):
        with channel, pytest.raises(grpc.RpcError) as refused:
            cap_grpc.CapacityStub(channel).Reserve(
                cap.ReserveRequest(pod_uid="u-x", shares=[cap.Share(gpu_index=0, memory_bytes=GIB)]), timeout=5
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    after = cluster.get_node(3)
    assert (after.incarnation, after.revision, list(after.reservations)) == (
        before.incarnation,
        before.revision,
        list(before.reservations),
    )


def test_without_a_node_file_the_extender_finds_the_nodes_by_their_annotation_through_the_api_server(
    cluster: Cluster,
) -> None:
    assert cluster.api is not None
    with cluster.api.state.lock:
        cluster.api.state.nodes["cpu-only"] = node_json("cpu-only")  # no cgpud: no capacity-address
    extender = cluster.start_extender(node_file=False)
    try:
        cluster.wait_connected(extender)
        status, view = extender.get("/inspect")
        assert status == 200
        assert {
            n["name"]: n["capacity_address"] for n in view["nodes"] if n["name"] != "cpu-only"
        } == cluster.addresses()
        body = schedule_once_filter(extender, share_pod("looker", 1), [*cluster.names, "cpu-only"])
        failed = {**(body.get("FailedNodes") or {}), **(body.get("FailedAndUnresolvableNodes") or {})}
        assert "not a cgpu node" in failed["cpu-only"], failed
        assert "cpu-only" not in (body.get("NodeNames") or [])
    finally:
        extender.stop()
        with cluster.api.state.lock:
            del cluster.api.state.nodes["cpu-only"]


def test_memory_and_compute_pods_on_core_mem_nodes_fill_them_by_compute_and_the_kubelets_admit_both() -> None:
    # 2 GiB and 30% each: memory would take 8 a GPU, compute takes 3 (90%).
    with Cluster(nodes=2, gpus=GPUS, gpu_memory=f"{GPU_GIB}GiB", mode="core_mem") as cluster:
        extender = cluster.start_extender()
        cluster.wait_connected(extender)
        results = submit(cluster, extender, [share_pod(f"mc-{i}", 2, core=30) for i in range(2 * GPUS * 3)], 6)
        assert all(r[0].node for r in results.values()), results
        extra = share_pod("mc-extra", 2, core=30)
        outcome = schedule_once(extender.url, extra, cluster.names)
        assert outcome.node is None and set(outcome.failed) == set(cluster.names)
        assert all("compute" in reason for reason in outcome.failed.values()), outcome.failed

        by_node = bound_pods(cluster)
        allocate_all(cluster, by_node)
        for i, node in enumerate(cluster.nodes):
            view = cluster.get_node(i)
            assert [(g.memory_allocated_bytes, g.core_allocated_percent) for g in view.gpus] == [(6 * GIB, 90)] * GPUS
            assert list(view.reservations) == []
            instances = cluster.instances(i)
            assert {x["owner"]["id"] for x in instances} == {owner(p) for p in by_node[node.name]}
            assert all(
                [(g["memory_bytes"], g["core_percent"]) for g in x["grants"]] == [(2 * GIB, 30)] for x in instances
            )


def test_deleted_pods_give_their_share_back_admitted_or_not_and_the_next_pods_get_it() -> None:
    # 2 nodes x 1 GPU x 16 GiB, 8 GiB pods: 4 fill them.
    with Cluster(nodes=2, gpus=1, gpu_memory=f"{GPU_GIB}GiB") as cluster:
        assert cluster.api is not None
        extender = cluster.start_extender()
        cluster.wait_connected(extender)
        first = submit(cluster, extender, [share_pod(f"g-{i}", 8) for i in range(4)])
        assert all(r[0].node for r in first.values()), first
        by_node = bound_pods(cluster)
        admitted = by_node["node-0"][0]  # the kubelet admits the first bound; the others stay reserved only
        cluster.allocate(0, "default", admitted["metadata"]["name"])
        reserved = by_node["node-1"][0]
        assert schedule_once(extender.url, share_pod("nope", 8), cluster.names).node is None

        # Deleted: one admitted (its instance goes), one only reserved (its reservation goes).
        cluster.delete_pod("default", admitted["metadata"]["name"])
        cluster.delete_pod("default", reserved["metadata"]["name"])
        until(
            lambda: all(v.gpus[0].memory_allocated_bytes <= 8 * GIB for v in map(cluster.get_node, range(2))),
            timeout=15,
            interval=0.1,
            what="the deleted pods' memory to be given back on both nodes",
            explain=lambda: f"allocated: {[cluster.get_node(i).gpus[0].memory_allocated_bytes for i in range(2)]}",
        )
        views = [cluster.get_node(i) for i in range(2)]
        assert [v.gpus[0].memory_allocated_bytes for v in views] == [8 * GIB, 8 * GIB]
        assert cluster.instances(0) == []
        assert [r.pod_uid for r in views[1].reservations] == [by_node["node-1"][1]["metadata"]["uid"]]

        second = submit(cluster, extender, [share_pod(f"h-{i}", 8) for i in range(2)])
        assert sorted(r[0].node for r in second.values()) == ["node-0", "node-1"], second
        by_node = bound_pods(cluster)
        allocate_all(cluster, by_node)
        for i, node in enumerate(cluster.nodes):
            view = cluster.get_node(i)
            assert list(view.reservations) == [] and view.gpus[0].memory_allocated_bytes == GPU_GIB * GIB
            assert {x["owner"]["id"] for x in cluster.instances(i)} == {owner(p) for p in by_node[node.name]}


# ---- a node dies mid-run ---------------------------------------------------------------------


KILL_NODES = 4
KILL_CAPACITY = KILL_NODES * GPUS * GPU_GIB // POD_GIB  # 32


def test_kill_9_of_a_node_mid_run_keeps_its_pods_and_new_pods_avoid_it_until_it_is_back() -> None:
    with Cluster(nodes=KILL_NODES, gpus=GPUS, gpu_memory=f"{GPU_GIB}GiB") as cluster:
        assert cluster.api is not None
        extender = cluster.start_extender()
        cluster.wait_connected(extender)

        # Few enough that the victim keeps room to be used again (it holds
        # at most 4 + the 2 pods in flight when it is killed).
        first = submit(cluster, extender, [share_pod(f"a-{i}", POD_GIB) for i in range(4)])
        assert all(r[0].node for r in first.values()), first
        counts = Counter(r[0].node for r in first.values())
        victim_name = counts.most_common(1)[0][0]
        victim = cluster.index(victim_name)
        placed = {p["metadata"]["name"]: p for p in bound_pods(cluster)[victim_name]}
        assert placed

        # Pods keep coming while the victim's cgpud is killed.
        second = [share_pod(f"b-{i}", POD_GIB) for i in range(10)]
        for pod in second:
            cluster.api.state.add_pod(pod)
        done: dict[str, tuple[Outcome, list[Outcome]]] = {}
        lock = threading.Lock()

        def run(pod: dict[str, Any]) -> None:
            result = schedule(extender.url, pod, cluster.names)
            with lock:
                done[pod["metadata"]["name"]] = result

        workers = []
        at_kill = 0
        for n, pod in enumerate(second):
            workers.append(threading.Thread(target=run, args=(pod,)))
            workers[-1].start()
            if n == 1:
                cluster.kill(victim)
                at_kill = len(cluster.api.state.bindings)
            time.sleep(0.02)
        for w in workers:
            w.join(timeout=60)
        assert len(done) == len(second) and all(r[0].node for r in done.values()), done
        assert len(cluster.api.state.bindings) > at_kill  # it was mid-run: binding went on after the kill

        # The extender reports it down, with a reason; new pods avoid it.
        probe = share_pod("probe", POD_GIB)
        outcome = schedule_once_filter(extender, probe, cluster.names)
        assert victim_name not in (outcome.get("NodeNames") or [])
        failed = {**(outcome.get("FailedNodes") or {}), **(outcome.get("FailedAndUnresolvableNodes") or {})}
        assert "down" in failed[victim_name], failed
        third = submit(cluster, extender, [share_pod(f"c-{i}", POD_GIB) for i in range(6)])
        assert all(r[0].node not in (None, victim_name) for r in third.values()), third

        # Its pods placed before the kill keep their binding and annotations.
        for name, pod in placed.items():
            now = cluster.api.state.pod("default", name)
            assert now["spec"]["nodeName"] == victim_name
            assert now["metadata"]["annotations"] == pod["metadata"]["annotations"]

        cluster.restart(victim)
        cluster.wait_connected(extender)
        by_node = bound_pods(cluster)
        # Whatever was bound to it, it had reserved before it died, and kept.
        # (A pod it reserved but whose bind the kill cut short was bound
        # elsewhere on retry: the node gives that one back at its next sweep.)
        bound_there = {p["metadata"]["uid"] for p in by_node[victim_name]}

        def held() -> set[str]:
            return {r.pod_uid for r in cluster.get_node(victim).reservations}

        until(
            lambda: held() == bound_there,
            timeout=10,
            interval=0.1,
            what="the restarted node's reservations to be the pods bound to it",
            explain=lambda: f"it holds {held()}, bound to it: {bound_there}",
        )

        # Back: it is used again. Fill the cluster; every node ends full.
        assert len(by_node[victim_name]) < KILL_CAPACITY // KILL_NODES
        left = KILL_CAPACITY - sum(len(p) for p in by_node.values())
        fourth = submit(cluster, extender, [share_pod(f"d-{i}", POD_GIB) for i in range(left)])
        assert all(r[0].node for r in fourth.values()), fourth
        assert victim_name in {r[0].node for r in fourth.values()}
        by_node = bound_pods(cluster)
        assert {n: len(p) for n, p in by_node.items()} == {n: KILL_CAPACITY // KILL_NODES for n in cluster.names}

        allocate_all(cluster, by_node)
        for i, node in enumerate(cluster.nodes):
            view = cluster.get_node(i)
            check_within_capacity(view)
            assert list(view.reservations) == []
            assert {x["owner"]["id"] for x in cluster.instances(i)} == {owner(p) for p in by_node[node.name]}


def schedule_once_filter(extender: Extender, pod: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    status, body = extender.post("filter", {"Pod": pod, "Nodes": None, "NodeNames": list(names)})
    assert status == 200, body
    return dict(body)


# ---- kubectl ---------------------------------------------------------------------------------


KUBECTL = Path("/usr/bin/kubectl")


def _kubectl(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    assert cluster.api is not None
    env = dict(os.environ, PATH=f"{BIN}:/usr/bin:/bin", KUBECONFIG=str(cluster.api.kubeconfig(cluster.root / "kc")))
    return subprocess.run([str(KUBECTL), *args], env=env, capture_output=True, text=True, timeout=60)


def test_real_kubectl_lists_the_plugin_and_inspect_cgpu_prints_every_test_node(
    cluster: Cluster, extender: Extender
) -> None:
    assert cluster.pki is not None
    listed = _kubectl(cluster, "plugin", "list")
    assert listed.returncode == 0, listed.stderr
    assert str(BIN / "kubectl-inspect-cgpu") in listed.stdout.splitlines()

    for source in (
        ["--extender", extender.url],
        [
            "--nodes",
            str(cluster.node_file()),
            "--tls-cert",
            str(cluster.pki.client_cert),
            "--tls-key",
            str(cluster.pki.client_key),
            "--tls-ca",
            str(cluster.pki.ca),
        ],
    ):
        shown = _kubectl(cluster, "inspect", "cgpu", *source)
        assert shown.returncode == 0, shown.stderr
        rows = shown.stdout.splitlines()
        assert rows[0].split()[:2] == ["NAME", "IPADDRESS"], rows
        by_name = {r.split()[0]: r.split() for r in rows[1:] if r.startswith("node-")}
        assert sorted(by_name) == sorted(cluster.names), shown.stdout
        for node in cluster.nodes:
            row = by_name[node.name]
            assert row[1] == node.ip
            allocated, total = map(int, row[-1].split("/"))  # GPU Memory(GiB)
            view = cluster.get_node(node.index)
            assert total == GPUS * GPU_GIB
            assert allocated == sum(g.memory_allocated_bytes for g in view.gpus) // GIB
        in_cluster = re.search(r"Allocated/Total GPU Memory In Cluster:\s+(\d+)/(\d+) \(\d+%\)", shown.stdout)
        assert in_cluster, shown.stdout
        assert int(in_cluster[2]) == NODES * GPUS * GPU_GIB
        assert int(in_cluster[1]) == sum(int(by_name[n][-1].split("/")[0]) for n in cluster.names)


def test_with_kube_schedulers_certificate_a_bind_reads_no_pod_and_never_binds_a_changed_gpu_request() -> None:
    """As deploy/ runs it (HTTPS, a client CA): only kube-scheduler calls
    cgpu-scheduler, so a bind places the pod kube-scheduler sent at filter
    and reads nothing from the API server; the Binding names that copy's
    resourceVersion. A pod written between its filter and its bind is read
    once: a label does not stop its bind, a changed GPU request does (the
    node keeps nothing for it), and filtered again as it is now it binds."""
    with Cluster(nodes=1, gpus=1, gpu_memory=f"{GPU_GIB}GiB") as cluster:
        assert cluster.api is not None
        extender = cluster.start_extender(serving=make_pki(cluster.root / "extender-pki"))
        cluster.wait_connected(extender)
        api = cluster.api.state
        names = cluster.names

        def filtered(name: str) -> dict[str, Any]:
            sent = api.pod("default", name)  # kube-scheduler's informer copy
            code, out = extender.post("filter", {"Pod": sent, "Nodes": None, "NodeNames": names})
            assert code == 200 and out["NodeNames"] == names, out
            return sent

        def bind(sent: dict[str, Any]) -> tuple[int, Any]:
            meta = sent["metadata"]
            args = {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": names[0]}
            return extender.post("bind", args)

        def written(name: str, change: Callable[[dict[str, Any]], None]) -> None:
            with api.lock:  # as a PATCH would, with a new resourceVersion
                change(api.pods[("default", name)])
                api.new_version(api.pods[("default", name)])

        def reads(since: int) -> int:
            # Pods only: the node source's watch may still be starting (a GET of /api/v1/nodes).
            return len([r for r in api.requests[since:] if r[0] == "GET" and "/pods" in r[1]])

        api.add_pod(share_pod("kept", 2))
        sent = filtered("kept")
        before = len(api.requests)
        assert bind(sent) == (200, {"Error": ""})
        assert reads(before) == 0
        bound = api.pod("default", "kept")
        assert bound["spec"]["nodeName"] == names[0] and bound["metadata"]["annotations"][ANNOTATION_GPU_INDEX] == "0"

        api.add_pod(share_pod("labelled", 2))
        sent = filtered("labelled")
        written("labelled", lambda p: p["metadata"].setdefault("labels", {}).update(team="b"))
        before = len(api.requests)
        assert bind(sent) == (200, {"Error": ""})
        assert reads(before) == 1 and api.pod("default", "labelled")["spec"]["nodeName"] == names[0]

        api.add_pod(share_pod("grown", 2))
        sent = filtered("grown")
        written(
            "grown", lambda p: p["spec"]["containers"][0]["resources"]["limits"].update({Resource.GPU_MEM.value: "4"})
        )
        code, out = bind(sent)
        assert code == 200 and "changed its GPU request" in out["Error"], out
        assert api.pod("default", "grown")["spec"].get("nodeName") is None
        uid = sent["metadata"]["uid"]
        assert all(r.pod_uid != uid for r in cluster.get_node(0).reservations)
        assert bind(filtered("grown")) == (200, {"Error": ""})
        assert [
            s.memory_bytes for s in next(r for r in cluster.get_node(0).reservations if r.pod_uid == uid).shares
        ] == [4 * GIB]
