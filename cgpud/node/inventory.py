"""What GPUs this node has, read from NVML through pynvml. The same code
runs on a real driver and on any library that speaks the NVML ABI."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import pynvml

from cgpud.errors import GpuQueryError
from cgpud.node.mig import mig_profile_name
from cgpud.node.model import GpuCapacity
from cgpud.node.topology import SYSTEM, Link
from cgpud.units import MIB

T = TypeVar("T")


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a compute instance of a GPU instance) as NVML reports
    it. `profile` is NVIDIA's name for it ("1g.10gb", "1c.3g.40gb"), made as
    the device plugin makes it (cgpud.node.mig)."""

    uuid: str  # "MIG-..."
    parent_index: int
    gpu_instance: int
    compute_instance: int
    profile: str
    memory_total: int  # bytes
    sm_count: int
    gi_slices: int
    ci_slices: int
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpegs: int = 0
    ofas: int = 0


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_total: int  # bytes
    sm_count: int | None  # None where the driver does not report it
    pci_bus_id: str
    minor_number: int
    compute_capability: tuple[int, int]
    nvlink_peers: tuple[str, ...]  # PCI bus ids at the far end of active links, one per link
    # The PCIe common ancestor (an NVML topology level) with each GPU, by index.
    pcie_levels: tuple[int, ...] = ()
    nvswitch_links: int = 0  # links into an NVSwitch fabric, which joins every GPU on it
    mig_capable: bool = False  # NVML answers its MIG mode (Ampere and newer data-centre GPUs)
    mig_mode: bool = False  # MIG enabled: the GPU's memory and SMs belong to its MIG devices
    mig_devices: tuple[MigDevice, ...] = ()


@dataclass(frozen=True)
class Inventory:
    driver_version: str
    cuda_driver_version: int
    gpus: tuple[Gpu, ...]

    def card_labels(self) -> dict[str, str]:
        """The card-model facts ACK exposes as node labels (first GPU's model;
        ACK nodes hold one model). Memory in whole MiB, as ACK writes it."""
        if not self.gpus:
            return {"aliyun.accelerator/nvidia_count": "0"}
        first = self.gpus[0]
        return {
            "aliyun.accelerator/nvidia_name": first.name.replace(" ", "-"),
            "aliyun.accelerator/nvidia_mem": f"{first.memory_total // MIB}MiB",
            "aliyun.accelerator/nvidia_count": str(len(self.gpus)),
        }

    def links(self) -> dict[tuple[int, int], Link]:
        """How each pair of GPUs is joined: the placement decisions' view
        (cgpud.node.topology)."""
        by_bus = {pci_key(g.pci_bus_id): g.index for g in self.gpus}
        by_bus.pop(None, None)  # an unreadable bus id matches nothing
        found = {}
        for a, b in itertools.combinations(self.gpus, 2):
            level = a.pcie_levels[b.index] if b.index < len(a.pcie_levels) else SYSTEM
            nvlinks = sum(1 for bus in a.nvlink_peers if by_bus.get(pci_key(bus)) == b.index)
            # Through the switches each pair can use all the links the lesser GPU has.
            nvlinks += min(a.nvswitch_links, b.nvswitch_links)
            found[(a.index, b.index)] = Link(level, nvlinks)
        return found

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["labels"] = self.card_labels()
        return data


def _query(what: str, fn: Callable[..., T], *args: Any) -> T:
    """Every NVML call goes through here: one place maps NVML errors."""
    try:
        return fn(*args)
    except pynvml.NVMLError as e:
        raise GpuQueryError(f"NVML {what} failed: {e}") from e


def pci_key(bus_id: str) -> tuple[int, ...] | None:
    """ "00000000:17:00.0" and "0000:17:00.0" name the same function."""
    try:
        domain, bus, rest = bus_id.strip().split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except ValueError:
        return None


def capacities(
    inventory: Inventory,
    node_of: Callable[[int], str],
    mig_share: bool = False,
    mig_nodes: Mapping[str, tuple[str, ...]] | None = None,
) -> tuple[GpuCapacity, ...]:
    """What placement knows of the node's GPUs: each GPU (node_of gives its
    device node from its minor number; a GPU in MIG mode marked so, and
    counted full), then with `mig_share` each MIG device as one more GPU of
    its own memory, on its GPU's device node and its capability nodes
    (`mig_nodes` by MIG UUID), numbered after the GPUs."""
    gpus = [
        GpuCapacity(g.index, g.uuid, g.memory_total, node_of(g.minor_number), mig=g.mig_mode) for g in inventory.gpus
    ]
    if mig_share:
        for g in inventory.gpus:
            for m in g.mig_devices:
                if m.ci_slices != m.gi_slices:
                    continue  # as NVIDIA serves them: whole GPU instances only
                nodes = (mig_nodes or {}).get(m.uuid, ())
                gpus.append(
                    GpuCapacity(
                        len(gpus), m.uuid, m.memory_total, node_of(g.minor_number), parent=g.index, extra_nodes=nodes
                    )
                )
    return tuple(gpus)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _nvlinks(handle: Any) -> tuple[tuple[str, ...], int]:
    """The PCI bus ids at the far end of each active link, and how many of
    those ends are NVSwitches."""
    peers, switched = [], 0
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        except pynvml.NVMLError:
            break  # no such link, or NVLink not supported on this GPU
        peers.append(_text(remote.busId))
        try:
            kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
        except pynvml.NVMLError:
            continue  # older drivers: a GPU's bus id tells a GPU end apart anyway
        switched += kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    return tuple(peers), switched


def _sm_count(handle: Any) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetAttributes(handle).multiprocessorCount)
    except pynvml.NVMLError:
        return None  # older GPUs and drivers answer "not supported"


def _mig_mode(handle: Any) -> tuple[bool, bool]:
    """(MIG capable, MIG enabled now)."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:
        return False, False  # a GPU without MIG answers "not supported"
    return True, bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


def _mig_devices(index: int, handle: Any, gpu_memory: int) -> tuple[MigDevice, ...]:
    """The MIG devices of a GPU in MIG mode, walked as NVIDIA's tools walk
    them: every index up to the maximum, holes skipped."""
    found = []
    for i in range(_query("MIG device count", pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
            continue
        except pynvml.NVMLError as e:
            raise GpuQueryError(f"NVML MIG device {i} of GPU {index} failed: {e}") from e
        attrs = _query("MIG device attributes", pynvml.nvmlDeviceGetAttributes, mig)
        memory = int(_query("MIG device memory", pynvml.nvmlDeviceGetMemoryInfo, mig).total)
        found.append(
            MigDevice(
                uuid=_text(_query("MIG device UUID", pynvml.nvmlDeviceGetUUID, mig)),
                parent_index=index,
                gpu_instance=int(_query("GPU instance id", pynvml.nvmlDeviceGetGpuInstanceId, mig)),
                compute_instance=int(_query("compute instance id", pynvml.nvmlDeviceGetComputeInstanceId, mig)),
                profile=mig_profile_name(
                    attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount, attrs.memorySizeMB, gpu_memory
                ),
                memory_total=memory,
                sm_count=int(attrs.multiprocessorCount),
                gi_slices=int(attrs.gpuInstanceSliceCount),
                ci_slices=int(attrs.computeInstanceSliceCount),
                copy_engines=int(attrs.sharedCopyEngineCount),
                decoders=int(attrs.sharedDecoderCount),
                encoders=int(attrs.sharedEncoderCount),
                jpegs=int(attrs.sharedJpegCount),
                ofas=int(attrs.sharedOfaCount),
            )
        )
    return tuple(found)


def _pcie_level(handle: Any, other: Any) -> int:
    try:
        return int(pynvml.nvmlDeviceGetTopologyCommonAncestor(handle, other))
    except pynvml.NVMLError:
        return SYSTEM  # not reported (some drivers, virtual GPUs): assume the farthest


def _gpu(index: int, handles: Sequence[Any]) -> Gpu:
    h = handles[index]
    peers, switched = _nvlinks(h)
    memory = _query("memory info", pynvml.nvmlDeviceGetMemoryInfo, h)
    pci = _query("PCI info", pynvml.nvmlDeviceGetPciInfo, h)
    capable, mig = _mig_mode(h)
    return Gpu(
        index=index,
        uuid=_text(_query("UUID", pynvml.nvmlDeviceGetUUID, h)),
        name=_text(_query("name", pynvml.nvmlDeviceGetName, h)),
        memory_total=int(memory.total),
        sm_count=_sm_count(h),
        pci_bus_id=_text(pci.busId),
        minor_number=_query("minor number", pynvml.nvmlDeviceGetMinorNumber, h),
        compute_capability=tuple(_query("compute capability", pynvml.nvmlDeviceGetCudaComputeCapability, h)),
        nvlink_peers=peers,
        pcie_levels=tuple(_pcie_level(h, o) for o in handles),
        nvswitch_links=switched,
        mig_capable=capable,
        mig_mode=mig,
        mig_devices=_mig_devices(index, h, int(memory.total)) if mig else (),
    )


class NvmlHandles:
    """NVML started for its owner's life (until close) and a handle of each
    GPU of `indexes` it answers for. `nvml` is the pynvml module or a
    stand-in. Failures are logged as errors: `down` when NVML does not start
    (`up` is False and there is no handle), `lost` (with the GPU) for a GPU
    it does not find (left out)."""

    def __init__(self, nvml: Any, indexes: Iterable[int], log: Any, down: str, lost: str) -> None:
        self.nvml = nvml
        self.handles: dict[int, Any] = {}
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            log.error(down, error=str(e))
            self.up = False
            return
        self.up = True
        for index in indexes:
            try:
                self.handles[index] = nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError as e:
                log.error(lost, gpu=index, error=str(e))

    def close(self) -> None:
        if self.up:
            self.up = False
            self.handles.clear()
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError:
                pass  # nothing is left to release


def read_inventory() -> Inventory:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise GpuQueryError(
            f"cannot initialise NVML ({e}): is the NVIDIA driver installed and libnvidia-ml.so.1 findable?"
        ) from e
    try:
        count = _query("device count", pynvml.nvmlDeviceGetCount)
        handles = [_query(f"handle of GPU {i}", pynvml.nvmlDeviceGetHandleByIndex, i) for i in range(count)]
        return Inventory(
            driver_version=_text(_query("driver version", pynvml.nvmlSystemGetDriverVersion)),
            cuda_driver_version=_query("CUDA driver version", pynvml.nvmlSystemGetCudaDriverVersion),
            gpus=tuple(_gpu(i, handles) for i in range(count)),
        )
    finally:
        pynvml.nvmlShutdown()
