"""A pod's compute weight and high priority: what it asks, and whether
this node lets it.

A pod asks as cGPU users write it, in a container's env
(`ALIYUN_COM_GPU_SCHD_WEIGHT=1..100`, `ALIYUN_COM_GPU_HIGH_PRIO=1`), or for
all its containers by annotation (`cgpu.io/gpu-weight`,
`cgpu.io/gpu-high-priority`); a container's env wins over the annotation.

Both take compute from the pod's neighbours on the GPU, and whoever can
create a pod can write both. So they are granted only to pods whose
Kubernetes priority (spec.priority, set from a PriorityClass, which only
cluster administrators create) reaches the node's `pod_share_priority_min`.
Any other pod that asks is refused at Allocate, with the reason, rather
than silently run at weight 1. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cgpud.containers.request import ENV_PRIORITY, ENV_WEIGHT, parse_flag, parse_whole
from cgpud.errors import UsageError
from cgpud.kube.apiserver import NOT_LITERAL, PodInfo

ANNOTATION_WEIGHT = "cgpu.io/gpu-weight"
ANNOTATION_HIGH_PRIORITY = "cgpu.io/gpu-high-priority"
SHARE_ENV = (ENV_WEIGHT, ENV_PRIORITY)


@dataclass(frozen=True)
class SharePriority:
    weight: int = 1
    priority: int = 0  # 1: high priority

    @property
    def asks(self) -> bool:
        return self.weight != 1 or self.priority != 0


def _one(
    env: Mapping[str, str], annotations: Mapping[str, str], env_name: str, annotation: str, where: str
) -> tuple[str, Mapping[str, str]] | None:
    """Where the value of one setting comes from: (its name, a mapping
    holding it under that name), or None when neither sets it."""
    if env_name in env:
        if env[env_name] == NOT_LITERAL:
            raise UsageError(f"{where}: {env_name} must be a literal value (value:), not valueFrom")
        return env_name, env
    if annotation in annotations:
        return annotation, annotations
    return None


def requested(pod: PodInfo, container: str) -> SharePriority:
    """What the pod's `container` asks for. Bad values are UsageError
    naming the env variable or annotation and what to write."""
    info = next((c for c in pod.containers if c.name == container), None)
    env = info.env if info is not None else {}
    where = f"pod {pod.key} container {container}"
    weight, priority = 1, 0
    found = _one(env, pod.annotations, ENV_WEIGHT, ANNOTATION_WEIGHT, where)
    if found is not None:
        weight = parse_whole(found[1], found[0], 1, 1, 100, "", "2")
    found = _one(env, pod.annotations, ENV_PRIORITY, ANNOTATION_HIGH_PRIORITY, where)
    if found is not None:
        priority = 1 if parse_flag(found[1], found[0]) else 0
    return SharePriority(weight, priority)


def granted(pod: PodInfo, container: str, min_pod_priority: int) -> SharePriority:
    """What the container gets: what it asks, if its pod may ask at all."""
    asked = requested(pod, container)
    if asked.asks and pod.priority < min_pod_priority:
        what = " and ".join(
            part
            for part, on in ((f"weight {asked.weight}", asked.weight != 1), ("high priority", asked.priority))
            if on
        )
        raise UsageError(
            f"pod {pod.key} container {container} asks for GPU compute {what}, but the pod's priority "
            f"({pod.priority}) is below this node's pod_share_priority_min ({min_pod_priority}): give the pod a "
            f"PriorityClass of at least {min_pod_priority}, or remove {ENV_WEIGHT}/{ENV_PRIORITY} and the "
            f"{ANNOTATION_WEIGHT}/{ANNOTATION_HIGH_PRIORITY} annotations"
        )
    return asked
