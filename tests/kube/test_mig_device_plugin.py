"""MIG devices through cgpud's device plugin, all real parts: a simulated
machine with a GPU in MIG mode read through NVML, the device plugin's gRPC
servers registered with a kubelet's Registration socket
(tests/harness/kubelet.py), the real PodAllocator over a real instance
service; the answer's device then used by a CUDA process."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2 as pb
from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from cgpud.containers.devices import HOST_ROOT
from cgpud.containers.edits import RuntimeFiles
from cgpud.kube.allocator import PodAllocator
from cgpud.kube.apiserver import ApiServer
from cgpud.kube.mig import MigStrategy, plan
from cgpud.kube.model import Resource
from cgpud.kube.plugin import DevicePlugin, PluginSettings
from cgpud.kube.resources import socket_name
from cgpud.node.inventory import Inventory
from cgpud.node.model import GpuCapacity, NodeMode, NodePolicy, Placement
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from tests.harness.api_server import api_server
from tests.harness.kubelet import Kubelet
from tests.harness.sim import read_sim_inventory, sim_env_in
from tests.harness.simrun import run_py

WAIT = 10.0
MIB = 1 << 20
NODE = "node-1"


@pytest.fixture
def directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))  # a unix socket path has 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(directory: Path) -> Iterator[Kubelet]:
    k = Kubelet(directory).start()
    yield k
    k.stop()


@pytest.fixture
def machine(tmp_path: Path, native: Path) -> tuple[dict[str, str], Inventory]:
    env = sim_env_in(tmp_path / "sim", native, mem="80GiB", placements=["mig=3g.40gb,2g.20gb,1g.10gb"])
    return env, read_sim_inventory(env)


def serve(
    directory: Path, tmp_path: Path, inventory: Inventory, strategy: MigStrategy, mode: NodeMode
) -> Iterator[DevicePlugin]:
    gpus = tuple(GpuCapacity(g.index, g.uuid, g.memory_total, mig=g.mig_mode) for g in inventory.gpus)
    service = InstanceService(
        Store(tmp_path / "cgpud.db"), gpus, NodePolicy(mode=mode), tmp_path / "regions", "580.65.06", "boot-1"
    )
    rt = tmp_path / "rt"
    files = RuntimeFiles(rt / "libcgpu.so", rt / "ld.so.preload", rt / "cgpu-hook", tmp_path / "relay.sock")
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    migs = plan(strategy, inventory.gpus)
    with api_server(tmp_path) as (_server, kubeconfig):
        api = ApiServer.connect(kubeconfig, timeout=2.0)
        allocator = PodAllocator(service, api, NODE, files, cdi, HOST_ROOT, migs=migs.by_uuid())
        plugin = DevicePlugin(
            PluginSettings(directory, watch_interval=0.1, register_timeout=2.0),
            allocator,
            mode=mode,
            placement=Placement.BINPACK,
            gpus=gpus,
            mig=migs,
        ).start()
        try:
            yield plugin
        finally:
            plugin.stop(grace=0.5)
            api.close()


def stub(directory: Path, resource: str) -> pb_grpc.DevicePluginStub:
    return pb_grpc.DevicePluginStub(grpc.insecure_channel(f"unix:{directory / socket_name(resource)}"))


def first_list(directory: Path, resource: str) -> list[str]:
    stream = stub(directory, resource).ListAndWatch(pb.Empty(), timeout=WAIT)
    try:
        return [d.ID for d in next(stream).devices]
    finally:
        stream.cancel()


def allocate(directory: Path, resource: str, ids: list[str]) -> pb.ContainerAllocateResponse:
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
    return stub(directory, resource).Allocate(request, timeout=WAIT).container_responses[0]


CUDA_SEES = """
import ctypes as C, json
from cudapy import Driver
cu = Driver(); cu.init_device(0)
name = C.create_string_buffer(128); cu.call("cuDeviceGetName", name, 128, 0)
print(json.dumps([name.value.decode(), cu.mem_info()[1]]))
"""


def test_mixed_registers_a_resource_per_profile_and_allocate_answers_with_the_mig_device(
    directory, kubelet, machine, tmp_path
):
    env, inventory = machine
    migs = [m.uuid for m in inventory.gpus[0].mig_devices]
    for _plugin in serve(directory, tmp_path, inventory, MigStrategy.MIXED, NodeMode.DEFAULT):
        names = {r.resource_name for r in kubelet.take_registrations(len(Resource) + 3)}
        assert names == {r.value for r in Resource} | {
            "nvidia.com/mig-3g.40gb",
            "nvidia.com/mig-2g.20gb",
            "nvidia.com/mig-1g.10gb",
        }
        assert first_list(directory, "nvidia.com/mig-2g.20gb") == [migs[1]]
        assert first_list(directory, Resource.NVIDIA_GPU.value) == [inventory.gpus[1].uuid]
        got = allocate(directory, "nvidia.com/mig-2g.20gb", [migs[1]])
        assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": migs[1], "ALIYUN_COM_GPU_MEM_IDX": "0"}
        assert [m.container_path for m in got.mounts] == [f"/var/run/nvidia-container-devices/{migs[1]}"]
        # What the toolkit makes of NVIDIA_VISIBLE_DEVICES: the process sees that MIG device.
        seen = run_py(dict(env, CUDA_VISIBLE_DEVICES=got.envs["NVIDIA_VISIBLE_DEVICES"]), CUDA_SEES)
        assert seen == ["NVIDIA H100 80GB HBM3 MIG 2g.20gb", 20096 * MIB]
        # A MIG device of another profile on this resource's socket: refused, nothing answered.
        with pytest.raises(grpc.RpcError) as refused:
            allocate(directory, "nvidia.com/mig-2g.20gb", [migs[2]])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"unknown device ID '{migs[2]}' for nvidia.com/mig-2g.20gb" in (refused.value.details() or "")


def test_single_serves_mig_devices_as_nvidia_gpu(directory, kubelet, tmp_path, native):
    env = sim_env_in(tmp_path / "sim", native, mem="80GiB", placements=["mig=3g.40gb,3g.40gb"] * 2)
    inventory = read_sim_inventory(env)
    migs = [m.uuid for g in inventory.gpus for m in g.mig_devices]
    for _plugin in serve(directory, tmp_path, inventory, MigStrategy.SINGLE, NodeMode.DEFAULT):
        assert {r.resource_name for r in kubelet.take_registrations(len(Resource))} == {r.value for r in Resource}
        assert first_list(directory, Resource.NVIDIA_GPU.value) == migs
        got = allocate(directory, Resource.NVIDIA_GPU.value, [migs[3], migs[0]])
        assert got.envs["NVIDIA_VISIBLE_DEVICES"] == f"{migs[3]},{migs[0]}"
        assert got.envs["ALIYUN_COM_GPU_MEM_IDX"] == "0,1"
        # aliyun.com/gpu-mem has nothing on a default node, MIG or not.
        assert first_list(directory, Resource.GPU_MEM.value) == []
