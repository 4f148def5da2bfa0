"""What the device plugin and the Kubernetes side of cgpud hand each other:
resource names as ACK has them, and one container's allocation."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol
from collections.abc import Sequence

from cgpud.containers.devices import DeviceNode
from cgpud.errors import UsageError

# Device plugin API version the kubelet's Registration expects.
DEVICE_PLUGIN_VERSION = "v1beta1"
DEFAULT_DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
# Pods without a PriorityClass have priority 0: by default none may ask for a
# compute weight or high priority (cgpud.kube.share_priority).
DEFAULT_MIN_POD_PRIORITY = 1
# Runtimes read dynamic CDI specs here; cgpud writes its pod instances' specs.
DEFAULT_CDI_DIR = "/var/run/cdi"


class Resource(str, Enum):
    """Extended resources, named as ACK's gpushare and cGPU name them."""

    GPU_MEM = "aliyun.com/gpu-mem"  # one device per GiB
    GPU_COUNT = "aliyun.com/gpu-count"  # one device per GPU
    GPU_CORE = "aliyun.com/gpu-core.percentage"  # one device per percent, 100 per GPU
    GPU_TOPOLOGY = "aliyun.com/gpu"  # topology mode: whole GPUs
    NVIDIA_GPU = "nvidia.com/gpu"  # default (exclusive) mode: whole GPUs


# Pod annotations the scheduler (gpushare's extender, or cgpu-scheduler) writes
# at bind, and the device plugin reads and completes at Allocate.
ANNOTATION_GPU_INDEX = "ALIYUN_COM_GPU_MEM_IDX"
ANNOTATION_GPU_MEM_DEV = "ALIYUN_COM_GPU_MEM_DEV"
ANNOTATION_POD_MEMORY = "ALIYUN_COM_GPU_MEM_POD"
ANNOTATION_ASSUME_TIME = "ALIYUN_COM_GPU_MEM_ASSUME_TIME"
ANNOTATION_ASSIGNED = "ALIYUN_COM_GPU_MEM_ASSIGNED"
ANNOTATION_ALLOCATION = "scheduler.framework.gpushare.allocation"

# On the Node: HOST:PORT of its cgpud's Capacity API (cgpu.v1.Capacity),
# where cgpu-scheduler finds it.
ANNOTATION_CAPACITY_ADDRESS = "cgpu.io/capacity-address"

LABEL_MODE = "ack.node.gpu.schedule"
LABEL_PLACEMENT = "ack.node.gpu.placement"


class AllocationError(UsageError):
    """Allocate cannot be met; the message says what a person can do about it.
    The kubelet shows it in the pod's events."""


# Where the NVIDIA toolkit reads a container's device list from (its
# volume-mounts strategy): one mount per GPU UUID, whose source does not
# matter. cgpuctl runtime configure --nvidia-toolkit makes it the only way.
TOOLKIT_DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"


@dataclass(frozen=True)
class MountSpec:
    host_path: str
    container_path: str
    read_only: bool = True


@dataclass(frozen=True)
class ContainerAllocation:
    """The answer for one container of one Allocate call (the kubelet's
    ContainerAllocateResponse): CDI device names first, and the env and mounts
    for runtimes that do not apply CDI."""

    cdi_devices: tuple[str, ...] = ()
    envs: dict[str, str] = field(default_factory=dict)
    mounts: tuple[MountSpec, ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)
    devices: tuple[DeviceNode, ...] = ()  # the driver's device nodes (whole GPUs)


class Allocator(Protocol):
    """Turns one container's device IDs of one resource into its allocation.
    Raises AllocationError when the request cannot be met; never answers with
    a fake device."""

    def allocate(self, resource: Resource | str, device_ids: Sequence[str]) -> ContainerAllocation: ...
