"""The device lists per node mode and the reading back of device IDs."""

from __future__ import annotations

import pytest

from cgpud.node.model import NodeMode, Placement
from cgpud.errors import UsageError
from cgpud.kube import resources
from cgpud.kube.model import AllocationError, Resource
from cgpud.kube.resources import DeviceUnit, PluginDevice, PluginGpu
from cgpud.units import GIB, MIB

UUID0 = "GPU-3b5b1c4e-0000-4a5e-9f00-000000000000"
UUID1 = "GPU-3b5b1c4e-1111-4a5e-9f00-111111111111"
# 16 GiB and a part GiB that cannot be asked for.
GPUS = (PluginGpu(0, UUID0, 16 * GIB), PluginGpu(1, UUID1, 8 * GIB + 512 * MIB))
ORDER = {UUID0: 0, UUID1: 1}


def ids(devices: tuple[PluginDevice, ...]) -> list[str]:
    return [d.id for d in devices]


@pytest.mark.parametrize("mode", [NodeMode.CGPU, NodeMode.SHARE])
def test_memory_modes_advertise_gib_and_gpu_count_only(mode: NodeMode) -> None:
    lists = resources.advertised(mode, GPUS)
    assert set(lists) == set(Resource)  # every resource, so none keeps stale capacity
    assert len(lists[Resource.GPU_MEM]) == 16 + 8  # whole GiB only
    assert ids(lists[Resource.GPU_MEM])[:2] == [f"{UUID0}-_-0", f"{UUID0}-_-1"]
    assert ids(lists[Resource.GPU_MEM])[16] == f"{UUID1}-_-0"
    assert ids(lists[Resource.GPU_COUNT]) == [UUID0, UUID1]
    for other in (Resource.GPU_CORE, Resource.GPU_TOPOLOGY, Resource.NVIDIA_GPU):
        assert lists[other] == ()


@pytest.mark.parametrize("mode", [NodeMode.CORE_MEM, NodeMode.MPS])
def test_compute_share_modes_add_a_hundred_percent_per_gpu(mode: NodeMode) -> None:
    lists = resources.advertised(mode, GPUS)
    core = ids(lists[Resource.GPU_CORE])
    assert len(core) == 200
    assert core[0] == f"{UUID0}-_-c0" and core[199] == f"{UUID1}-_-c99"
    assert len(lists[Resource.GPU_MEM]) == 24 and len(lists[Resource.GPU_COUNT]) == 2
    assert lists[Resource.NVIDIA_GPU] == () and lists[Resource.GPU_TOPOLOGY] == ()


def test_default_and_topology_give_whole_gpus_under_their_own_names() -> None:
    default = resources.advertised(NodeMode.DEFAULT, GPUS)
    assert ids(default[Resource.NVIDIA_GPU]) == [UUID0, UUID1]
    assert all(default[r] == () for r in Resource if r is not Resource.NVIDIA_GPU)
    topology = resources.advertised("topology", GPUS)
    assert ids(topology[Resource.GPU_TOPOLOGY]) == [UUID0, UUID1]
    assert all(topology[r] == () for r in Resource if r is not Resource.GPU_TOPOLOGY)


def test_device_ids_fit_the_kubelets_limit() -> None:
    lists = resources.advertised(NodeMode.CORE_MEM, GPUS)
    assert max(len(d.id) for devs in lists.values() for d in devs) <= resources.MAX_DEVICE_ID


def test_an_unhealthy_gpu_makes_its_devices_unhealthy_and_no_others() -> None:
    gpus = (GPUS[0], PluginGpu(1, UUID1, 8 * GIB, healthy=False))
    lists = resources.advertised(NodeMode.CORE_MEM, gpus)
    for resource in (Resource.GPU_MEM, Resource.GPU_CORE, Resource.GPU_COUNT):
        for d in lists[resource]:
            assert d.healthy == d.id.startswith(UUID0), d


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(UsageError, match="unknown node mode 'exclusive'"):
        resources.resources_for("exclusive")


def test_device_ids_read_back_to_gpu_and_unit() -> None:
    assert resources.decode_device_id(Resource.GPU_MEM, f"{UUID1}-_-7") == DeviceUnit(UUID1, 7)
    assert resources.decode_device_id(Resource.GPU_CORE, f"{UUID0}-_-c42") == DeviceUnit(UUID0, 42)
    assert resources.decode_device_id(Resource.NVIDIA_GPU, UUID0) == DeviceUnit(UUID0, 0)


@pytest.mark.parametrize(
    "resource,raw",
    [
        (Resource.GPU_MEM, UUID0),  # no unit
        (Resource.GPU_MEM, f"{UUID0}-_-x"),
        (Resource.GPU_MEM, "-_-3"),  # no GPU
        (Resource.GPU_CORE, f"{UUID0}-_-3"),  # a memory ID sent to the core plugin
        (Resource.GPU_COUNT, f"{UUID0}-_-3"),
    ],
)
def test_malformed_device_ids_are_refused(resource: Resource, raw: str) -> None:
    with pytest.raises(AllocationError, match="device ID"):
        resources.decode_device_id(resource, raw)


def test_ids_not_advertised_now_are_refused_by_name() -> None:
    devices = resources.devices_for(Resource.GPU_MEM, NodeMode.CGPU, GPUS)
    ok = resources.check_device_ids(Resource.GPU_MEM, [f"{UUID0}-_-0", f"{UUID1}-_-7"], devices)
    assert ok == (DeviceUnit(UUID0, 0), DeviceUnit(UUID1, 7))
    # GPU 1 has 8 whole GiB: unit 8 does not exist.
    with pytest.raises(AllocationError, match=f"unknown device ID '{UUID1}-_-8' for aliyun.com/gpu-mem"):
        resources.check_device_ids(Resource.GPU_MEM, [f"{UUID0}-_-0", f"{UUID1}-_-8"], devices)
    none = resources.devices_for(Resource.GPU_CORE, NodeMode.CGPU, GPUS)
    with pytest.raises(AllocationError, match="its mode advertises none"):
        resources.check_device_ids(Resource.GPU_CORE, [f"{UUID0}-_-c0"], none)


def _mem_ids(uuid: str, units: range) -> list[str]:
    return [f"{uuid}-_-{j}" for j in units]


def test_preferred_takes_one_gpu_binpack_the_fullest_that_fits() -> None:
    # GPU0 has 10 GiB free, GPU1 has 4 free.
    available = _mem_ids(UUID0, range(6, 16)) + _mem_ids(UUID1, range(4, 8))
    got = resources.preferred(Resource.GPU_MEM, available, [], 3, Placement.BINPACK, ORDER)
    assert got == tuple(_mem_ids(UUID1, range(4, 7)))
    # 5 GiB does not fit on GPU1: all five from GPU0.
    got = resources.preferred(Resource.GPU_MEM, available, [], 5, Placement.BINPACK, ORDER)
    assert got == tuple(_mem_ids(UUID0, range(6, 11)))


def test_preferred_spread_takes_the_emptiest_gpu() -> None:
    available = _mem_ids(UUID0, range(6, 16)) + _mem_ids(UUID1, range(4, 8))
    got = resources.preferred(Resource.GPU_MEM, available, [], 3, Placement.SPREAD, ORDER)
    assert got == tuple(_mem_ids(UUID0, range(6, 9)))


def test_preferred_keeps_must_include_and_stays_on_its_gpu() -> None:
    available = _mem_ids(UUID0, range(0, 16)) + _mem_ids(UUID1, range(0, 8))
    must = [f"{UUID1}-_-0"]
    got = resources.preferred(Resource.GPU_MEM, available, must, 3, Placement.SPREAD, ORDER)
    assert got == (f"{UUID1}-_-0", f"{UUID1}-_-1", f"{UUID1}-_-2")


def test_preferred_spans_gpus_only_when_none_fits_alone() -> None:
    available = _mem_ids(UUID0, range(14, 16)) + _mem_ids(UUID1, range(6, 8))
    got = resources.preferred(Resource.GPU_MEM, available, [], 3, Placement.BINPACK, ORDER)
    assert len(got) == 3 and len(set(got)) == 3 and set(got) <= set(available)


def test_preferred_whole_gpus_in_index_order() -> None:
    got = resources.preferred(Resource.GPU_COUNT, [UUID1, UUID0], [], 1, Placement.SPREAD, ORDER)
    assert got == (UUID0,)
