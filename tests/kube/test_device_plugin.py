"""The device plugin over real gRPC on real unix sockets, with the test
playing the kubelet: it serves v1beta1.Registration on kubelet.sock, takes
the Register calls, dials the plugin's sockets back and calls what a
kubelet calls; a kubelet restart is played the way a kubelet does it.

Allocate's real work is H6's allocator (cgpud/kube/allocator.py, tested
with it); here a small recording allocator stands in for it, only to test
the gRPC plumbing around it: the tests that use it say so in their names."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2 as pb
from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from cgpud.node.model import GpuCapacity, NodeMode, Placement
from cgpud.errors import AdmissionError
from cgpud.kube.model import AllocationError, ContainerAllocation, MountSpec, Resource
from cgpud.kube.plugin import DevicePlugin, PluginSettings
from cgpud.kube.resources import SOCKET_NAMES
from cgpud.units import GIB
from tests.harness.links import NVLINK_PAIRS
from tests.harness.kubelet import Kubelet
from tests.harness.wait import until

UUID0 = "GPU-6a1e0c55-0000-4c3e-8f00-000000000000"
UUID1 = "GPU-6a1e0c55-1111-4c3e-8f00-111111111111"
GPUS = (GpuCapacity(0, UUID0, 16 * GIB), GpuCapacity(1, UUID1, 8 * GIB))
WAIT = 10.0  # seconds any one expected event may take


class RecordingAllocator:
    """Stands in for H6's allocator in the plumbing tests only: records the
    calls and answers with a fixed allocation or raises what it is told."""

    def __init__(self) -> None:
        self.calls: list[tuple[Resource, tuple[str, ...]]] = []
        self.error: Exception | None = None

    def allocate(self, resource: Resource, device_ids: Sequence[str]) -> ContainerAllocation:
        self.calls.append((resource, tuple(device_ids)))
        if self.error is not None:
            raise self.error
        return ContainerAllocation(
            cdi_devices=(f"cgpu.io/gpu=test-{len(self.calls)}",),
            envs={"ALIYUN_COM_GPU_MEM_CONTAINER": str(len(device_ids))},
            mounts=(MountSpec("/host/region", "/run/cgpu/region"),),
            annotations={"cgpu.io/instance": f"test-{len(self.calls)}"},
        )


@pytest.fixture
def directory() -> Iterator[Path]:
    # Short: a unix socket path has 107 bytes, pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(directory: Path) -> Iterator[Kubelet]:
    k = Kubelet(directory).start()
    yield k
    k.stop()


@pytest.fixture
def allocator() -> RecordingAllocator:
    return RecordingAllocator()


@pytest.fixture
def plugin(directory: Path, kubelet: Kubelet, allocator: RecordingAllocator) -> Iterator[DevicePlugin]:
    p = start_plugin(directory, allocator, register_timeout=2.0)
    kubelet.take_registrations(len(Resource))
    yield p
    p.stop(grace=0.5)


def start_plugin(
    directory: Path,
    allocator: RecordingAllocator,
    mode: NodeMode = NodeMode.CGPU,
    register_timeout: float = PluginSettings.register_timeout,
) -> DevicePlugin:
    """A started plugin on GPUS that looks at its sockets every 0.1 s, so
    that a kubelet restart or a deleted socket is seen within a test's wait."""
    return DevicePlugin(
        PluginSettings(directory, watch_interval=0.1, register_timeout=register_timeout),
        allocator,
        mode=mode,
        placement=Placement.BINPACK,
        gpus=GPUS,
    ).start()


def stub(directory: Path, resource: Resource) -> pb_grpc.DevicePluginStub:
    channel = grpc.insecure_channel(f"unix:{directory / SOCKET_NAMES[resource]}")
    return pb_grpc.DevicePluginStub(channel)


def list_and_watch(directory: Path, resource: Resource, timeout: float = WAIT) -> Iterator[pb.ListAndWatchResponse]:
    return stub(directory, resource).ListAndWatch(pb.Empty(), timeout=timeout)


def first_list_size(directory: Path, resource: Resource) -> int:
    """How many devices the first list on resource's socket has; the stream
    is closed again."""
    stream = list_and_watch(directory, resource)
    try:
        return len(next(stream).devices)
    finally:
        stream.cancel()


def take_every_registration(kubelet: Kubelet) -> list[pb.RegisterRequest]:
    """The Register calls of one registration round, which names every resource."""
    got = kubelet.take_registrations(len(Resource))
    assert {r.resource_name for r in got} == {r.value for r in Resource}
    return got


def allocate_request(*containers: Sequence[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids)) for ids in containers]
    )


def refused_allocate(directory: Path, resource: Resource, request: pb.AllocateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        stub(directory, resource).Allocate(request, timeout=WAIT)
    return caught.value


def ends(stream: Iterator[pb.ListAndWatchResponse]) -> bool:
    """The stream closes (the plugin ends it, or its server goes) before
    its deadline, with no further list."""
    try:
        for _ in stream:
            return False
    except grpc.RpcError as e:
        return e.code() != grpc.StatusCode.DEADLINE_EXCEEDED
    return True


def devices(response: pb.ListAndWatchResponse) -> dict[str, str]:
    return {d.ID: d.health for d in response.devices}


def test_registers_every_resource_with_the_kubelet(
    directory: Path, kubelet: Kubelet, allocator: RecordingAllocator
) -> None:
    p = start_plugin(directory, allocator)
    try:
        for r in take_every_registration(kubelet):
            assert r.version == "v1beta1"
            assert r.endpoint == SOCKET_NAMES[Resource(r.resource_name)]
            assert "/" not in r.endpoint  # relative to the kubelet's directory
            assert r.options.get_preferred_allocation_available and not r.options.pre_start_required
            # The kubelet dials it; nobody else may (Allocate makes instances).
            mode = (directory / r.endpoint).stat().st_mode
            assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        options = stub(directory, Resource.GPU_MEM).GetDevicePluginOptions(pb.Empty(), timeout=WAIT)
        assert options.get_preferred_allocation_available
        assert kubelet.registered.empty()  # once per kubelet, not once per watch round
        time.sleep(0.5)
        assert kubelet.registered.empty()
    finally:
        p.stop(grace=0.5)


def test_list_and_watch_sends_the_modes_lists_then_a_health_change(directory: Path, plugin: DevicePlugin) -> None:
    stream = list_and_watch(directory, Resource.GPU_MEM)
    first = devices(next(stream))
    assert len(first) == 16 + 8 and set(first.values()) == {"Healthy"}
    assert f"{UUID0}-_-15" in first and f"{UUID1}-_-7" in first

    plugin.update(health={0: True, 1: False})
    second = devices(next(stream))
    assert sorted(i for i, h in second.items() if h == "Unhealthy") == sorted(f"{UUID1}-_-{j}" for j in range(8))
    assert sum(1 for h in second.values() if h == "Healthy") == 16

    plugin.update(health={})  # recovered
    assert set(devices(next(stream)).values()) == {"Healthy"}
    stream.cancel()


def test_other_modes_resources_advertise_no_devices(directory: Path, plugin: DevicePlugin) -> None:
    assert {resource: first_list_size(directory, resource) for resource in Resource} == {
        Resource.GPU_MEM: 24,
        Resource.GPU_COUNT: 2,
        Resource.GPU_CORE: 0,
        Resource.GPU_TOPOLOGY: 0,
        Resource.NVIDIA_GPU: 0,
    }


def test_a_mode_change_moves_capacity(directory: Path, plugin: DevicePlugin) -> None:
    mem = list_and_watch(directory, Resource.GPU_MEM)
    whole = list_and_watch(directory, Resource.NVIDIA_GPU)
    core = list_and_watch(directory, Resource.GPU_CORE)
    assert len(next(mem).devices) == 24 and len(next(whole).devices) == 0 and len(next(core).devices) == 0

    plugin.update(mode=NodeMode.CORE_MEM)
    assert len(next(core).devices) == 200  # memory lists did not change: no resend needed there

    plugin.update(mode=NodeMode.DEFAULT)
    assert len(next(mem).devices) == 0
    assert set(devices(next(whole))) == {UUID0, UUID1}
    assert len(next(core).devices) == 0
    for s in (mem, whole, core):
        s.cancel()


def test_an_inventory_change_is_sent(directory: Path, plugin: DevicePlugin) -> None:
    count = list_and_watch(directory, Resource.GPU_COUNT)
    assert set(devices(next(count))) == {UUID0, UUID1}
    plugin.update(gpus=GPUS[:1])
    assert set(devices(next(count))) == {UUID0}
    count.cancel()


def test_get_preferred_allocation_packs_one_gpu(directory: Path, plugin: DevicePlugin) -> None:
    available = [f"{UUID0}-_-{j}" for j in range(4, 16)] + [f"{UUID1}-_-{j}" for j in range(3, 8)]
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=4),
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=6),
        ]
    )
    answer = stub(directory, Resource.GPU_MEM).GetPreferredAllocation(request, timeout=WAIT)
    first, second = (list(r.deviceIDs) for r in answer.container_responses)
    assert first == [f"{UUID1}-_-{j}" for j in range(3, 7)]  # binpack: the fuller GPU that fits
    assert second == [f"{UUID0}-_-{j}" for j in range(4, 10)]  # 6 do not fit on GPU 1

    plugin.update(placement=Placement.SPREAD)
    answer = stub(directory, Resource.GPU_MEM).GetPreferredAllocation(request, timeout=WAIT)
    assert list(answer.container_responses[0].deviceIDs) == [f"{UUID0}-_-{j}" for j in range(4, 8)]


def test_allocate_plumbing_passes_ids_to_the_allocator_and_its_answer_back(
    directory: Path, plugin: DevicePlugin, allocator: RecordingAllocator
) -> None:
    ids = [f"{UUID1}-_-0", f"{UUID1}-_-1"]
    request = allocate_request(ids, [f"{UUID0}-_-3"])
    answer = stub(directory, Resource.GPU_MEM).Allocate(request, timeout=WAIT)
    assert allocator.calls == [(Resource.GPU_MEM, tuple(ids)), (Resource.GPU_MEM, (f"{UUID0}-_-3",))]
    first, second = answer.container_responses
    assert [d.name for d in first.cdi_devices] == ["cgpu.io/gpu=test-1"]
    assert [d.name for d in second.cdi_devices] == ["cgpu.io/gpu=test-2"]
    assert dict(first.envs) == {"ALIYUN_COM_GPU_MEM_CONTAINER": "2"}
    assert [(m.host_path, m.container_path, m.read_only) for m in first.mounts] == [
        ("/host/region", "/run/cgpu/region", True)
    ]
    assert dict(first.annotations) == {"cgpu.io/instance": "test-1"}
    assert len(first.devices) == 0  # no device nodes: CDI or the mounts carry everything

    pre = stub(directory, Resource.GPU_MEM).PreStartContainer(
        pb.PreStartContainerRequest(devices_ids=ids), timeout=WAIT
    )
    assert pre == pb.PreStartContainerResponse()


@pytest.mark.parametrize(
    "error,code",
    [
        (
            AllocationError("no pod on node n1 is assumed for 2 GiB of aliyun.com/gpu-mem"),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (AdmissionError("2 GiB does not fit on GPU 1 (1 GiB free)"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
def test_allocate_plumbing_turns_allocator_errors_into_statuses_with_their_message(
    directory: Path, plugin: DevicePlugin, allocator: RecordingAllocator, error: Exception, code: grpc.StatusCode
) -> None:
    allocator.error = error
    refused = refused_allocate(directory, Resource.GPU_MEM, allocate_request([f"{UUID0}-_-0"]))
    assert refused.code() == code
    assert refused.details() == str(error)


@pytest.mark.parametrize(
    "resource,ids",
    [
        (Resource.GPU_MEM, [f"{UUID1}-_-8"]),  # GPU 1 has 8 GiB: units 0..7
        (Resource.GPU_MEM, ["GPU-not-on-this-node-_-0"]),
        (Resource.GPU_CORE, [f"{UUID0}-_-c0"]),  # cgpu mode advertises no compute shares
        (Resource.GPU_MEM, []),
    ],
)
def test_allocate_of_unknown_device_ids_is_refused_before_the_allocator(
    directory: Path, plugin: DevicePlugin, allocator: RecordingAllocator, resource: Resource, ids: list[str]
) -> None:
    refused = refused_allocate(directory, resource, allocate_request(ids))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert resource.value in refused.details()
    if ids:
        assert ids[0] in refused.details()
    assert allocator.calls == []


def test_kubelet_restart_brings_a_new_registration_and_fresh_sockets(
    directory: Path, kubelet: Kubelet, plugin: DevicePlugin
) -> None:
    old = list_and_watch(directory, Resource.GPU_MEM)
    assert len(next(old).devices) == 24
    before = plugin.registrations

    kubelet.restart()
    for r in take_every_registration(kubelet):
        assert (directory / r.endpoint).exists()
    until(lambda: plugin.registrations == before + 1, WAIT, what="the new registration")
    # The old stream belonged to the old kubelet: it ends.
    assert ends(old)
    # The new kubelet gets the lists on the new sockets.
    assert first_list_size(directory, Resource.GPU_MEM) == 24


def test_a_recreated_kubelet_socket_alone_brings_a_new_registration(
    directory: Path, kubelet: Kubelet, plugin: DevicePlugin
) -> None:
    kubelet.stop()  # the plugin sockets stay: only kubelet.sock is new
    kubelet.start()
    take_every_registration(kubelet)
    assert first_list_size(directory, Resource.GPU_MEM) == 24


def test_a_deleted_plugin_socket_alone_is_served_and_registered_again(
    directory: Path, kubelet: Kubelet, plugin: DevicePlugin
) -> None:
    (directory / SOCKET_NAMES[Resource.GPU_CORE]).unlink()
    take_every_registration(kubelet)
    options = stub(directory, Resource.GPU_CORE).GetDevicePluginOptions(pb.Empty(), timeout=WAIT)
    assert options.get_preferred_allocation_available


def test_a_refused_registration_is_retried_until_the_kubelet_accepts(
    directory: Path, kubelet: Kubelet, allocator: RecordingAllocator
) -> None:
    kubelet.refuse = "resource name already registered"
    p = start_plugin(directory, allocator)
    try:
        time.sleep(0.5)
        assert p.registrations == 0 and kubelet.registered.empty()
        kubelet.refuse = None
        assert len(kubelet.take_registrations(len(Resource))) == len(Resource)
    finally:
        p.stop(grace=0.5)


def test_no_kubelet_yet_means_waiting_then_registering(directory: Path, allocator: RecordingAllocator) -> None:
    p = start_plugin(directory, allocator, NodeMode.DEFAULT)
    k = Kubelet(directory)
    try:
        time.sleep(0.3)
        assert not list(directory.glob("cgpu-*.sock"))  # nothing served before a kubelet is there
        k.start()
        take_every_registration(k)
    finally:
        p.stop(grace=0.5)
        k.stop()


def test_stop_is_bounded_and_ends_open_streams(
    directory: Path, kubelet: Kubelet, allocator: RecordingAllocator
) -> None:
    p = start_plugin(directory, allocator)
    kubelet.take_registrations(len(Resource))
    stream = list_and_watch(directory, Resource.GPU_MEM)
    next(stream)
    ended = threading.Event()

    def drain() -> None:
        try:
            for _ in stream:
                pass
        except grpc.RpcError:
            pass
        ended.set()

    threading.Thread(target=drain, daemon=True).start()
    start = time.monotonic()
    p.stop(grace=0.5)
    assert time.monotonic() - start < 3.0
    assert ended.wait(WAIT)
    assert not list(directory.glob("cgpu-*.sock"))  # its own sockets removed
    assert kubelet.socket.exists()  # never the kubelet's
    until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith(("cgpud-dp-", "cgpud-device-plugin"))],
        WAIT,
        what="the plugin's threads to end",
    )


def test_an_unknown_mode_update_changes_nothing(directory: Path, plugin: DevicePlugin) -> None:
    from cgpud.errors import UsageError

    with pytest.raises(UsageError, match="unknown node mode"):
        plugin.update(mode="exclusive", gpus=GPUS[:1])
    assert len(plugin.devices(Resource.GPU_MEM)) == 24
    assert len(plugin.devices(Resource.GPU_COUNT)) == 2


def test_socket_paths_longer_than_a_unix_socket_allows_are_refused(allocator: RecordingAllocator) -> None:
    from cgpud.errors import UsageError

    long_dir = Path("/tmp") / ("d" * 100)
    with pytest.raises(UsageError, match="too long"):
        DevicePlugin(PluginSettings(long_dir), allocator, mode=NodeMode.CGPU, placement=Placement.BINPACK, gpus=GPUS)
    assert not os.path.exists(long_dir)


def test_only_the_sockets_it_will_serve_must_fit(allocator: RecordingAllocator, tmp_path: Path) -> None:
    """A directory that holds cgpu's own sockets is fine on a node without
    MIG, however long a MIG profile's socket name could be."""
    longest = max(len(n) for n in SOCKET_NAMES.values())
    room = 107 - len(os.fsencode(tmp_path)) - 2 - longest  # "/" twice, sun_path's 107 usable bytes
    snug = tmp_path / ("d" * room)
    assert len(os.fsencode(snug / "cgpu-mig-1c.7g.100gb.me.sock")) > 107  # the old worst-case check refused it
    DevicePlugin(PluginSettings(snug), allocator, mode=NodeMode.CGPU, placement=Placement.BINPACK, gpus=GPUS)


def test_sockets_a_killed_cgpud_left_are_replaced(
    directory: Path, kubelet: Kubelet, allocator: RecordingAllocator
) -> None:
    import socket

    stale = directory / SOCKET_NAMES[Resource.GPU_MEM]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # the file stays, nothing answers on it
    p = start_plugin(directory, allocator)
    try:
        kubelet.take_registrations(len(Resource))
        assert first_list_size(directory, Resource.GPU_MEM) == 24
    finally:
        p.stop(grace=0.5)


def test_a_socket_another_live_server_holds_is_not_taken(
    directory: Path, kubelet: Kubelet, allocator: RecordingAllocator
) -> None:
    held = directory / SOCKET_NAMES[Resource.GPU_COUNT]
    other = grpc.server(ThreadPoolExecutor(max_workers=1))  # another cgpud, say
    assert other.add_insecure_port(f"unix:{held}") != 0
    other.start()
    p = start_plugin(directory, allocator)
    try:
        time.sleep(0.5)
        assert kubelet.registered.empty()  # half a plugin is not registered
        p.stop(grace=0.5)
        assert held.exists()  # stopping removes only its own sockets
    finally:
        p.stop(grace=0.5)
        other.stop(None).wait(WAIT)


# ---- cgpud itself: the process, the simulated GPUs, the test as kubelet


def test_cgpud_in_kubernetes_mode_registers_and_reports_a_lost_gpu(sim_env: dict[str, str]) -> None:
    """The whole node side but the API server (none here: cgpud says so and
    runs on its configured mode): cgpud registers every resource with the
    kubelet, advertises the simulated GPUs by its mode, and a GPU lost in
    the simulator (injected from another process) turns Unhealthy in
    ListAndWatch, then Healthy after it is reset."""
    import json
    import subprocess
    import sys

    from tests.harness.daemon import running_daemon
    from tests.harness.sim_fault import inject_fault

    base = Path(tempfile.mkdtemp(prefix="dpd-", dir="/tmp"))
    plugins = base / "dp"
    plugins.mkdir()
    kubelet = Kubelet(plugins).start()
    env = dict(sim_env, NODE_NAME="gpu-node-1")

    try:
        with running_daemon(
            base,
            env,
            "--orchestrator",
            "kubernetes",
            "--mode",
            "core_mem",
            "--device-plugin-dir",
            str(plugins),
            "--kubeconfig",
            str(base / "no-kubeconfig"),
            "--cdi-dir",
            str(base / "cdi"),
            "--pod-resources-socket",
            str(base / "pr.sock"),
            "--gpu-health-probe-interval",
            "0.2",
        ) as daemon:
            take_every_registration(kubelet)
            # Two simulated GPUs of 16 GiB (tests/conftest.py).
            assert {resource: first_list_size(plugins, resource) for resource in Resource} == {
                Resource.GPU_MEM: 32,
                Resource.GPU_COUNT: 2,
                Resource.GPU_CORE: 200,
                Resource.GPU_TOPOLOGY: 0,
                Resource.NVIDIA_GPU: 0,
            }

            inventory = subprocess.run(
                [sys.executable, "-m", "cgpud.daemon.main", "--inventory"],
                env=env,
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            uuids = [g["uuid"] for g in json.loads(inventory.stdout)["gpus"]]
            stream = list_and_watch(plugins, Resource.GPU_COUNT, timeout=30)
            assert devices(next(stream)) == {uuids[0]: "Healthy", uuids[1]: "Healthy"}
            inject_fault(env, "--gpu", "1", "--lost")
            lost = devices(next(stream))
            assert lost == {uuids[0]: "Healthy", uuids[1]: "Unhealthy"}
            inject_fault(env, "--gpu", "1", "--recover")
            assert set(devices(next(stream)).values()) == {"Healthy"}
            stream.cancel()
            assert "API server cannot be reached" in daemon.log.read_text()
        # cgpud stopped: its sockets are gone, the kubelet's is not.
        assert not list(plugins.glob("cgpu-*.sock"))
        assert kubelet.socket.exists()
    finally:
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_whole_gpus_are_preferred_by_their_links(
    directory: Path, kubelet: Kubelet, allocator: RecordingAllocator
) -> None:
    """Two NVLink-bridged pairs on two sockets (the links as cgpud reads them
    through NVML, cgpud.node.inventory): one GPU is taken from the pair that
    is broken already, and a pair stays a pair."""
    uuids = [f"GPU-6a1e0c55-{i}{i}{i}{i}-4c3e-8f00-{i}" for i in range(4)]
    gpus = tuple(GpuCapacity(i, u, 16 * GIB) for i, u in enumerate(uuids))
    plugin = DevicePlugin(
        PluginSettings(directory, register_timeout=0.5),
        allocator,
        mode=NodeMode.DEFAULT,
        placement=Placement.BINPACK,
        gpus=gpus,
        links=NVLINK_PAIRS,
    ).start()
    try:
        kubelet.take_registrations(len(Resource))
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=uuids[:3], allocation_size=1),
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=uuids, must_include_deviceIDs=[uuids[3]], allocation_size=2
                ),
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=[uuids[1], uuids[2], uuids[3]], allocation_size=2
                ),
            ]
        )
        answer = stub(directory, Resource.NVIDIA_GPU).GetPreferredAllocation(request, timeout=WAIT)
        chosen = [sorted(uuids.index(d) for d in r.deviceIDs) for r in answer.container_responses]
        assert chosen == [[2], [2, 3], [2, 3]]
    finally:
        plugin.stop(grace=0.5)
