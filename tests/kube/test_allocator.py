"""The device plugin's Allocator and pod releases over real parts: the
instance service on a real SQLite file and real region files, the official
Kubernetes client against tests/harness/api_server.py, the kubelet's
pod-resources API over real gRPC (tests/harness/kubelet_pods.py)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cgpud.containers.devices import HOST_ROOT
from cgpud.containers.edits import RuntimeFiles
from cgpud.node.model import GIB, GpuCapacity, InstanceState, NodeMode, NodePolicy, Owner, OwnerKind, Request, Share
from cgpud.node.region import read_limits
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from cgpud.kube.allocator import PodAllocator, spec_path
from cgpud.kube.apiserver import ApiServer
from cgpud.kube.model import AllocationError, MountSpec, Resource
from cgpud.kube.pod_resources import PodResourcesClient
from cgpud.kube.resources import whole_gpus_held
from cgpud.errors import CgpuError
from cgpud.kube.releases import PodReleaser, kubelet_pods
from tests.harness.api_server import ApiServerProcess, api_server, assumed, pod_json
from tests.harness.kubelet_pods import KubeletPods
from tests.harness.kubelet_pods import kubelet_pods as serve_kubelet_pods

GPUS = (GpuCapacity(0, "GPU-aaaa", 16 * GIB), GpuCapacity(1, "GPU-bbbb", 16 * GIB))
NODE = "node-1"
MEM, CORE = Resource.GPU_MEM.value, Resource.GPU_CORE.value


@dataclass
class Rig:
    service: InstanceService
    server: ApiServerProcess
    api: ApiServer
    allocator: PodAllocator
    kubelet: KubeletPods
    releaser: PodReleaser
    cdi: Path
    kubelet_socket: Path

    def assumed_pod(self, name: str, gib: int = 2, idx: str | None = "1", t: int = 100, **limits: int) -> dict:
        return self.server.state.add_pod(
            pod_json(name, NODE, containers={"main": {MEM: gib, **limits}}, annotations=assumed(t, idx))
        )

    def assumed_duo(self) -> dict:
        """Pod "duo": containers a and b of 3 GiB each, assumed on GPU 0."""
        return self.server.state.add_pod(
            pod_json(
                "duo",
                NODE,
                containers={"a": {MEM: 3}, "b": {MEM: 3}},
                annotations=assumed(5, gpu_index=0),
            )
        )

    def nothing_made(self) -> None:
        assert self.service.list() == []
        assert list(self.cdi.iterdir()) == []


def ids(n: int, gpu: str = "GPU-aaaa", start: int = 0) -> list[str]:
    return [f"{gpu}-_-{j}" for j in range(start, start + n)]


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    mode = NodeMode.CORE_MEM
    service = InstanceService(
        Store(tmp_path / "cgpud.db"), GPUS, NodePolicy(mode=mode), tmp_path / "regions", "580.65.06", "boot-1"
    )
    rt = tmp_path / "rt"
    files = RuntimeFiles(rt / "libcgpu.so", rt / "ld.so.preload", rt / "cgpu-hook", tmp_path / "relay.sock")
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    with api_server(tmp_path) as (server, kubeconfig), serve_kubelet_pods() as (kubelet, socket):
        api = ApiServer.connect(kubeconfig, timeout=2.0)
        allocator = PodAllocator(service, api, NODE, files, cdi, HOST_ROOT)
        client = PodResourcesClient(socket, timeout=2.0)
        releaser = PodReleaser(service, lambda: api.pods_on_node(NODE), lambda: kubelet_pods(client.list()), cdi)
        yield Rig(service, server, api, allocator, kubelet, releaser, cdi, socket)
        api.close()


def test_allocate_creates_the_instance_on_the_annotated_gpu_and_marks_the_pod(rig: Rig):
    pod = rig.assumed_pod("train", gib=2, idx="1")
    got = rig.allocator.allocate(Resource.GPU_MEM, ids(2))  # the kubelet's IDs say nothing of the GPU
    [inst] = rig.service.list()
    uid = pod["metadata"]["uid"]
    assert inst.owner.kind is OwnerKind.POD and inst.owner.id == f"{uid}/default/train/main"
    assert [(g.gpu_index, g.memory) for g in inst.grants] == [(1, 2 * GIB)]
    assert [(d.uuid, d.mem_limit) for d in read_limits(rig.service.region_dir(inst.id)).devices] == [
        ("GPU-bbbb", 2 * GIB)
    ]
    assert got.cdi_devices == (f"cgpu.io/gpu={inst.id}",)
    assert got.envs["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2" and got.envs["ALIYUN_COM_GPU_MEM_IDX"] == "1"
    assert got.envs["ALIYUN_COM_GPU_MEM_DEV"] == "16" and got.envs["ALIYUN_COM_GPU_MEM_POD"] == "2"
    assert got.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-bbbb"
    assert {m.container_path for m in got.mounts} >= {"/run/cgpu", "/run/cgpu/usage"}
    # the NVIDIA toolkit's device list (what it reads when set to ignore env):
    # exactly the instance's GPU
    assert [m for m in got.mounts if m.container_path.startswith("/var/run/nvidia-container-devices/")] == [
        MountSpec("/dev/null", "/var/run/nvidia-container-devices/GPU-bbbb", True)
    ]
    spec = json.loads(spec_path(rig.cdi, inst.id).read_text())
    assert spec["kind"] == "cgpu.io/gpu" and [d["name"] for d in spec["devices"]] == [inst.id]
    assert rig.server.state.pod("default", "train")["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true"


def test_a_retried_allocate_gets_the_same_instance(rig: Rig):
    rig.assumed_pod("train")
    first = rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    again = rig.allocator.allocate(Resource.GPU_MEM, list(reversed(ids(2))))
    assert again == first and len(rig.service.list()) == 1


def test_the_oldest_assumed_pod_is_served_first(rig: Rig):
    rig.assumed_pod("young", t=200, idx="0")
    rig.assumed_pod("old", t=100, idx="1")
    rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    rig.allocator.allocate(Resource.GPU_MEM, ids(2, start=2))
    by_pod = {i.owner.id.split("/")[2]: i.grants[0].gpu_index for i in rig.service.list()}
    assert by_pod == {"old": 1, "young": 0}
    first = min(rig.service.list(), key=lambda i: i.created)
    assert "/old/" in first.owner.id


def test_no_assigned_pod_is_a_clear_error_and_makes_nothing(rig: Rig):
    rig.server.state.add_pod(pod_json("plain", NODE, containers={"main": {MEM: 2}}))
    with pytest.raises(
        AllocationError,
        match=r"no pod on node node-1 is assumed for 2 GiB of aliyun.com/gpu-mem: "
        r"is the cgpu scheduler extender \(or gpushare\) configured\? \(pod default/plain",
    ):
        rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    rig.nothing_made()
    assert rig.server.state.patches == []


def test_a_malformed_annotation_names_the_pod_and_makes_nothing(rig: Rig):
    rig.assumed_pod("bad", idx="GPU one")
    with pytest.raises(
        AllocationError, match="pod default/bad: annotation ALIYUN_COM_GPU_MEM_IDX='GPU one' is not a GPU index"
    ):
        rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    rig.nothing_made()


def test_one_pod_with_an_unparseable_assume_time_stops_no_other_pod_of_its_size(rig: Rig):
    """The attack: a pod (the tenant's own, annotated by hand, or a broken
    scheduler) whose ALIYUN_COM_GPU_MEM_ASSUME_TIME does not parse made every
    Allocate of its size on the node fail, and the kubelet does not retry a
    failed admission. It is passed over now, with a Warning event on it."""
    bad = rig.assumed_pod("hostile", idx="0")
    rig.server.state.pods[("default", "hostile")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSUME_TIME"] = "soon"
    rig.assumed_pod("victim", t=500, idx="1")
    rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    [inst] = rig.service.list()
    assert "/victim/" in inst.owner.id
    [event] = rig.server.state.events
    assert event["type"] == "Warning" and event["reason"] == "CgpuAnnotationInvalid"
    assert event["involvedObject"]["name"] == "hostile" and event["involvedObject"]["uid"] == bad["metadata"]["uid"]
    assert "ALIYUN_COM_GPU_MEM_ASSUME_TIME='soon' is not a Unix time" in event["message"]
    assert event["source"] == {"component": "cgpud", "host": NODE}


def test_more_than_the_annotated_gpu_holds_fails_with_the_reason(rig: Rig):
    rig.assumed_pod("big", gib=12, idx="1", t=1)
    rig.assumed_pod("next", gib=8, idx="1", t=2)
    rig.allocator.allocate(Resource.GPU_MEM, ids(12))
    with pytest.raises(AllocationError, match=r"pod default/next container main: .*GPU 1"):
        rig.allocator.allocate(Resource.GPU_MEM, ids(8, start=12))
    assert len(rig.service.list()) == 1
    assert rig.server.state.pod("default", "next")["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "false"


def test_a_failed_patch_undoes_the_instance(rig: Rig):
    rig.assumed_pod("train")
    rig.server.state.fail_patch = 403
    with pytest.raises(
        AllocationError,
        match=r"pod default/train container main: instance not kept: cannot annotate "
        r"pod default/train: the API server refused it \(403",
    ):
        rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    assert [i.state for i in rig.service.list(include_released=True)] == [InstanceState.RELEASED]
    rig.nothing_made()
    rig.server.state.fail_patch = None
    assert rig.allocator.allocate(Resource.GPU_MEM, ids(2)).cdi_devices  # the kubelet's next try works


def test_an_unreachable_api_server_fails_allocate_and_makes_nothing(rig: Rig):
    rig.assumed_pod("train")
    rig.server.stop()
    with pytest.raises(AllocationError, match="cannot tell which pod this Allocate is for: .*cannot be reached"):
        rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    rig.nothing_made()


def test_containers_one_by_one_and_the_pod_is_assigned_with_the_last(rig: Rig):
    rig.assumed_duo()
    a = rig.allocator.allocate(Resource.GPU_MEM, ids(3))
    assert rig.server.state.pod("default", "duo")["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "false"
    b = rig.allocator.allocate(Resource.GPU_MEM, ids(3, start=3))
    assert a.cdi_devices != b.cdi_devices
    assert sorted(i.owner.id.rsplit("/", 1)[1] for i in rig.service.list()) == ["a", "b"]
    assert a.envs["ALIYUN_COM_GPU_MEM_POD"] == "6"
    assert rig.server.state.pod("default", "duo")["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true"


@pytest.mark.parametrize("core_first", [True, False])
def test_the_core_allocate_creates_nothing_and_the_instance_gets_the_spec_core(rig: Rig, core_first: bool):
    rig.assumed_pod("mixed", gib=4, **{CORE: 30})
    core_ids = [f"GPU-aaaa-_-c{j}" for j in range(30)]
    if core_first:
        got = rig.allocator.allocate(Resource.GPU_CORE, core_ids)
        assert got.envs == {"ALIYUN_COM_GPU_CORE_PERCENTAGE": "30"} and not got.cdi_devices
        assert rig.service.list() == []
    mem = rig.allocator.allocate(Resource.GPU_MEM, ids(4))
    if not core_first:
        assert rig.allocator.allocate(Resource.GPU_CORE, core_ids).envs == {"ALIYUN_COM_GPU_CORE_PERCENTAGE": "30"}
    [inst] = rig.service.list()
    assert inst.grants[0].core_percent == 30 and mem.envs["ALIYUN_COM_GPU_CORE_PERCENTAGE"] == "30"
    with pytest.raises(AllocationError, match="no pod on node node-1 is assumed for 50 percent"):
        rig.allocator.allocate(Resource.GPU_CORE, core_ids + [f"GPU-aaaa-_-c{j}" for j in range(30, 50)])


def test_whole_gpus_name_their_gpus(rig: Rig):
    got = rig.allocator.allocate(Resource.NVIDIA_GPU, ["GPU-bbbb", "GPU-aaaa"])
    assert got.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb", "ALIYUN_COM_GPU_MEM_IDX": "0,1"}
    # whole GPUs keep their GPUs with the toolkit set to device lists only
    assert got.mounts == (
        MountSpec("/dev/null", "/var/run/nvidia-container-devices/GPU-aaaa", True),
        MountSpec("/dev/null", "/var/run/nvidia-container-devices/GPU-bbbb", True),
    )
    with pytest.raises(AllocationError, match="no GPU with UUID 'GPU-zzzz'"):
        rig.allocator.allocate(Resource.NVIDIA_GPU, ["GPU-zzzz"])
    assert rig.service.list() == []


# ---- reservations (cgpu-scheduler's Reserve) ------------------------------------------------


def test_a_reserved_gpu_is_full_for_others_and_its_pod_gets_it(rig: Rig):
    other = rig.assumed_pod("other", gib=4, idx="1", t=1)  # served first: the oldest
    mine = rig.assumed_pod("mine", gib=14, idx="1", t=2)
    rig.service.reserve(mine["metadata"]["uid"], "default", "mine", [Share(1, 14 * GIB)])
    with pytest.raises(AllocationError, match=r"pod default/other container main: .*GPU 1.*2 GiB"):
        rig.allocator.allocate(Resource.GPU_MEM, ids(4))
    assert rig.service.list() == []
    got = rig.allocator.allocate(Resource.GPU_MEM, ids(14, start=4))
    [inst] = rig.service.list()
    assert inst.owner.id.startswith(mine["metadata"]["uid"] + "/")
    assert [(g.gpu_index, g.memory) for g in inst.grants] == [(1, 14 * GIB)]
    assert got.cdi_devices == (f"cgpu.io/gpu={inst.id}",)
    assert rig.service.reservations() == []
    assert other["metadata"]["uid"] not in inst.owner.id


def test_each_container_draws_on_the_reservation_and_the_last_drops_what_is_left(rig: Rig):
    pod = rig.assumed_duo()
    uid = pod["metadata"]["uid"]
    # One GiB more than the pod needs: the last Allocate gives it back.
    rig.service.reserve(uid, "default", "duo", [Share(0, 7 * GIB, 0, 2)])
    rig.allocator.allocate(Resource.GPU_MEM, ids(3))
    [left] = rig.service.reservations()
    assert left.shares == (Share(0, 4 * GIB, 0, 1),)
    rig.allocator.allocate(Resource.GPU_MEM, ids(3, start=3))
    assert rig.service.reservations() == []
    assert sorted(g.memory for i in rig.service.list() for g in i.grants) == [3 * GIB, 3 * GIB]
    usage = rig.service.node_info().gpus[0]
    assert (usage.allocated, usage.instances) == (6 * GIB, 2)


def test_a_failed_allocate_leaves_the_pods_reservation_as_it_was(rig: Rig):
    pod = rig.assumed_pod("train", gib=2, idx="0")
    before = rig.service.reserve(pod["metadata"]["uid"], "default", "train", [Share(0, 2 * GIB)])
    rig.server.state.fail_patch = 403
    with pytest.raises(AllocationError, match="instance not kept"):
        rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    rig.nothing_made()
    assert rig.service.reservations() == [before]
    rig.server.state.fail_patch = None
    rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    assert rig.service.reservations() == []


def test_another_pods_reservation_is_left_alone(rig: Rig):
    rig.assumed_pod("train", gib=2, idx="0")
    rig.service.reserve("uid-elsewhere", "default", "later", [Share(0, 10 * GIB)])
    rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    assert [r.pod_uid for r in rig.service.reservations()] == ["uid-elsewhere"]
    assert rig.service.node_info().gpus[0].allocated == 12 * GIB


# ---- releases ------------------------------------------------------------------------------


def _allocated(rig: Rig, name: str, start: int) -> str:
    rig.assumed_pod(name, idx="0")
    rig.allocator.allocate(Resource.GPU_MEM, ids(2, start=start))
    rig.kubelet.hold("default", name, "main", MEM, tuple(ids(2, start=start)))
    return next(i.id for i in rig.service.list() if f"/{name}/" in i.owner.id)


def test_a_deleted_pods_instance_is_released_in_one_sweep_and_a_live_one_is_not(rig: Rig):
    gone = _allocated(rig, "gone", 0)
    kept = _allocated(rig, "kept", 2)
    rig.server.state.delete_pod("default", "gone")
    assert rig.releaser.sweep() == 0  # the kubelet still lists it: wait
    rig.kubelet.forget("default", "gone")
    assert rig.releaser.sweep() == 1
    assert rig.service.get(gone).state is InstanceState.RELEASED and not spec_path(rig.cdi, gone).exists()
    assert rig.service.get(kept).active and spec_path(rig.cdi, kept).exists()
    assert rig.releaser.sweep() == 0


def test_a_finished_pod_is_released(rig: Rig):
    done = _allocated(rig, "job", 0)
    rig.server.state.pods[("default", "job")]["status"]["phase"] = "Succeeded"
    assert rig.releaser.sweep() == 1 and not rig.service.get(done).active


def test_nothing_is_released_while_a_witness_cannot_be_asked(rig: Rig, tmp_path: Path):
    inst = _allocated(rig, "gone", 0)
    rig.server.state.delete_pod("default", "gone")
    rig.kubelet.forget("default", "gone")
    rig.server.stop()
    assert rig.releaser.sweep() == 0 and rig.service.get(inst).active
    rig.server.start()
    blind_kubelet = PodReleaser(
        rig.service,
        lambda: rig.api.pods_on_node(NODE),
        lambda: kubelet_pods(PodResourcesClient(tmp_path / "no.sock").list()),
        rig.cdi,
    )
    assert blind_kubelet.sweep() == 0 and rig.service.get(inst).active
    assert rig.releaser.sweep() == 1  # both answer again: caught up


def test_a_spec_of_an_instance_released_elsewhere_is_removed(rig: Rig):
    inst = _allocated(rig, "train", 0)
    rig.service.release(inst)  # cgpuctl release, or a reboot's reconcile
    assert spec_path(rig.cdi, inst).exists()
    rig.releaser.sweep()
    assert not spec_path(rig.cdi, inst).exists()


def test_devices_freed_by_a_finished_pod_go_to_the_next_pod_not_back_to_the_old_instance(rig: Rig):
    rig.assumed_pod("first", t=1)
    old = rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    rig.server.state.pods[("default", "first")]["status"]["phase"] = "Succeeded"  # the kubelet frees its devices
    rig.assumed_pod("second", t=2)
    new = rig.allocator.allocate(Resource.GPU_MEM, ids(2))  # the very same device IDs
    assert new.cdi_devices != old.cdi_devices
    assert sorted(i.owner.id.split("/")[2] for i in rig.service.list()) == ["first", "second"]
    assert rig.releaser.sweep() == 1 and [i.owner.id.split("/")[2] for i in rig.service.list()] == ["second"]


def test_a_gone_pods_reservation_is_given_back_at_the_sweep_not_at_its_expiry(tmp_path: Path, rig: Rig):
    """Finished or being deleted on this node: given back at once. Not on
    this node (deleted, bound elsewhere, never bound): given back once it has
    been missing for the grace. Bound here and live: kept."""
    now = [100.0]
    releaser = PodReleaser(
        rig.service,
        lambda: rig.api.pods_on_node(NODE),
        lambda: [],
        rig.cdi,
        reservation_grace=5.0,
        clock=lambda: now[0],
    )
    here = rig.server.state.add_pod(pod_json("here", NODE, containers={"main": {MEM: 2}}))
    done = rig.server.state.add_pod(pod_json("done", NODE, containers={"main": {MEM: 2}}, phase="Succeeded"))
    unbound = rig.server.state.add_pod(pod_json("unbound", "", containers={"main": {MEM: 2}}))
    elsewhere = rig.server.state.add_pod(pod_json("elsewhere", "node-2", containers={"main": {MEM: 2}}))
    for pod in (here, done, unbound, elsewhere):
        rig.service.reserve(pod["metadata"]["uid"], "default", pod["metadata"]["name"], [Share(0, GIB)])
    rig.service.reserve("uid-deleted", "default", "deleted", [Share(1, GIB)])
    requests = len(rig.server.state.requests)
    releaser.sweep()
    assert sorted(r.pod_name for r in rig.service.reservations()) == ["deleted", "elsewhere", "here", "unbound"]
    assert len(rig.server.state.requests) == requests + 1  # one list of the node's pods, no call per reservation
    now[0] += 4.0
    rig.server.state.bind("default", "unbound", NODE)  # its Binding came in time
    releaser.sweep()
    assert sorted(r.pod_name for r in rig.service.reservations()) == ["deleted", "elsewhere", "here", "unbound"]
    now[0] += 1.0
    releaser.sweep()
    assert sorted(r.pod_name for r in rig.service.reservations()) == ["here", "unbound"]


# ---- compute weight and high priority (cgpud.kube.share_priority) ------------------------


def share_pod(rig: Rig, name: str, priority: int | None, env=None, annotations=None) -> dict:
    return rig.server.state.add_pod(
        pod_json(
            name,
            NODE,
            containers={"main": {MEM: 2}},
            annotations={**assumed(100, "0"), **(annotations or {})},
            env={"main": env} if env else None,
            priority=priority,
        )
    )


def test_a_prioritised_pods_env_reaches_the_instance_and_its_region(rig: Rig):
    """cGPU's env names, as ACK users write them, in a pod whose
    PriorityClass reaches the node's minimum (1 by default): the instance
    and the limits file the scheduler and libcgpu read carry them."""
    env = [{"name": "ALIYUN_COM_GPU_SCHD_WEIGHT", "value": "3"}, {"name": "ALIYUN_COM_GPU_HIGH_PRIO", "value": "1"}]
    share_pod(rig, "urgent", priority=1000, env=env)
    rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    [inst] = rig.service.list()
    assert (inst.weight, inst.priority) == (3, 1)
    [dev] = read_limits(rig.service.region_dir(inst.id)).devices
    assert (dev.weight, dev.priority) == (3, 1)


def test_annotations_ask_for_every_container_and_env_wins(rig: Rig):
    annotations = {"cgpu.io/gpu-weight": "5", "cgpu.io/gpu-high-priority": "true"}
    share_pod(rig, "batch", 10, [{"name": "ALIYUN_COM_GPU_SCHD_WEIGHT", "value": "2"}], annotations)
    rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    [inst] = rig.service.list()
    assert (inst.weight, inst.priority) == (2, 1)


@pytest.mark.parametrize("priority", [None, 0])
def test_a_pod_without_a_priority_class_that_asks_is_refused_and_nothing_is_made(rig: Rig, priority):
    """Whoever can create a pod can write the env: taking compute from the
    neighbours needs a PriorityClass, which only administrators create."""
    share_pod(rig, "greedy", priority, [{"name": "ALIYUN_COM_GPU_HIGH_PRIO", "value": "1"}])
    with pytest.raises(AllocationError) as e:
        rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    assert "pod default/greedy container main asks for GPU compute high priority" in str(e.value)
    assert "pod_share_priority_min (1)" in str(e.value) and "PriorityClass of at least 1" in str(e.value)
    rig.nothing_made()


def test_a_pod_that_asks_nothing_needs_no_priority_and_gets_weight_1(rig: Rig):
    share_pod(rig, "plain", None, [{"name": "ALIYUN_COM_GPU_SCHD_WEIGHT", "value": "1"}])
    rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    [inst] = rig.service.list()
    assert (inst.weight, inst.priority) == (1, 0)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"name": "ALIYUN_COM_GPU_SCHD_WEIGHT", "value": "heavy"},
            "ALIYUN_COM_GPU_SCHD_WEIGHT='heavy' is not a whole number",
        ),
        (
            {"name": "ALIYUN_COM_GPU_SCHD_WEIGHT", "value": "101"},
            "ALIYUN_COM_GPU_SCHD_WEIGHT=101 is out of range: use 1 to 100",
        ),
        (
            {"name": "ALIYUN_COM_GPU_HIGH_PRIO", "value": "maybe"},
            "ALIYUN_COM_GPU_HIGH_PRIO='maybe' is not a yes/no value",
        ),
        (
            {"name": "ALIYUN_COM_GPU_HIGH_PRIO", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            "ALIYUN_COM_GPU_HIGH_PRIO must be a literal value",
        ),
    ],
)
def test_a_bad_value_is_one_clear_error_and_makes_nothing(rig: Rig, entry, message):
    share_pod(rig, "typo", 1000, [entry])
    with pytest.raises(AllocationError) as e:
        rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    assert message in str(e.value)
    rig.nothing_made()


def test_the_nodes_minimum_is_the_allocators(rig: Rig):
    rig.allocator.min_pod_priority = 2000
    share_pod(rig, "mid", 1000, [{"name": "ALIYUN_COM_GPU_SCHD_WEIGHT", "value": "4"}])
    with pytest.raises(
        AllocationError, match=r"priority \(1000\) is below this node's pod_share_priority_min \(2000\)"
    ):
        rig.allocator.allocate(Resource.GPU_MEM, ids(2))
    rig.nothing_made()


# ---- GPUs pods hold whole: the kubelet's word (pod-resources), cgpud's books -----------


def test_gpus_the_kubelet_gave_whole_are_taken_in_admission_and_the_view(rig: Rig):
    """cgpud keeps no instance for nvidia.com/gpu and aliyun.com/gpu; the
    sweep reads which GPUs pods hold from the kubelet's pod-resources List."""
    rig.kubelet.hold("default", "whole", "main", "aliyun.com/gpu", ("GPU-aaaa",))
    rig.kubelet.hold("default", "share", "main", MEM, ("GPU-bbbb-_-0",))  # a share: cgpud's own books
    before = rig.service.changes.revision
    listed = PodResourcesClient(rig.kubelet_socket, timeout=2.0).list()
    rig.service.set_whole_held(whole_gpus_held(listed, rig.service.gpus()))
    assert rig.service.whole_held() == {0: "default/whole/main"} and rig.service.changes.revision > before
    usage = {g.gpu.index: g for g in rig.service.node_info().gpus}
    assert (usage[0].allocated, usage[0].instances, usage[1].instances) == (16 * GIB, 1, 0)
    # A request that needs GPU 0 is refused, one that fits GPU 1 goes there;
    # the same set again is no change.
    with pytest.raises(CgpuError) as refused:
        rig.service.create(Request(Owner(OwnerKind.PROCESS, "host"), 4 * GIB, gpu_count=2))
    assert "the next most free is 0 GiB on GPU 0" in str(refused.value)
    assert rig.service.create(Request(Owner(OwnerKind.PROCESS, "host"), 4 * GIB)).grants[0].gpu_index == 1
    revision = rig.service.changes.revision
    rig.service.set_whole_held({0: "default/whole/main"})
    assert rig.service.changes.revision == revision
    rig.kubelet.forget("default", "whole")
    rig.service.set_whole_held(whole_gpus_held(PodResourcesClient(rig.kubelet_socket).list(), rig.service.gpus()))
    assert rig.service.whole_held() == {}


def test_an_mps_nodes_allocate_over_grpc_gives_the_gpus_pipe_and_the_mps_variables(tmp_path: Path) -> None:
    """The kubelet's Allocate through the device plugin's real gRPC server
    into the real allocator, on an mps node: the answer and the CDI spec
    carry the GPU's MPS pipe directory (read-only) and the variables."""
    import grpc

    from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2 as dp
    from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
    from cgpud.kube.plugin import DevicePlugin, PluginSettings
    from cgpud.kube.resources import SOCKET_NAMES
    from cgpud.node.model import Placement
    from tests.harness.kubelet import Kubelet

    pipes = {0: tmp_path / "mps" / "0" / "pipe", 1: tmp_path / "mps" / "1" / "pipe"}
    service = InstanceService(
        Store(tmp_path / "cgpud.db"),
        GPUS,
        NodePolicy(mode=NodeMode.MPS),
        tmp_path / "regions",
        "580.65.06",
        "boot-1",
        mps_pipes=pipes,
    )
    rt = tmp_path / "rt"
    files = RuntimeFiles(rt / "libcgpu.so", rt / "ld.so.preload", rt / "cgpu-hook", tmp_path / "relay.sock")
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    plugins = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))  # a unix socket path has 107 bytes
    kubelet = Kubelet(plugins).start()
    try:
        with api_server(tmp_path) as (server, kubeconfig):
            api = ApiServer.connect(kubeconfig, timeout=2.0)
            allocator = PodAllocator(service, api, NODE, files, cdi, HOST_ROOT)
            plugin = DevicePlugin(
                PluginSettings(plugins), allocator, mode=NodeMode.MPS, placement=Placement.BINPACK, gpus=GPUS
            ).start()
            try:
                kubelet.take_registrations(len(Resource))  # every plugin serving: its socket is there
                server.state.add_pod(
                    pod_json("infer", NODE, containers={"main": {MEM: 4, CORE: 30}}, annotations=assumed(7, "1"))
                )
                channel = grpc.insecure_channel(f"unix:{plugins / SOCKET_NAMES[Resource.GPU_MEM]}")
                request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids(4))])
                [answer] = dp_grpc.DevicePluginStub(channel).Allocate(request, timeout=10).container_responses
                channel.close()
            finally:
                plugin.stop(grace=0.5)
                api.close()
    finally:
        kubelet.stop()
        shutil.rmtree(plugins, ignore_errors=True)
    [inst] = service.list()
    assert inst.grants[0].gpu_index == 1 and inst.grants[0].core_percent == 30
    assert answer.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert answer.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert answer.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert [(m.host_path, m.read_only) for m in answer.mounts if m.container_path == "/tmp/nvidia-mps"] == [
        (str(pipes[1]), True)
    ]
    spec = json.loads(spec_path(cdi, inst.id).read_text())
    edits = spec["devices"][0]["containerEdits"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30" in edits["env"]
    [mount] = [m for m in edits["mounts"] if m["containerPath"] == "/tmp/nvidia-mps"]
    assert mount["hostPath"] == str(pipes[1]) and "ro" in mount["options"]
