"""The seed's Kubernetes flows on a real cluster (tests/realkube/cluster.py):
real etcd, kube-apiserver, kube-controller-manager, kube-scheduler with
deploy/kube-scheduler-config.yaml and cgpu-scheduler as its extender, a
real kubelet and containerd 2 (CDI on), cgpud as the node's device plugin
(a host service here; tests/realkube/test_daemonset.py runs it as the
DaemonSet), real kubectl. node-0 has two simulated 16 GiB GPUs (node-1 has no GPU
role until test_two_nodes.py); the tests share it, in file order, and each
leaves it drained."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

from cgpud.node.model import GIB
from cgpud.kube.model import ANNOTATION_ASSIGNED, ANNOTATION_GPU_INDEX, LABEL_MODE, LABEL_PLACEMENT
from tests.harness.daemon import BIN
from tests.harness.wait import until
from tests.realkube.cluster import WAIT, RealCluster, RealNode
from tests.harness.sharerun import Sampler

# Minutes (slow). Beside other tests: its forwarding rule names only its own
# addresses and its driver's nodes are under its own dev_root.
pytestmark = pytest.mark.slow

MEM = "aliyun.com/gpu-mem"
CORE = "aliyun.com/gpu-core.percentage"
BURN = "cgpu-burn --alloc-until-fail 512MiB"
SHOW = f"echo MEM=$ALIYUN_COM_GPU_MEM_CONTAINER; nvml-total; {BURN}"
GPUS, GPU_GIB = 2, 16


def _burn(logs: str) -> dict:
    return json.loads(next(line for line in logs.splitlines() if line.startswith('{"device"')))


def _instances(node: RealNode) -> list[dict]:
    out = node.cgpuctl("list", "--output", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _pods(cluster: RealCluster) -> list[str]:
    return [p["metadata"]["name"] for p in cluster.get("pods", "-n", "default")["items"]]


def _drain(cluster: RealCluster) -> None:
    """Every test pod gone, and every instance with it."""
    if _pods(cluster):
        cluster.kubectl("delete", "pods", "--all", "-n", "default", "--wait=true", "--grace-period=1", timeout=120)
    node = cluster.nodes[0]
    until(
        lambda: _instances(node) == [],
        WAIT,
        interval=0.2,
        what="every instance released",
        explain=lambda: json.dumps(_instances(node)),
    )


def _run_pod(cluster: RealCluster, name: str, command: str, limits: dict, timeout: float = 120) -> str:
    return _run_pod_manifest(cluster, cluster.workload_pod(name, command, limits), timeout)


def _run_pod_manifest(cluster: RealCluster, pod: dict, timeout: float = 120) -> str:
    name = pod["metadata"]["name"]
    cluster.apply([pod])
    phase = cluster.wait_pod(name, ("Succeeded", "Failed"), timeout)
    logs = cluster.logs(name)
    assert phase == "Succeeded", f"{cluster.describe(name)}\n{logs}"
    return logs


def _running(cluster: RealCluster, *pods: tuple[str, dict]) -> None:
    cluster.apply([cluster.workload_pod(name, "sleep 3600", limits) for name, limits in pods])
    for name, _ in pods:
        cluster.wait_pod(name, ("Running",))


def _exec_burn(cluster: RealCluster, pod: str) -> dict:
    """cgpu-burn run again inside the running container (kubectl exec,
    through the API server, the kubelet and containerd's streaming)."""
    out = cluster.kubectl("exec", pod, "--", "sh", "-c", BURN, timeout=120)
    return _burn(out.stdout)


def _gpu_index(cluster: RealCluster, pod: str) -> str:
    return cluster.get("pod", pod)["metadata"]["annotations"][ANNOTATION_GPU_INDEX]


def _set_mode(cluster: RealCluster, mode: str, placement: str = "binpack") -> None:
    """The node's labels changed, and then waited for: cgpud reads them every
    10 s (docs/kubernetes.md) and cgpu-scheduler learns them from cgpud."""
    node = cluster.nodes[0]
    cluster.kubectl("label", "node", node.name, f"{LABEL_MODE}={mode}", f"{LABEL_PLACEMENT}={placement}", "--overwrite")

    def followed() -> bool:
        state = cluster.extender_view().get(node.name, {})
        return state.get("mode") == mode and state.get("placement") == placement

    until(
        followed,
        60,
        interval=0.2,
        what=f"cgpu-scheduler sees {node.name} as {mode}/{placement}",
        explain=lambda: json.dumps(cluster.extender_view().get(node.name, {}))[:2000],
    )


def _wait_allocatable(cluster: RealCluster, wanted: dict[str, str]) -> None:
    node = cluster.nodes[0]
    until(
        lambda: all(cluster.allocatable(node).get(k) == v for k, v in wanted.items()),
        WAIT,
        interval=0.2,
        what=f"allocatable {wanted}",
        explain=lambda: f"{cluster.allocatable(node)}\n{node.cgpud.tail() if node.cgpud else ''}",
    )


# ---- core_mem ------------------------------------------------------------------------------


def _core_mem(cluster: RealCluster) -> None:
    """cgpud on node-0 in core_mem mode: what this module's first test
    leaves, made by a test that runs without it (./dev test's serial pass)."""
    if cluster.nodes[0].cgpud is None:
        cluster.start_cgpud(cluster.nodes[0])
    _set_mode(cluster, "core_mem")
    _wait_allocatable(cluster, {MEM: str(GPUS * GPU_GIB), CORE: str(GPUS * 100), "nvidia.com/gpu": "0"})


def test_a_core_mem_node_shows_gpu_memory_and_core_percentage(cluster: RealCluster) -> None:
    _core_mem(cluster)


def test_a_2_gib_30_percent_pod_runs_and_sees_2_gib_in_the_driver_and_nvml(cluster: RealCluster) -> None:
    logs = _run_pod(cluster, "mem2", SHOW, {MEM: 2, CORE: 30})
    assert "MEM=2" in logs.splitlines(), logs
    assert f"NVML_TOTAL={2 * GIB}" in logs.splitlines(), logs
    burn = _burn(logs)
    assert burn["mem_total_reported"] == 2 * GIB and burn["alloc"]["until_fail_bytes"] == 2 * GIB, burn
    # kube-scheduler sent it to cgpu-scheduler, whose bind wrote the GPU,
    # and cgpud's Allocate marked it assigned.
    annotations = cluster.get("pod", "mem2")["metadata"]["annotations"]
    assert annotations[ANNOTATION_ASSIGNED] == "true" and annotations[ANNOTATION_GPU_INDEX] in ("0", "1"), annotations
    _drain(cluster)


def test_cgpu_scheduler_binds_the_pod_kube_scheduler_sent_under_its_resource_version(cluster: RealCluster) -> None:
    """deploy/ gives cgpu-scheduler a client CA, so only kube-scheduler calls
    it: the bind places the pod as kube-scheduler sent it at filter (no read
    of the pod), and the real API server takes the Binding under that
    copy's resourceVersion."""
    _run_pod(cluster, "fromfilter", SHOW, {MEM: 2})
    sources, logs = _bound_from(cluster, "fromfilter")
    assert sources == ["kube-scheduler"], logs[-3000:]


def _bound_from(cluster: RealCluster, name: str) -> tuple[list[str], str]:
    """Whose copy of the pod each of cgpu-scheduler's binds of it placed
    (its `bound` lines' pod_from), and the log they came from."""
    logs = cluster.kubectl("-n", "kube-system", "logs", "deployment/cgpu-scheduler").stdout
    bound = [json.loads(line) for line in logs.splitlines() if f'"default/{name}"' in line and '"bound"' in line]
    return [b["pod_from"] for b in bound], logs


def test_a_pod_kube_scheduler_nominates_before_its_prebind_is_bound_after_one_read(cluster: RealCluster) -> None:
    """kube-scheduler (v1.35 on) writes a pod's nominatedNodeName before a
    PreBind that has work, here binding a claim that waits for its first
    consumer. The copy it sent at filter is then a version behind, so the
    Binding under it gets 409; cgpu-scheduler reads the pod once and binds
    it, its GPU request being the same."""
    where = cluster.root / "wffc-volume"
    where.mkdir(exist_ok=True)
    storage = [
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": "cgpu-wffc"},
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "WaitForFirstConsumer",
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": "cgpu-wffc"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "cgpu-wffc",
                "hostPath": {"path": str(where), "type": "Directory"},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "cgpu-wffc", "namespace": "default"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "cgpu-wffc",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]
    pod = cluster.workload_pod("claimed", SHOW, {MEM: 2})
    pod["spec"]["volumes"].append({"name": "cache", "persistentVolumeClaim": {"claimName": "cgpu-wffc"}})
    pod["spec"]["containers"][0]["volumeMounts"].append({"name": "cache", "mountPath": "/cache"})
    try:
        cluster.apply(storage)
        _run_pod_manifest(cluster, pod)
        sources, logs = _bound_from(cluster, "claimed")
        assert sources == ["API server, after a conflict"], logs[-3000:]
    finally:
        cluster.kubectl(
            "delete", "pod", "claimed", "--ignore-not-found", "--wait=true", "--grace-period=1", timeout=120
        )
        cluster.kubectl("delete", "pvc", "cgpu-wffc", "--ignore-not-found", "--wait=true", timeout=120)
        cluster.kubectl("delete", "pv", "cgpu-wffc", "--ignore-not-found", "--wait=true", timeout=120)
        cluster.kubectl("delete", "storageclass", "cgpu-wffc", "--ignore-not-found", timeout=120)


def _device_nodes(logs: str) -> set[str]:
    return {line.removeprefix("DEV=") for line in logs.splitlines() if line.startswith("DEV=/dev/nvidia")}


LIST_NODES = "for d in /dev/nvidia*; do test -c $d && echo DEV=$d; done; true"


def test_a_pod_gets_the_device_nodes_of_its_gpu_and_a_pod_without_gpu_none(cluster: RealCluster) -> None:
    logs = _run_pod(cluster, "nodes", LIST_NODES, {MEM: 2})
    gpu = _gpu_index(cluster, "nodes")
    assert _device_nodes(logs) == {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", f"/dev/nvidia{gpu}"}
    assert _device_nodes(_run_pod(cluster, "no-gpu", LIST_NODES, {})) == set()
    _drain(cluster)


@pytest.mark.timing  # measures compute shares: in ./dev test's serial pass, on a cluster of its own
def test_30_and_70_percent_pods_side_by_side_get_30_and_70_percent(cluster: RealCluster) -> None:
    _core_mem(cluster)
    node = cluster.nodes[0]
    # the shell's own pid (the kubelet would turn a "$$" into "$"), which exec hands to cgpu-burn
    command = (
        "read -r pid rest < /proc/self/stat; echo PID=$pid; exec cgpu-burn --kernel-ns 200000 --streams 4 --duration 6"
    )
    # Different sizes: two pods of one size bound at once can get each
    # other's instance (docs/kubernetes.md), which this test is not about.
    pods = {"core30": (1, 30), "core70": (2, 70)}
    docs = []
    for name, (mem, core) in pods.items():
        doc = cluster.workload_pod(name, command, {MEM: mem, CORE: core})
        doc["spec"]["hostPID"] = True  # the simulated GPU accounts busy time by host pid
        doc["metadata"]["annotations"] = {}
        docs.append(doc)
    # The node's compute policy decides what a percentage means; cgpud's
    # default is ACK's, native (no control). Fixed: exactly its percentage.
    assert node.cgpuctl("policy", "set", "fixed").returncode == 0
    sampler = Sampler(node.sim_env, 50)
    try:
        cluster.apply(docs)
        for name in pods:
            cluster.wait_pod(name, ("Succeeded", "Failed"), 120)
    finally:
        sampler.stop()
        node.cgpuctl("policy", "set", "native")
    pids, gpus = {}, set()
    for name in pods:
        logs = cluster.logs(name)
        assert cluster.pod_phase(name) == "Succeeded" and _burn(logs)["errors"] == [], logs
        pids[name] = int(re.search(r"^PID=(\d+)$", logs, re.M)[1])  # type: ignore[index]
        gpus.add(_gpu_index(cluster, name))
    assert len(gpus) == 1, "binpack puts both on one GPU"
    # Shares over 3 s while both run (from 1 s after the later one started).
    s = sampler.samples
    started = max(next(x[0] for x in s if x[2].get(p, 0) > 0) for p in pids.values())
    lo = next(x for x in s if x[0] >= started + 1_000_000_000)
    hi = next(x for x in s if x[0] >= lo[0] + 3_000_000_000)
    window = hi[0] - lo[0]
    shares = {n: 100.0 * (hi[2].get(p, 0) - lo[2].get(p, 0)) / window for n, p in pids.items()}
    assert abs(shares["core30"] - 30) <= 6 and abs(shares["core70"] - 70) <= 6, shares
    _drain(cluster)


def test_kubectl_inspect_cgpu_prints_the_node_from_the_real_api_server(cluster: RealCluster) -> None:
    node = cluster.nodes[0]
    _running(cluster, ("inspected", {MEM: 5}))
    # As a user runs it: the plugin asks the API server's service proxy for
    # the cgpu-scheduler Service's /inspect (deploy/cgpu-scheduler.yaml).
    env = dict(os.environ, PATH=f"{BIN}:/usr/bin:/bin", KUBECONFIG=str(cluster.admin_kubeconfig))
    shown = subprocess.run(["kubectl", "inspect", "cgpu"], env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    rows = shown.stdout.splitlines()
    assert rows[0].split()[:2] == ["NAME", "IPADDRESS"], rows
    [row] = [r.split() for r in rows[1:] if r.startswith(node.name)]
    assert row[1] == node.ip and row[-1] == f"5/{GPUS * GPU_GIB}", shown.stdout
    assert re.search(rf"Allocated/Total GPU Memory In Cluster:\s+5/{GPUS * GPU_GIB}\b", shown.stdout), shown.stdout
    _drain(cluster)


def _inspect_total(cluster: RealCluster) -> str:
    env = dict(os.environ, PATH=f"{BIN}:/usr/bin:/bin", KUBECONFIG=str(cluster.admin_kubeconfig))
    shown = subprocess.run(["kubectl", "inspect", "cgpu"], env=env, capture_output=True, text=True, timeout=60)
    found = re.search(r"Allocated/Total GPU Memory In Cluster:\s+(\S+)", shown.stdout)
    return found[1] if found else shown.stdout + shown.stderr


def _events(cluster: RealCluster, pod: str, reason: str) -> list[str]:
    items = cluster.get("events", "-n", "default", "--field-selector", f"involvedObject.name={pod}")["items"]
    return [e["message"] for e in items if e.get("reason") == reason]


def test_a_pod_annotation_resizes_its_running_container(cluster: RealCluster) -> None:
    """cgpu.io/resize-gpu-mem and -core on a running pod: cgpud's sweep
    shrinks its instance in place, says so in an event, and the cluster's
    view follows; a grow by a pod without priority is refused the same way."""
    _core_mem(cluster)
    node = cluster.nodes[0]
    _running(cluster, ("resized", {MEM: 4, CORE: 30}))
    before = _instances(node)
    cluster.kubectl("annotate", "pod", "resized", "cgpu.io/resize-gpu-mem=2", "cgpu.io/resize-gpu-core=20")

    def grants() -> list[tuple[int, int]]:
        return [(g["memory_bytes"], g["core_percent"]) for i in _instances(node) for g in i["grants"]]

    until(lambda: grants() == [(2 * GIB, 20)], WAIT, interval=0.2, what="the instance resized", explain=grants)
    assert [i["id"] for i in _instances(node)] == [i["id"] for i in before]  # the same instance, not a new one
    until(lambda: _events(cluster, "resized", "Resized"), WAIT, interval=0.5, what="a Resized event")
    assert "2 GiB per GPU and 20% compute" in _events(cluster, "resized", "Resized")[0]
    # A process started in the running container sees the new limit; so does the cluster.
    burn = _exec_burn(cluster, "resized")
    assert burn["mem_total_reported"] == 2 * GIB and burn["alloc"]["until_fail_bytes"] == 2 * GIB, burn
    until(lambda: _inspect_total(cluster) == f"2/{GPUS * GPU_GIB}", WAIT, interval=0.5, what="inspect shows 2 GiB")

    cluster.kubectl("annotate", "--overwrite", "pod", "resized", "cgpu.io/resize-gpu-mem=8")
    until(lambda: _events(cluster, "resized", "ResizeRefused"), WAIT, interval=0.5, what="a ResizeRefused event")
    assert "pod_share_priority_min" in _events(cluster, "resized", "ResizeRefused")[0]
    assert grants() == [(2 * GIB, 20)]
    _drain(cluster)


def test_binpack_fills_one_gpu_and_spread_uses_both(cluster: RealCluster) -> None:
    _running(cluster, ("pack-a", {MEM: 4}), ("pack-b", {MEM: 4}))
    assert _gpu_index(cluster, "pack-a") == _gpu_index(cluster, "pack-b")
    _drain(cluster)
    _set_mode(cluster, "core_mem", "spread")
    try:
        _running(cluster, ("spread-a", {MEM: 4}))  # one at a time: the second sees the first's reservation
        _running(cluster, ("spread-b", {MEM: 4}))
        assert _gpu_index(cluster, "spread-a") != _gpu_index(cluster, "spread-b")
    finally:
        _drain(cluster)
        _set_mode(cluster, "core_mem")


# ---- restarts --------------------------------------------------------------------------------


def _still_limited_and_admitting(cluster: RealCluster, running: str, new: str) -> None:
    """The running 3 GiB pod still sees 3 GiB, and a new pod is admitted."""
    burn = _exec_burn(cluster, running)
    assert burn["mem_total_reported"] == 3 * GIB and burn["alloc"]["until_fail_bytes"] == 3 * GIB, burn
    logs = _run_pod(cluster, new, SHOW, {MEM: 2})
    assert _burn(logs)["alloc"]["until_fail_bytes"] == 2 * GIB
    _drain(cluster)


def test_a_kubelet_restart_re_registers_the_plugin_and_running_pods_keep_their_limits(cluster: RealCluster) -> None:
    node = cluster.nodes[0]
    _running(cluster, ("kept", {MEM: 3}))
    registered = node.cgpud.tail(10**6).count("registered with the kubelet")  # type: ignore[union-attr]
    cluster.restart_kubelet(node)
    until(
        lambda: (
            node.cgpud.tail(10**6).count(  # type: ignore[union-attr]
                "registered with the kubelet"
            )
            > registered
        ),
        WAIT,
        interval=0.2,
        what="cgpud registered again",
        explain=node.cgpud.tail,
    )  # type: ignore[union-attr]
    cluster.wait_node_ready(node)
    _wait_allocatable(cluster, {MEM: str(GPUS * GPU_GIB), CORE: str(GPUS * 100)})
    # A restarted kubelet reports Ready before it has taken its running pods
    # back: until then exec answers "pod does not exist".
    until(
        lambda: cluster.kubectl("exec", "kept", "--", "true", check=False).returncode == 0,
        60,
        interval=0.2,
        what="the restarted kubelet serving exec in the running pod",
    )
    _still_limited_and_admitting(cluster, "kept", "after-kubelet")


def test_a_cgpud_kill_and_restart_loses_no_instance_and_no_limit(cluster: RealCluster) -> None:
    node = cluster.nodes[0]
    _running(cluster, ("survivor", {MEM: 3}))
    before = _instances(node)
    assert node.cgpud is not None and node.cgpud.proc is not None
    os.killpg(node.cgpud.proc.pid, signal.SIGKILL)
    node.cgpud.proc.wait(timeout=10)
    cluster.start_cgpud(node)
    assert _instances(node) == before
    _still_limited_and_admitting(cluster, "survivor", "after-cgpud")


def test_a_pod_past_the_instance_limit_of_every_gpu_stays_pending_with_the_reason(cluster: RealCluster) -> None:
    node = cluster.nodes[0]
    assert node.cgpud is not None
    node.cgpud.stop()
    cluster.start_cgpud(node, "--max-instances-per-gpu", "1")
    try:
        _running(cluster, ("one", {MEM: 1}))
        _running(cluster, ("two", {MEM: 1}))
        cluster.apply([cluster.workload_pod("three", "sleep 3600", {MEM: 1})])

        def refused() -> str:
            events = cluster.get("events", "-n", "default", "--field-selector", "involvedObject.name=three")
            return " ".join(e.get("message", "") for e in events["items"] if e.get("reason") == "FailedScheduling")

        until(lambda: bool(refused()), WAIT, interval=0.2, what="a FailedScheduling event for the third pod")
        assert cluster.pod_phase("three") == "Pending"
        assert "instance" in refused(), refused()
    finally:
        _drain(cluster)
        node.cgpud.stop()
        cluster.start_cgpud(node)


# ---- other modes -----------------------------------------------------------------------------


def test_share_mode_gives_the_pod_its_env_and_no_limit(cluster: RealCluster) -> None:
    _set_mode(cluster, "share")
    _wait_allocatable(cluster, {MEM: str(GPUS * GPU_GIB), CORE: "0"})
    logs = _run_pod(cluster, "shared", SHOW, {MEM: 2})
    assert "MEM=2" in logs.splitlines(), logs
    burn = _burn(logs)
    assert burn["mem_total_reported"] == GPU_GIB * GIB, burn  # the whole GPU: share mode enforces nothing
    _drain(cluster)


def test_a_drained_node_switched_to_default_gives_whole_gpus_for_nvidia_com_gpu(cluster: RealCluster) -> None:
    _set_mode(cluster, "default")
    _wait_allocatable(cluster, {"nvidia.com/gpu": str(GPUS), MEM: "0"})
    logs = _run_pod(cluster, "whole", f"echo NVD=$NVIDIA_VISIBLE_DEVICES; {LIST_NODES}; {SHOW}", {"nvidia.com/gpu": 1})
    nodes = _device_nodes(logs)
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= nodes and len([n for n in nodes if n[-1].isdigit()]) == 1, logs
    burn = _burn(logs)
    assert burn["mem_total_reported"] == GPU_GIB * GIB and burn["alloc"]["until_fail_bytes"] >= 15 * GIB, burn
    [visible] = [line.removeprefix("NVD=") for line in logs.splitlines() if line.startswith("NVD=")]
    assert re.fullmatch(r"GPU-[0-9a-f-]+", visible), logs
    _drain(cluster)
    _set_mode(cluster, "core_mem")
    _wait_allocatable(cluster, {MEM: str(GPUS * GPU_GIB), "nvidia.com/gpu": "0"})


def test_deleting_the_pod_frees_its_instance(cluster: RealCluster) -> None:
    node = cluster.nodes[0]
    _running(cluster, ("held", {MEM: 3}))
    uid = cluster.get("pod", "held")["metadata"]["uid"]

    def held() -> list[dict]:
        return [i for i in _instances(node) if uid in i["owner"]["id"]]

    [instance] = held()
    assert [g["memory_bytes"] for g in instance["grants"]] == [3 * GIB], instance
    cluster.kubectl("delete", "pod", "held", "--wait=true", timeout=120)
    until(lambda: not held(), WAIT, interval=0.2, what="the instance of the deleted pod released")
