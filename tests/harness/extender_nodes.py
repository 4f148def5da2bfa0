"""Synthetic node views and pods for the extender's tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cgpud.extender.model import GpuState, NodeState, PodShare

GIB = 1 << 30


def gpu(
    index: int,
    total: int = 16,
    used: int = 0,
    core: int = 0,
    instances: int | None = None,
    max_instances: int = 10,
    healthy: bool = True,
    reason: str = "",
) -> GpuState:
    """A GPU with `total` GiB, `used` GiB taken by `instances` (default: 1 when used)."""
    if instances is None:
        instances = 1 if used or core else 0
    return GpuState(
        index=index,
        uuid=f"GPU-{index:04d}",
        model="Tesla T4",
        memory_total=total * GIB,
        memory_allocated=used * GIB,
        core_allocated=core,
        instances=instances,
        max_instances=max_instances,
        healthy=healthy,
        health_reason=reason,
    )


def node(
    name: str = "n1",
    gpus: Sequence[GpuState] | None = None,
    mode: str = "cgpu",
    placement: str = "binpack",
    core_step: int = 5,
    incarnation: str = "inc-1",
    revision: int = 1,
    pods: Sequence[PodShare] = (),
    links: Sequence[tuple[int, int, int, int]] = (),
) -> NodeState:
    return NodeState(
        name=name,
        incarnation=incarnation,
        revision=revision,
        addresses=("10.0.0.1",),
        mode=mode,
        placement=placement,
        core_step=core_step,
        card_name="Tesla T4",
        gpus=tuple(gpus if gpus is not None else [gpu(0), gpu(1)]),
        pods=tuple(pods),
        links=tuple(links),
    )


def container(name: str, mem: Any = None, core: Any = None, count: Any = None, where: str = "limits") -> dict[str, Any]:
    table: dict[str, Any] = {}
    for key, value in (
        ("aliyun.com/gpu-mem", mem),
        ("aliyun.com/gpu-core.percentage", core),
        ("aliyun.com/gpu-count", count),
    ):
        if value is not None:
            table[key] = value
    return {"name": name, "image": "x", "resources": {where: table} if table else {}}


def pod(
    name: str = "p",
    containers: Sequence[Mapping[str, Any]] | None = None,
    init: Sequence[Mapping[str, Any]] = (),
    uid: str | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers if containers is not None else [container("c", mem="4")])}
    if init:
        spec["initContainers"] = list(init)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}"},
        "spec": spec,
    }
