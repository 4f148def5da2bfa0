"""Which running pod instances a pod asks to resize, and whether it may.

A pod asks by annotation, for each of its GPU containers, in the units of
its resources: `cgpu.io/resize-gpu-mem` in GiB per GPU, as
aliyun.com/gpu-mem, and `cgpu.io/resize-gpu-core` in percent, as
aliyun.com/gpu-core.percentage. cgpud's sweep acts on it
(cgpud/kube/resizer.py) through the same resize as `cgpuctl resize`.

Whoever can patch a pod can write the annotation, and a grow takes GPU
memory or compute that the pod's spec (and any ResourceQuota on it) never
asked for. So a shrink is always honoured, a grow only for pods whose
Kubernetes priority reaches the node's `pod_share_priority_min`, as weight
and high priority (cgpud/kube/share_priority.py). Pure."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cgpud.containers.request import parse_whole
from cgpud.errors import UsageError
from cgpud.kube.apiserver import PodInfo
from cgpud.node.model import GIB, Instance, OwnerKind, PodContainer

ANNOTATION_RESIZE_MEM = "cgpu.io/resize-gpu-mem"
ANNOTATION_RESIZE_CORE = "cgpu.io/resize-gpu-core"
_MAX_GIB = 1 << 20  # a bound for the parse only: admission judges the size


@dataclass(frozen=True)
class Asked:
    """What a pod's annotations ask each of its GPU containers to become."""

    memory: int | None  # bytes per GPU; None: as it is
    core_percent: int | None

    @property
    def text(self) -> str:
        """The request as written, to act on each one once."""
        return f"mem={self.memory} core={self.core_percent}"


@dataclass(frozen=True)
class PodResize:
    instance: Instance
    pod: PodInfo
    container: str
    asked: Asked


@dataclass(frozen=True)
class Refusal:
    instance: Instance
    pod: PodInfo
    asked_text: str  # what was written, "" when it could not be read
    message: str


def asked(pod: PodInfo) -> Asked | None:
    """The pod's resize annotations, None without any; UsageError naming the
    annotation and what to write when one is not a number we take."""
    ann = pod.annotations
    if ANNOTATION_RESIZE_MEM not in ann and ANNOTATION_RESIZE_CORE not in ann:
        return None
    memory = core = None
    try:
        if ANNOTATION_RESIZE_MEM in ann:
            memory = parse_whole(ann, ANNOTATION_RESIZE_MEM, 0, 1, _MAX_GIB, " GiB per GPU", "4") * GIB
        if ANNOTATION_RESIZE_CORE in ann:
            core = parse_whole(ann, ANNOTATION_RESIZE_CORE, 0, 0, 100, " percent", "50")
    except UsageError as e:
        raise UsageError(f"pod {pod.key}: {e}") from None
    return Asked(memory, core)


def _compare(instance: Instance, want: Asked) -> tuple[bool, bool]:
    """(changes anything, grows anything) against the instance's grant now."""
    now = instance.grants[0]
    pairs = [(w, n) for w, n in ((want.memory, now.memory), (want.core_percent, now.core_percent)) if w is not None]
    return any(w != n for w, n in pairs), any(w > n for w, n in pairs)


def pod_resizes(
    pods: Sequence[PodInfo], instances: Iterable[Instance], min_pod_priority: int
) -> tuple[list[PodResize], list[Refusal]]:
    """The resizes the node's pods ask of their running instances, and the
    requests refused here (unreadable, or a grow the pod may not ask)."""
    by_uid = {p.uid: p for p in pods}
    resizes: list[PodResize] = []
    refusals: list[Refusal] = []
    for instance in instances:
        if not instance.active or instance.owner.kind is not OwnerKind.POD:
            continue
        owner = PodContainer.parse(instance.owner.id)
        pod = by_uid.get(owner.uid) if owner is not None else None
        if owner is None or pod is None:
            continue
        try:
            want = asked(pod)
        except UsageError as e:
            refusals.append(Refusal(instance, pod, "", str(e)))
            continue
        if want is None:
            continue
        changes, grows = _compare(instance, want)
        if not changes:
            continue
        if grows and pod.priority < min_pod_priority:
            refusals.append(
                Refusal(
                    instance,
                    pod,
                    want.text,
                    f"pod {pod.key} asks to grow its GPU share by {ANNOTATION_RESIZE_MEM}/{ANNOTATION_RESIZE_CORE}, "
                    f"but the pod's priority ({pod.priority}) is below this node's pod_share_priority_min "
                    f"({min_pod_priority}): a grow takes what its spec did not ask; give the pod a PriorityClass "
                    "that reaches it, or only shrink",
                )
            )
            continue
        resizes.append(PodResize(instance, pod, owner.container, want))
    return resizes, refusals
