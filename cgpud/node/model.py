"""The daemon's vocabulary: node settings, requests, grants and instances.
Plain frozen data; every decision about them lives in placement.py (pure)
and every I/O in store.py, region.py and the API."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum

from cgpud._scheduler import lib as _sched

from cgpud.units import GIB, MIB  # noqa: F401  (re-exported: the vocabulary speaks in them)


class NodeMode(str, Enum):
    """ACK's `ack.node.gpu.schedule` label values: one mode per node."""

    DEFAULT = "default"  # whole GPUs, exclusive
    SHARE = "share"  # memory bookkeeping and env vars only, no enforcement
    CGPU = "cgpu"  # memory isolation
    CORE_MEM = "core_mem"  # memory and compute isolation
    MPS = "mps"  # memory isolation; compute through NVIDIA MPS
    TOPOLOGY = "topology"  # whole GPUs, exclusive, as aliyun.com/gpu (topology-aware scheduling)


# Modes that give each request whole GPUs, never a share of one.
WHOLE_GPU_MODES = (NodeMode.DEFAULT, NodeMode.TOPOLOGY)
# Modes that give instances a compute share: core_mem by cgpu's time-slice
# scheduler, mps by MPS's active thread percentage.
COMPUTE_SHARE_MODES = (NodeMode.CORE_MEM, NodeMode.MPS)
# Modes whose limits hold: a GPU reached without an instance goes around them.
ISOLATING_MODES = (NodeMode.CGPU, NodeMode.CORE_MEM, NodeMode.MPS)


def isolates(mode: NodeMode) -> bool:
    return mode in ISOLATING_MODES


class Placement(str, Enum):
    """ACK's `ack.node.gpu.placement` label values."""

    BINPACK = "binpack"  # fill one GPU before the next
    SPREAD = "spread"  # balance across GPUs


class Orchestrator(str, Enum):
    """Who writes container specs on this node, and so whether env in a
    spec may ask for a GPU share."""

    STANDALONE = "standalone"  # docker/containerd run by the host's operator
    KUBERNETES = "kubernetes"  # pod authors write env: requests come from the device plugin


MAX_SCHEDULED: int = _sched.CGPU_SCHED_MAX_TENANTS  # tenants one GPU's scheduler core takes


class ComputePolicy(IntEnum):
    """cGPU's numbering of compute policies, as the scheduler core numbers
    them (enum cgpu_sched_policy)."""

    FAIR = _sched.CGPU_SCHED_FAIR
    PREEMPTIVE = _sched.CGPU_SCHED_PREEMPTIVE
    WEIGHTED = _sched.CGPU_SCHED_WEIGHTED
    FIXED = _sched.CGPU_SCHED_FIXED
    SOFT = _sched.CGPU_SCHED_SOFT
    NATIVE = _sched.CGPU_SCHED_NATIVE


class InstanceState(str, Enum):
    RESERVED = "reserved"  # granted, not yet bound to a running owner
    BOUND = "bound"  # its container or process runs
    RELEASED = "released"  # gone; kept for history


ACTIVE_STATES = (InstanceState.RESERVED, InstanceState.BOUND)


class OwnerKind(str, Enum):
    CONTAINER = "container"
    POD = "pod"
    PROCESS = "process"
    # Reserved ahead of its container and handed out as a device (a CDI
    # device; later the device plugin's): containers claim it in turn, and
    # it lives until released (or the node reboots), not with any of them.
    DEVICE = "device"


@dataclass(frozen=True)
class Owner:
    kind: OwnerKind
    id: str  # container id, pod uid, a label for a host process, or a device name


@dataclass(frozen=True)
class PodContainer:
    """One container of one pod, as a pod-owned instance's owner id names it."""

    uid: str
    namespace: str
    name: str
    container: str

    @property
    def owner_id(self) -> str:
        # Namespace and name ride along: the kubelet's pod-resources API
        # knows pods by them, not by UID. None of the four holds a "/".
        return f"{self.uid}/{self.namespace}/{self.name}/{self.container}"

    @property
    def pod_key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @classmethod
    def parse(cls, owner_id: str) -> PodContainer | None:
        parts = owner_id.split("/")
        if len(parts) != 4 or not all(parts):
            return None
        return cls(*parts)


@dataclass(frozen=True)
class GpuCapacity:
    """What placement needs to know of a GPU."""

    index: int
    uuid: str
    memory: int  # bytes
    device_node: str = ""  # /dev/nvidia<minor>; "" where unknown (a view from another node)
    # In MIG mode: its memory belongs to its MIG devices, so cgpu neither
    # shares it nor gives it whole (placement counts it full; docs/modes.md).
    mig: bool = False
    # A MIG device taken as one of the node's GPUs (setting mig_share): the
    # index of the GPU it is on; -1 for a GPU.
    parent: int = -1
    # Device nodes a container needs besides device_node (a MIG device's
    # /dev/nvidia-caps/nvidia-cap<N>).
    extra_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodePolicy:
    """Node settings that decide admission and placement. The defaults are
    cgpud's (DaemonConfig takes them from here)."""

    mode: NodeMode = NodeMode.CGPU
    placement: Placement = Placement.BINPACK
    max_instances_per_gpu: int = 20
    core_step: int = 5  # compute shares are multiples of this (1..100)
    compute_policy: ComputePolicy = ComputePolicy.NATIVE
    # (gpu index, policy) for GPUs that do not follow compute_policy, sorted
    gpu_compute_policies: tuple[tuple[int, ComputePolicy], ...] = ()

    def policy_for(self, gpu: int) -> ComputePolicy:
        return dict(self.gpu_compute_policies).get(gpu, self.compute_policy)


@dataclass(frozen=True)
class ComputeTiming:
    """How the compute scheduler slices time; the same for every GPU. The
    defaults are cgpud's (DaemonConfig takes them from here), the core's own
    where it has one."""

    period_ns: int = _sched.CGPU_SCHED_DEFAULT_PERIOD_NS
    max_slice_ns: int = _sched.CGPU_SCHED_DEFAULT_SLICE_NS
    high_priority_percent: int = 80
    # Under `fixed`, each instance keeps to its own window of every period by
    # itself while cgpud runs, as it does while cgpud is away: no slices
    # handed out (docs/compute.md, "Windows under fixed").
    fixed_windows: bool = False
    # Under `fair`, `preemptive` and `weighted`, while every instance keeps
    # the GPU busy in its turn, each keeps to its equal (weighted) window by
    # itself: no slices until one leaves its window idle (docs/compute.md,
    # "Busy windows").
    busy_windows: bool = False


@dataclass(frozen=True)
class Request:
    """What a container or process asks for. `memory` is per GPU in bytes
    (GiB requests arrive as whole multiples of GIB); 0 means a whole GPU,
    which is the only thing `default` mode grants."""

    owner: Owner
    memory: int
    gpu_count: int = 1
    core_percent: int = 0  # 0: no compute share asked
    weight: int = 1
    priority: int = 0
    # The GPUs a cluster scheduler already chose (the device plugin reads
    # them from the pod); () lets the node's placement choose.
    gpu_indexes: tuple[int, ...] = ()
    # The pod UID whose reservation (Capacity Reserve) this request may draw
    # on; "" for none. Every other reservation counts as taken.
    reservation: str = ""


@dataclass(frozen=True)
class Grant:
    """One GPU's part of an instance."""

    gpu_index: int
    gpu_uuid: str
    memory: int  # bytes
    core_percent: int  # 0: no compute limit on this GPU


@dataclass(frozen=True)
class Instance:
    id: str
    owner: Owner
    grants: tuple[Grant, ...]
    state: InstanceState
    enforced: bool  # False in share mode: bookkeeping only
    weight: int = 1
    priority: int = 0
    pids: tuple[int, ...] = ()
    boot_id: str = ""
    created: float = 0.0  # Unix seconds
    updated: float = 0.0
    # The container (ContainerKey text) bound to it; "" when none. Only that
    # container's exit (or its poststop) hands a claimed instance back.
    holder: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


@dataclass(frozen=True)
class Share:
    """One GPU's part of a reservation."""

    gpu_index: int
    memory: int  # bytes
    core_percent: int = 0
    instances: int = 1  # instance slots held on the GPU (one per container placed there)


@dataclass(frozen=True)
class Reservation:
    """Capacity a cluster scheduler holds for a pod it is binding here,
    until the pod's Allocate consumes it or it expires."""

    pod_uid: str
    pod_namespace: str
    pod_name: str
    shares: tuple[Share, ...]  # sorted by GPU index, each GPU once
    expires: float  # Unix seconds

    def live(self, now: float) -> bool:
        return now < self.expires


@dataclass(frozen=True)
class GpuUsage:
    """A GPU and what active instances hold of it."""

    gpu: GpuCapacity
    allocated: int  # bytes granted to active instances
    core_percent: int  # sum of compute shares granted
    instances: int


@dataclass(frozen=True)
class NodeInfo:
    hostname: str
    address: str  # the node's primary IPv4 address, "" if none
    driver_version: str
    policy: NodePolicy
    gpus: tuple[GpuUsage, ...]
