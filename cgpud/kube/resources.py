"""Which extended resources this node advertises to the kubelet, with
which device IDs, and how those IDs are read back. Pure functions: the
device plugin (cgpud/kube/plugin.py) does the I/O.

The kubelet counts devices, not bytes or percent, so shares are cut into
devices as ACK's gpushare and cGPU cut them:

| mode                | resource                           | one device per              | device ID               |
|---------------------|------------------------------------|-----------------------------|-------------------------|
| cgpu, share, mps,   | aliyun.com/gpu-mem                 | whole GiB of each GPU       | `<GPU UUID>-_-<j>`      |
| core_mem            | aliyun.com/gpu-count               | GPU                         | `<GPU UUID>`            |
| core_mem            | aliyun.com/gpu-core.percentage     | percent of a GPU (100 each) | `<GPU UUID>-_-c<j>`     |
| topology            | aliyun.com/gpu                     | GPU                         | `<GPU UUID>`            |
| default             | nvidia.com/gpu                     | GPU                         | `<GPU UUID>`            |

Every resource is advertised in every mode; those the mode does not use
have no devices, so a mode change moves capacity instead of leaving the old
mode's capacity on the Node. A device is Unhealthy when its GPU is.

MIG (cgpud/kube/mig.py): a GPU in MIG mode makes no device of these
resources (no CUDA process can use it whole, and cgpu does not share it);
its MIG devices are served by the MIG strategy's plan, their device ID the
MIG UUID: under `single` as `nvidia.com/gpu` on a default node, under
`mixed` as `nvidia.com/mig-<profile>` in every mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from cgpud.node import topology
from cgpud.node.topology import Links
from cgpud.node.model import GpuCapacity, NodeMode, Placement
from cgpud.errors import UsageError
from cgpud.kube.mig import RESOURCE_GPU, MigPlan
from cgpud.kube.model import AllocationError, Resource
from cgpud.units import GIB

# gpushare's separator between a GPU's UUID and the unit number.
ID_SEPARATOR = "-_-"
# Marks a compute unit, so a gpu-core ID never reads as a gpu-mem one.
CORE_PREFIX = "c"
CORE_UNITS_PER_GPU = 100
# The kubelet refuses longer device IDs.
MAX_DEVICE_ID = 63

# Resources whose devices are slices of one GPU (memory GiB, compute
# percent), as opposed to whole GPUs.
SLICED = (Resource.GPU_MEM, Resource.GPU_CORE)

_SHARED = (Resource.GPU_MEM, Resource.GPU_COUNT)
_BY_MODE: dict[str, tuple[Resource, ...]] = {
    NodeMode.CGPU.value: _SHARED,
    NodeMode.SHARE.value: _SHARED,
    NodeMode.MPS.value: (*_SHARED, Resource.GPU_CORE),  # the share is MPS's active thread percentage
    NodeMode.CORE_MEM.value: (*_SHARED, Resource.GPU_CORE),
    "topology": (Resource.GPU_TOPOLOGY,),
    NodeMode.DEFAULT.value: (Resource.NVIDIA_GPU,),
}

# Socket file names in the device-plugins directory: cgpu-<short>.sock.
SOCKET_NAMES: dict[Resource, str] = {
    Resource.GPU_MEM: "cgpu-gpu-mem.sock",
    Resource.GPU_COUNT: "cgpu-gpu-count.sock",
    Resource.GPU_CORE: "cgpu-gpu-core.sock",
    Resource.GPU_TOPOLOGY: "cgpu-gpu-topology.sock",
    Resource.NVIDIA_GPU: "cgpu-nvidia-gpu.sock",
}


def socket_name(resource: Resource | str) -> str:
    """cgpu-<short>.sock; a MIG resource's: cgpu-mig-1g.10gb.sock."""
    if isinstance(resource, Resource):
        return SOCKET_NAMES[resource]
    known = {r.value: n for r, n in SOCKET_NAMES.items()}
    return known.get(resource) or "cgpu-" + resource.rpartition("/")[2] + ".sock"


@dataclass(frozen=True)
class PluginGpu:
    """What the device lists need to know of one GPU."""

    index: int
    uuid: str
    memory: int  # bytes
    healthy: bool = True


@dataclass(frozen=True)
class PluginDevice:
    """One device of one resource as the kubelet sees it."""

    id: str
    healthy: bool


@dataclass(frozen=True)
class DeviceUnit:
    """A device ID read back: which GPU, and which unit of it (the GiB or
    percent number for sliced resources, 0 for whole GPUs)."""

    gpu_uuid: str
    unit: int


def resources_for(mode: NodeMode | str) -> tuple[Resource, ...]:
    """The resources `mode` gives devices to; the others get none."""
    value = mode.value if isinstance(mode, NodeMode) else str(mode)
    try:
        return _BY_MODE[value]
    except KeyError:
        names = ", ".join(_BY_MODE)
        raise UsageError(f"unknown node mode {value!r} (ack.node.gpu.schedule): use one of {names}") from None


def units_of(resource: Resource, gpu: PluginGpu) -> int:
    """How many devices of `resource` one GPU makes when it is advertised."""
    if resource is Resource.GPU_MEM:
        return gpu.memory // GIB  # a part GiB cannot be asked for: rounded down
    if resource is Resource.GPU_CORE:
        return CORE_UNITS_PER_GPU
    return 1


def device_id(resource: Resource, gpu_uuid: str, unit: int = 0) -> str:
    if resource is Resource.GPU_MEM:
        return f"{gpu_uuid}{ID_SEPARATOR}{unit}"
    if resource is Resource.GPU_CORE:
        return f"{gpu_uuid}{ID_SEPARATOR}{CORE_PREFIX}{unit}"
    return gpu_uuid


def devices_for(resource: Resource, mode: NodeMode | str, gpus: Iterable[PluginGpu]) -> tuple[PluginDevice, ...]:
    """The device list of `resource` on a node in `mode`: empty when the
    mode does not use the resource."""
    if resource not in resources_for(mode):
        return ()
    devices = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        for unit in range(units_of(resource, gpu)):
            devices.append(PluginDevice(device_id(resource, gpu.uuid, unit), gpu.healthy))
    return tuple(devices)


def advertised(
    mode: NodeMode | str, gpus: Sequence[PluginGpu], mig: MigPlan | None = None
) -> dict[str, tuple[PluginDevice, ...]]:
    """Every resource with its device list (empty for other modes' ones),
    keyed by resource name; with a MIG plan, its resources too."""
    hidden = set(mig.hidden) if mig else set()
    whole = [g for g in gpus if g.index not in hidden]
    lists: dict[str, tuple[PluginDevice, ...]] = {r.value: devices_for(r, mode, whole) for r in Resource}
    if mig is None:
        return lists
    healthy = {g.index: g.healthy for g in gpus}
    for name in mig.resources():
        lists[name] = ()
    extra: dict[str, list[PluginDevice]] = {}
    for served in mig.served:
        if served.resource == RESOURCE_GPU and RESOURCE_GPU not in [r.value for r in resources_for(mode)]:
            continue  # single serves nvidia.com/gpu where the mode does: on default nodes
        device = PluginDevice(served.device.uuid, healthy.get(served.device.parent_index, True))
        extra.setdefault(served.resource, []).append(device)
    for name, devices in extra.items():
        lists[name] = lists.get(name, ()) + tuple(devices)
    return lists


def check_device_ids(
    resource: Resource | str, device_ids: Iterable[str], devices: Iterable[PluginDevice]
) -> tuple[DeviceUnit, ...]:
    """Read back device IDs the kubelet sent for `resource`, each of which
    must be one this node advertises for it now. An ID from another node,
    another mode or an older inventory (a kubelet checkpoint can hold those)
    is an AllocationError naming it."""
    known = {d.id for d in devices}
    units = []
    unknown = []
    for raw in device_ids:
        if raw not in known:
            unknown.append(raw)
            continue
        units.append(decode_device_id(resource, raw))
    if unknown:
        shown = ", ".join(repr(u) for u in unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        what = "its mode advertises none" if not known else f"it advertises {len(known)} other devices"
        raise AllocationError(
            f"unknown device ID {shown} for {name_of(resource)}: this node does not advertise it ({what}); "
            "the kubelet's checkpoint may be from before a node mode or GPU change: delete the pod and create it again"
        )
    return tuple(units)


def name_of(resource: Resource | str) -> str:
    return resource.value if isinstance(resource, Resource) else resource


def decode_device_id(resource: Resource | str, raw: str) -> DeviceUnit:
    """The GPU (or MIG device) and unit a device ID of `resource` names, by its shape alone."""
    if resource not in SLICED:
        if not raw or ID_SEPARATOR in raw:
            raise AllocationError(f"device ID {raw!r} is not a GPU UUID, which is what {name_of(resource)} devices are")
        return DeviceUnit(raw, 0)
    uuid, sep, unit = raw.rpartition(ID_SEPARATOR)
    if resource is Resource.GPU_CORE:
        ok = unit.startswith(CORE_PREFIX)
        unit = unit[len(CORE_PREFIX) :]
    else:
        ok = True
    if not (sep and uuid and ok and unit.isdigit() and unit.isascii()):
        shape = device_id(Resource(resource), "<GPU UUID>", 0).replace("0", "<n>")
        raise AllocationError(f"device ID {raw!r} is not one of {name_of(resource)}'s (they read {shape})")
    return DeviceUnit(uuid, int(unit))


def preferred(
    resource: Resource | str,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    placement: Placement,
    gpu_order: Mapping[str, int] | None = None,
    links: Links | None = None,
) -> tuple[str, ...]:
    """GetPreferredAllocation for one container: `size` IDs out of
    `available`, `must_include` among them.

    For sliced resources the units come from one GPU when one has enough
    free: with binpack the GPU with the fewest free units that still fits
    (fill GPUs one by one), with spread the one with the most free. When
    none fits alone, units are taken GPU by GPU in that order. Whole-GPU
    resources are the best-joined set by `links` (cgpud.node.topology;
    NVLink, then the PCIe path), else in GPU order: each GPU is one device,
    so there is nothing to fill or balance.
    `gpu_order` maps a GPU UUID to its index to break ties and order
    whole GPUs; UUIDs it lacks sort last, by UUID."""
    if size < 0:
        raise AllocationError(f"preferred allocation of {size} devices of {name_of(resource)}: a size is 0 or more")
    order = gpu_order or {}
    chosen = list(dict.fromkeys(must_include))
    if len(chosen) >= size:
        return tuple(chosen[:size])
    taken = set(chosen)
    free = [d for d in dict.fromkeys(available) if d not in taken]

    def gpu_key(uuid: str) -> tuple[int, str]:
        return (order.get(uuid, len(order)), uuid)

    if resource not in SLICED:
        if links is not None and all(u in order for u in (*chosen, *free)) and len(chosen) + len(free) >= size:
            uuid_of = {order[u]: u for u in (*chosen, *free)}
            best = topology.best_set(links, [order[u] for u in (*chosen, *free)], size, [order[u] for u in chosen])
            return tuple(chosen + [uuid_of[i] for i in best if uuid_of[i] not in taken])
        free.sort(key=gpu_key)
        return tuple(chosen + free[: size - len(chosen)])

    by_gpu: dict[str, list[tuple[int, str]]] = {}
    for raw in free:
        try:
            unit = decode_device_id(resource, raw)
        except AllocationError:
            continue  # not ours to prefer; the kubelet may still pick it
        by_gpu.setdefault(unit.gpu_uuid, []).append((unit.unit, raw))
    for units in by_gpu.values():
        units.sort()
    need = size - len(chosen)
    # The GPUs already in must_include come first: stay on them.
    pinned = {decode_device_id(resource, d).gpu_uuid for d in chosen if _decodes(resource, d)}

    def rank(uuid: str) -> tuple[int, int, int, tuple[int, str]]:
        free_units = len(by_gpu[uuid])
        fits = 0 if free_units >= need else 1
        fullness = free_units if placement is Placement.BINPACK else -free_units
        return (0 if uuid in pinned else 1, fits, fullness, gpu_key(uuid))

    gpus = sorted(by_gpu, key=rank)
    for uuid in gpus:
        for _, raw in by_gpu[uuid]:
            if len(chosen) == size:
                break
            chosen.append(raw)
    return tuple(chosen)


def _decodes(resource: Resource | str, raw: str) -> bool:
    try:
        decode_device_id(resource, raw)
    except AllocationError:
        return False
    return True


class _Devices(Protocol):
    """A pod-resources entry (cgpud.kube.pod_resources.ContainerDevices)."""

    @property
    def namespace(self) -> str: ...

    @property
    def pod(self) -> str: ...

    @property
    def container(self) -> str: ...

    @property
    def resource(self) -> str: ...

    @property
    def device_ids(self) -> tuple[str, ...]: ...


def whole_gpus_held(listed: Iterable[_Devices], gpus: Sequence[GpuCapacity]) -> dict[int, str]:
    """The GPUs the kubelet lists as given to containers whole (nvidia.com/gpu,
    aliyun.com/gpu: device IDs are GPU UUIDs): index -> "namespace/pod/container"."""
    by_uuid = {g.uuid: g.index for g in gpus}
    whole = (Resource.NVIDIA_GPU.value, Resource.GPU_TOPOLOGY.value)
    return {
        by_uuid[d]: f"{e.namespace}/{e.pod}/{e.container}"
        for e in listed
        if e.resource in whole
        for d in e.device_ids
        if d in by_uuid
    }
