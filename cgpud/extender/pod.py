"""A pod's GPU demand, read from the v1.Pod JSON kube-scheduler sends the
extender (the API's JSON field names). Pure.

Each container that asks for aliyun.com/gpu-mem gets an instance on the
node: `gpu-mem` GiB in all (split evenly over its `gpu-count` GPUs, default
1) and `gpu-core.percentage` percent of each of those GPUs. That is how the
device plugin sizes it at Allocate (cgpud/kube/assignment.py), so the
extender reads the pod the same way. A container that asks for
aliyun.com/gpu gets that many whole GPUs on a `topology` node (`whole`);
a pod asks for shares or for whole GPUs, not both.

Limit: an init container that asks for GPU memory is placed only when it is
the pod's one GPU container. The annotations that carry the scheduler's
choice to the node (ALIYUN_COM_GPU_MEM_IDX, scheduler.framework.gpushare.
allocation) can name an init container's GPUs only through the pod-wide
index, so a second GPU container could not be told apart from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from decimal import Decimal, InvalidOperation
from typing import Any

from cgpud.kube.model import Resource
from cgpud.kube.quantity import parse_quantity

GIB = 1 << 30
CORE_UNIT = 5  # aliyun.com/gpu-core.percentage is asked in multiples of this
_OURS = (Resource.GPU_MEM.value, Resource.GPU_CORE.value, Resource.GPU_COUNT.value, Resource.GPU_TOPOLOGY.value)


class PodError(ValueError):
    """The pod's GPU resources cannot be placed on any node; the message says
    what to change in the pod spec."""


@dataclass(frozen=True)
class ContainerDemand:
    name: str
    memory_gib: int  # in all, over its GPUs
    core_percent: int  # of each of its GPUs
    gpu_count: int
    index: int  # among the pod's non-init containers (the allocation annotation's key); -1 for an init container
    whole: bool = False  # whole GPUs (aliyun.com/gpu), no memory or compute share

    @property
    def init(self) -> bool:
        return self.index < 0

    @property
    def memory_per_gpu(self) -> int:
        """Bytes on each of its GPUs."""
        return self.memory_gib // self.gpu_count * GIB


@dataclass(frozen=True)
class PodDemand:
    uid: str
    namespace: str
    name: str
    containers: tuple[ContainerDemand, ...]  # the GPU containers, in the order they are placed
    # metadata.resourceVersion of the copy read ("" when it had none): a
    # Binding made from this demand carries it as its precondition.
    resource_version: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def memory_gib(self) -> int:
        return sum(c.memory_gib for c in self.containers)

    # Computed once per demand: fit reads them for every node.

    @cached_property
    def shape(self) -> tuple[tuple[int, int, int], ...]:
        """What placement depends on, per container: (bytes per GPU, core
        percent, GPU count). Equal shapes fit and score alike on a node."""
        return tuple((c.memory_per_gpu, c.core_percent, c.gpu_count) for c in self.containers)

    @cached_property
    def fit_key(self) -> Any:
        """What fit's answer, reasons included, depends on: the shape, and
        the container names a reason quotes when there are several."""
        return self.shape if len(self.containers) <= 1 else (self.shape, self.labels)

    @cached_property
    def labels(self) -> tuple[str, ...]:
        """How a reason names each container ("" when there is one)."""
        many = len(self.containers) > 1
        return tuple(f"container {c.name} " if many else "" for c in self.containers)

    @cached_property
    def whole(self) -> bool:
        """Whole GPUs (aliyun.com/gpu), which only topology nodes give."""
        return any(c.whole for c in self.containers)

    @cached_property
    def most_per_gpu(self) -> int:
        return max((c.memory_per_gpu for c in self.containers), default=0)

    @cached_property
    def most_count(self) -> int:
        return max((c.gpu_count for c in self.containers), default=0)

    @cached_property
    def cores(self) -> tuple[int, ...]:
        return tuple(c.core_percent for c in self.containers if c.core_percent)


def pod_meta(pod: Any) -> tuple[str, str, str]:
    """(uid, namespace, name) of a v1.Pod JSON; PodError when it is not one."""
    if not isinstance(pod, dict):
        raise PodError(f"Pod is {type(pod).__name__}, not a v1.Pod object")
    meta = pod.get("metadata")
    if not isinstance(meta, dict):
        raise PodError("Pod has no metadata object")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise PodError("Pod has no metadata.name")
    namespace = meta.get("namespace") or "default"
    uid = meta.get("uid") or ""
    if not isinstance(namespace, str) or not isinstance(uid, str):
        raise PodError(f"Pod {name}: metadata.namespace and metadata.uid must be strings")
    return uid, namespace, name


def pod_demand(pod: Any) -> PodDemand:
    """The pod's GPU containers; PodError saying what is wrong with the pod
    when its GPU resources cannot be placed anywhere."""
    uid, namespace, name = pod_meta(pod)
    key = f"{namespace}/{name}"
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise PodError(f"pod {key} has no spec object")
    found: list[ContainerDemand] = []
    for init, field in ((True, "initContainers"), (False, "containers")):
        items = spec.get(field)
        if items is None:
            items = []
        if not isinstance(items, list):
            raise PodError(f"pod {key}: spec.{field} is not a list")
        for i, c in enumerate(items):
            demand = _container(c, key, field, i, -1 if init else i)
            if demand is not None:
                found.append(demand)
    if any(c.whole for c in found) and not all(c.whole for c in found):
        raise PodError(
            f"pod {key} asks for whole GPUs ({Resource.GPU_TOPOLOGY.value}) in one container and a GPU share "
            f"({Resource.GPU_MEM.value}) in another; a node gives one or the other: split the pod"
        )
    inits = [c for c in found if c.init]
    if inits and len(found) > 1:
        raise PodError(
            f"pod {key}: init container {inits[0].name} asks for {Resource.GPU_MEM.value} beside "
            f"{len(found) - 1} other GPU container(s); cgpu-scheduler places an init container's GPU share only "
            "when it is the pod's one GPU container: move the GPU work into one container"
        )
    version = pod["metadata"].get("resourceVersion")
    return PodDemand(uid, namespace, name, tuple(found), version if isinstance(version, str) else "")


def _container(c: Any, pod: str, field: str, i: int, index: int) -> ContainerDemand | None:
    if not isinstance(c, dict):
        raise PodError(f"pod {pod}: spec.{field}[{i}] is not an object")
    cname = c.get("name")
    if not isinstance(cname, str) or not cname:
        cname = f"{field}[{i}]"
    where = f"pod {pod} container {cname}"
    resources = c.get("resources")
    if resources is None:
        resources = {}
    if not isinstance(resources, dict):
        raise PodError(f"{where}: resources is not an object")
    asked = {}
    for part in ("limits", "requests"):
        table = resources.get(part)
        if table is None:
            table = {}
        if not isinstance(table, dict):
            raise PodError(f"{where}: resources.{part} is not an object")
        for r in _OURS:
            # Limits first: extended resources have requests equal to limits,
            # and a pod that gives only requests means the same.
            if r not in asked and r in table:
                asked[r] = _quantity(table[r], f"{where}: {r}")
    memory = asked.get(Resource.GPU_MEM.value, 0)
    core = asked.get(Resource.GPU_CORE.value, 0)
    count_given = Resource.GPU_COUNT.value in asked
    count = asked.get(Resource.GPU_COUNT.value, 1)
    whole = asked.get(Resource.GPU_TOPOLOGY.value, 0)
    if whole:
        if memory or core or count_given:
            raise PodError(
                f"{where} asks for {whole} whole GPUs ({Resource.GPU_TOPOLOGY.value}) and for a GPU share: "
                "ask for one of them"
            )
        return ContainerDemand(cname, 0, 0, whole, index, whole=True)
    if memory == 0:
        if core or (count_given and count):
            what = Resource.GPU_CORE.value if core else Resource.GPU_COUNT.value
            raise PodError(
                f"{where} asks for {what} but no {Resource.GPU_MEM.value}: a GPU share is sized by "
                f"memory; add a {Resource.GPU_MEM.value} limit (GiB)"
            )
        return None
    if count < 1:
        raise PodError(f"{where} asks for {count} GPUs: ask for 1 or more ({Resource.GPU_COUNT.value})")
    if memory % count:
        raise PodError(
            f"{where} asks for {memory} GiB on {count} GPUs: cgpu grants the same memory on each GPU of "
            f"a container; ask for a multiple of {count} ({Resource.GPU_MEM.value} is the total)"
        )
    if core > 100 or core % CORE_UNIT:
        raise PodError(
            f"{where} asks for {core}% compute: ask for a multiple of {CORE_UNIT} from {CORE_UNIT} to 100 "
            f"({Resource.GPU_CORE.value}, per GPU)"
        )
    return ContainerDemand(cname, memory, core, count, index)


def _quantity(value: Any, what: str) -> int:
    """A whole, non-negative count from a resource quantity ("4", 4, "1k")."""
    if isinstance(value, bool):
        raise PodError(f"{what} = {value!r} is not a quantity")
    try:
        if isinstance(value, int):
            number = Decimal(value)
        elif isinstance(value, float):
            number = Decimal(str(value))
        elif isinstance(value, str):
            number = parse_quantity(value)
        else:
            raise PodError(f"{what} = {value!r} is not a quantity")
    except (ValueError, InvalidOperation, TypeError):
        raise PodError(f"{what} = {value!r} is not a quantity") from None
    if not number.is_finite() or number != number.to_integral_value():
        raise PodError(f"{what} = {value!r} is not a whole number")
    if number < 0:
        raise PodError(f"{what} = {value!r} is negative")
    return int(number)
