"""Which pod and container an Allocate is for, pure.

The kubelet's Allocate names device IDs, never the pod. As gpushare users
know it, the scheduler (gpushare's extender, or cgpu's) leaves its decision
on the pod at bind: ALIYUN_COM_GPU_MEM_ASSUME_TIME (Unix ns),
ALIYUN_COM_GPU_MEM_ASSIGNED="false", the GPU index in ALIYUN_COM_GPU_MEM_IDX
and, for containers on several GPUs, scheduler.framework.gpushare.allocation
= {"<container index>": {"<GPU index>": GiB}}. An Allocate of n GiB of
aliyun.com/gpu-mem is for the oldest assumed pod on this node with a
container that asks for n GiB and has no instance yet.

The kubelet admits a pod's containers one by one (init containers first),
and each container's resources one by one, in no fixed order. So:
- only the aliyun.com/gpu-mem Allocate creates the container's instance,
  sized from the container's spec (its gpu-count and gpu-core.percentage
  limits included); every GPU-share container asks for memory;
- an Allocate of aliyun.com/gpu-core.percentage or gpu-count only checks
  that a live pod here asks for that much and answers with env: it creates
  nothing, whether it comes before the memory Allocate or after it;
- a pod stays a candidate until each of its memory-asking containers has an
  instance; only then is it marked ASSIGNED=true.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from cgpud.kube.apiserver import ContainerInfo, PodInfo
from cgpud.node.model import PodContainer
from cgpud.kube.model import ANNOTATION_ALLOCATION, ANNOTATION_ASSIGNED, ANNOTATION_ASSUME_TIME, ANNOTATION_GPU_INDEX
from cgpud.kube.model import AllocationError, Resource

_UNITS = {Resource.GPU_MEM: "GiB of ", Resource.GPU_CORE: "percent of ", Resource.GPU_COUNT: "GPUs of "}
_HINT = "is the cgpu scheduler extender (or gpushare) configured?"


def pod_container(pod: PodInfo, container: str) -> PodContainer:
    return PodContainer(pod.uid, pod.namespace, pod.name, container)


@dataclass(frozen=True)
class Assignment:
    """What one container gets, as the scheduler decided it."""

    pod: PodInfo
    container: str
    memory_gib: int  # per GPU
    gpu_count: int
    core_percent: int
    gpu_indexes: tuple[int, ...]  # the scheduler's GPUs; () lets the node's placement choose

    @property
    def owner(self) -> PodContainer:
        return pod_container(self.pod, self.container)


def live(pod: PodInfo) -> bool:
    return not pod.deleting and not pod.terminal


def assumed(pod: PodInfo) -> bool:
    """The scheduler placed the pod here and no Allocate completed it yet."""
    return (
        live(pod)
        and ANNOTATION_ASSUME_TIME in pod.annotations
        and pod.annotations.get(ANNOTATION_ASSIGNED, "false").strip().lower() != "true"
    )


def assume_time(pod: PodInfo) -> int:
    text = pod.annotations.get(ANNOTATION_ASSUME_TIME, "")
    try:
        return int(text.strip())
    except ValueError:
        raise AllocationError(
            f"pod {pod.key}: annotation {ANNOTATION_ASSUME_TIME}={text!r} is not a Unix time in "
            "nanoseconds; fix or remove it (the scheduler extender writes it)"
        ) from None


def gpu_containers(pod: PodInfo) -> list[ContainerInfo]:
    """The containers that get an instance: those asking for GPU memory."""
    return [c for c in pod.containers if c.limit(Resource.GPU_MEM) > 0]


def complete(pod: PodInfo, held: Collection[str]) -> bool:
    """Every memory-asking container of the pod has its instance."""
    return all(pod_container(pod, c.name).owner_id in held for c in gpu_containers(pod))


def _what(resource: Resource, count: int) -> str:
    return f"{count} {_UNITS.get(resource, '')}{resource.value}"


@dataclass(frozen=True)
class Skipped:
    """A candidate pod passed over: its annotations do not parse or do not fit its spec."""

    pod: PodInfo
    reason: str


@dataclass(frozen=True)
class Resolution:
    assignment: Assignment
    skipped: tuple[Skipped, ...]


class Unresolved(AllocationError):
    """No candidate is left; `skipped` names those passed over."""

    def __init__(self, message: str, skipped: tuple[Skipped, ...]) -> None:
        super().__init__(message)
        self.skipped = skipped


def resolve_memory(pods: Sequence[PodInfo], gib: int, node: str, held: Collection[str]) -> Resolution:
    """The container an Allocate of `gib` GiB of aliyun.com/gpu-mem is for:
    in the oldest assumed pod, the first container asking for that much
    with no instance (`held`: owner ids of active pod instances).

    A candidate whose annotations do not parse (or contradict its spec) is
    skipped and named in the answer: one bad pod must not stop every
    Allocate of its size on the node, since the kubelet does not retry a
    failed admission."""
    skipped: list[Skipped] = []
    candidates: list[tuple[int, str, PodInfo, ContainerInfo]] = []
    for pod in pods:
        if not assumed(pod):
            continue
        free = [
            c
            for c in gpu_containers(pod)
            if c.limit(Resource.GPU_MEM) == gib and pod_container(pod, c.name).owner_id not in held
        ]
        if not free:
            continue
        try:
            candidates.append((assume_time(pod), pod.key, pod, free[0]))
        except AllocationError as e:
            skipped.append(Skipped(pod, str(e)))
    for _, _, pod, container in sorted(candidates, key=lambda c: (c[0], c[1])):
        try:
            return Resolution(_assignment(pod, container, gib), tuple(skipped))
        except AllocationError as e:
            skipped.append(Skipped(pod, str(e)))
    text = _no_pod(pods, Resource.GPU_MEM, gib, node)
    if skipped:
        text += "; passed over: " + "; ".join(s.reason for s in skipped)
    raise Unresolved(text, tuple(skipped))


def _assignment(pod: PodInfo, container: ContainerInfo, gib: int) -> Assignment:
    indexes, count = _placement(pod, container)
    if gib % count:
        raise AllocationError(
            f"pod {pod.key} container {container.name} asks for {gib} GiB on {count} GPUs: cgpu "
            "grants the same memory on each GPU of a container; ask for a multiple of the GPU count"
        )
    return Assignment(pod, container.name, gib // count, count, container.limit(Resource.GPU_CORE), indexes)


def find_asker(pods: Sequence[PodInfo], resource: Resource, count: int, node: str) -> tuple[PodInfo, ContainerInfo]:
    """For the Allocates that create nothing (core percentage, GPU count): a
    live pod on this node with a container asking for `count` of `resource`,
    assumed pods first. Such a container must ask for GPU memory too."""
    found = [(not assumed(p), p.key, p, c) for p in pods if live(p) for c in p.containers if c.limit(resource) == count]
    if not found:
        raise AllocationError(_no_pod(pods, resource, count, node))
    _, _, pod, container = min(found, key=lambda f: (f[0], f[1]))
    if container.limit(Resource.GPU_MEM) <= 0:
        raise AllocationError(
            f"pod {pod.key} container {container.name} asks for {_what(resource, count)} but no "
            f"{Resource.GPU_MEM.value}: a GPU share is sized by memory; add a "
            f"{Resource.GPU_MEM.value} limit"
        )
    return pod, container


def _no_pod(pods: Sequence[PodInfo], resource: Resource, count: int, node: str) -> str:
    text = f"no pod on node {node} is assumed for {_what(resource, count)}: {_HINT}"
    asking = [p for p in pods if live(p) and any(c.limit(resource) == count for c in p.containers)]
    unassumed = [p for p in asking if ANNOTATION_ASSUME_TIME not in p.annotations]
    if unassumed:
        text += f" (pod {unassumed[0].key} asks for it but carries no {ANNOTATION_ASSUME_TIME})"
    return text


def _placement(pod: PodInfo, container: ContainerInfo) -> tuple[tuple[int, ...], int]:
    """(GPU indexes the scheduler chose, GPU count) for one container."""
    asked = max(container.limit(Resource.GPU_COUNT), 1)
    if not container.init and ANNOTATION_ALLOCATION in pod.annotations:
        index = [c.name for c in pod.containers if not c.init].index(container.name)
        per_gpu = _allocation(pod).get(index)
        if per_gpu is not None:
            total = sum(per_gpu.values())
            if total != container.limit(Resource.GPU_MEM) or len(set(per_gpu.values())) != 1:
                raise AllocationError(
                    f"pod {pod.key} container {container.name}: annotation {ANNOTATION_ALLOCATION} gives it "
                    f"{_gib_list(per_gpu)} but it asks for {container.limit(Resource.GPU_MEM)} GiB; cgpu grants "
                    "the same memory on each GPU of a container"
                )
            return tuple(sorted(per_gpu)), len(per_gpu)
    text = pod.annotations.get(ANNOTATION_GPU_INDEX)
    if text is None:
        return (), asked
    indexes = _indexes(pod, text)
    if len(indexes) != asked:
        raise AllocationError(
            f"pod {pod.key} container {container.name} asks for {asked} GPUs but annotation "
            f"{ANNOTATION_GPU_INDEX}={text!r} names {len(indexes)}; fix the annotation"
        )
    return indexes, asked


def _indexes(pod: PodInfo, text: str) -> tuple[int, ...]:
    try:
        indexes = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        indexes = ()
    if not indexes or any(i < 0 for i in indexes):
        raise AllocationError(
            f"pod {pod.key}: annotation {ANNOTATION_GPU_INDEX}={text!r} is not a GPU index "
            "(a whole number, or several separated by commas); fix or remove it"
        )
    return indexes


def _allocation(pod: PodInfo) -> dict[int, dict[int, int]]:
    """{container index: {GPU index: GiB}} from the multi-GPU annotation."""
    text = pod.annotations[ANNOTATION_ALLOCATION]
    bad = AllocationError(
        f"pod {pod.key}: annotation {ANNOTATION_ALLOCATION}={text!r} is not "
        '{"<container index>": {"<GPU index>": GiB}}; fix or remove it'
    )
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):
        raise bad from None
    if not isinstance(raw, dict):
        raise bad
    out: dict[int, dict[int, int]] = {}
    try:
        for container, gpus in raw.items():
            if not isinstance(gpus, dict) or not gpus:
                raise bad
            per = {int(g): int(v) for g, v in gpus.items()}
            if any(g < 0 or v <= 0 for g, v in per.items()) or any(isinstance(v, (bool, float)) for v in gpus.values()):
                raise bad
            out[int(container)] = per
    except (TypeError, ValueError):
        raise bad from None
    return out


def _gib_list(per_gpu: dict[int, int]) -> str:
    return ", ".join(f"{v} GiB on GPU {g}" for g, v in sorted(per_gpu.items()))


def check_count(device_ids: Sequence[str], resource: Resource | str) -> int:
    """How many units an Allocate asks for; the kubelet sends each ID once."""
    name = resource.value if isinstance(resource, Resource) else resource
    if not device_ids:
        raise AllocationError(f"Allocate of {name} names no devices")
    if len(set(device_ids)) != len(device_ids):
        raise AllocationError(f"Allocate of {name} names a device twice")
    return len(device_ids)
