"""Model <-> protobuf for the local API: pure functions, no I/O.

Both directions live here so the server and the client cannot drift apart.
Enumerated values travel as the model's own strings (see local.proto); the
decoding side turns an unknown word into a UsageError naming the field, which
the server answers as INVALID_ARGUMENT."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from cgpud.api.cgpu.v1 import local_pb2 as pb
from cgpud.node import model
from cgpud.node.bypass_model import BypassEvent, EventAction, Violation, ViolationKind
from cgpud.errors import UsageError

E = TypeVar("E", bound=Enum)


def _enum(cls: type[E], value: str | int, field: str) -> E:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in cls)
        raise UsageError(f"{field}: unknown value {value!r}; expected one of {allowed}") from None


def _same(source: object, *names: str) -> dict[str, Any]:
    # Fields named alike on both sides, copied as they are (Any: each value
    # has its own field's type, which a dict cannot say).
    return {name: getattr(source, name) for name in names}


# Scalar fields an instance carries under one name in the model and the message.
_INSTANCE_SCALARS = ("id", "state", "enforced", "weight", "priority", "boot_id", "created", "updated")
_REQUEST_SCALARS = ("core_percent", "weight", "priority")
_NODE_SCALARS = ("hostname", "address", "driver_version")
# A bypass event's violation fields, named alike in the model and the message
# (the event's own detail travels as action_detail).
_VIOLATION_SCALARS = (
    "instance_id",
    "gpu_index",
    "used_bytes",
    "limit_bytes",
    "measured_percent",
    "allowed_percent",
    "detail",
)


# ---- owner, grant, instance ------------------------------------------------------


def owner_to_pb(owner: model.Owner) -> pb.Owner:
    return pb.Owner(kind=owner.kind.value, id=owner.id)


def owner_from_pb(msg: pb.Owner) -> model.Owner:
    return model.Owner(kind=_enum(model.OwnerKind, msg.kind, "owner.kind"), id=msg.id)


def grant_to_pb(grant: model.Grant) -> pb.Grant:
    return pb.Grant(
        gpu_index=grant.gpu_index,
        gpu_uuid=grant.gpu_uuid,
        memory_bytes=grant.memory,
        core_percent=grant.core_percent,
    )


def grant_from_pb(msg: pb.Grant) -> model.Grant:
    return model.Grant(
        gpu_index=msg.gpu_index, gpu_uuid=msg.gpu_uuid, memory=msg.memory_bytes, core_percent=msg.core_percent
    )


def instance_to_pb(
    instance: model.Instance, region_dir: Path | None = None, violations: int = 0, mps_pipe_dir: Path | None = None
) -> pb.Instance:
    """`region_dir`, `mps_pipe_dir` and `violations` are not part of the
    model (the service computes the first two, the bypass watchdog counts
    the other), hence separate arguments; region_dir is None for a released
    instance whose region is gone."""
    scalars = _same(instance, *_INSTANCE_SCALARS) | {"state": instance.state.value}
    return pb.Instance(
        owner=owner_to_pb(instance.owner),
        grants=[grant_to_pb(g) for g in instance.grants],
        pids=list(instance.pids),
        region_dir=str(region_dir) if region_dir is not None else "",
        violations=violations,
        mps_pipe_dir=str(mps_pipe_dir) if mps_pipe_dir is not None else "",
        **scalars,
    )


def instance_from_pb(msg: pb.Instance) -> model.Instance:
    scalars = _same(msg, *_INSTANCE_SCALARS) | {"state": _enum(model.InstanceState, msg.state, "instance.state")}
    return model.Instance(
        owner=owner_from_pb(msg.owner),
        grants=tuple(grant_from_pb(g) for g in msg.grants),
        pids=tuple(msg.pids),
        **scalars,
    )


def region_dir_from_pb(msg: pb.Instance) -> Path | None:
    return Path(msg.region_dir) if msg.region_dir else None


def mps_pipe_dir_from_pb(msg: pb.Instance) -> Path | None:
    return Path(msg.mps_pipe_dir) if msg.mps_pipe_dir else None


# ---- requests --------------------------------------------------------------------


def request_to_pb(request: model.Request, pid: int | None = None) -> pb.CreateInstanceRequest:
    msg = pb.CreateInstanceRequest(
        owner=owner_to_pb(request.owner),
        memory_bytes=request.memory,
        gpu_count=request.gpu_count,
        **_same(request, *_REQUEST_SCALARS),
    )
    if pid is not None:
        msg.pid = pid
    return msg


def request_from_pb(msg: pb.CreateInstanceRequest) -> tuple[model.Request, int | None]:
    """The model request and the pid to bind at once (None: reserve only).
    Unset optional fields take the model's defaults; explicit values, even
    nonsensical ones, are passed on for the service to judge."""
    if not msg.HasField("owner"):
        raise UsageError("owner: required (kind and id of the container, pod or process)")
    request = model.Request(
        owner=owner_from_pb(msg.owner),
        memory=msg.memory_bytes,
        gpu_count=msg.gpu_count if msg.HasField("gpu_count") else _request_default("gpu_count"),
        core_percent=msg.core_percent,
        weight=msg.weight if msg.HasField("weight") else _request_default("weight"),
        priority=msg.priority,
    )
    return request, (msg.pid if msg.HasField("pid") else None)


def _request_default(name: str) -> int:
    # Read from the dataclass so the model stays the one place defaults live.
    default = next(f.default for f in fields(model.Request) if f.name == name)
    assert isinstance(default, int)
    return default


def bind_to_pb(instance_id: str, pids: tuple[int, ...], owner_id: str | None = None) -> pb.BindInstanceRequest:
    msg = pb.BindInstanceRequest(id=instance_id, pids=list(pids))
    if owner_id is not None:
        msg.owner_id = owner_id
    return msg


def bind_from_pb(msg: pb.BindInstanceRequest) -> tuple[str, tuple[int, ...], str | None]:
    return msg.id, tuple(msg.pids), (msg.owner_id if msg.HasField("owner_id") else None)


# ---- policy and node ---------------------------------------------------------------


def policy_to_pb(policy: model.NodePolicy) -> pb.Policy:
    return pb.Policy(
        mode=policy.mode.value,
        placement=policy.placement.value,
        max_instances_per_gpu=policy.max_instances_per_gpu,
        core_step=policy.core_step,
        compute_policy=int(policy.compute_policy),
        gpu_compute_policy={gpu: int(p) for gpu, p in policy.gpu_compute_policies},
    )


def policy_from_pb(msg: pb.Policy) -> model.NodePolicy:
    return model.NodePolicy(
        mode=_enum(model.NodeMode, msg.mode, "policy.mode"),
        placement=_enum(model.Placement, msg.placement, "policy.placement"),
        max_instances_per_gpu=msg.max_instances_per_gpu,
        core_step=msg.core_step,
        compute_policy=compute_policy_from_int(msg.compute_policy),
        gpu_compute_policies=tuple(
            sorted((gpu, compute_policy_from_int(p)) for gpu, p in msg.gpu_compute_policy.items())
        ),
    )


def compute_policy_from_int(value: int) -> model.ComputePolicy:
    return _enum(model.ComputePolicy, value, "compute_policy")


def gpu_usage_to_pb(usage: model.GpuUsage) -> pb.GpuUsage:
    return pb.GpuUsage(
        index=usage.gpu.index,
        uuid=usage.gpu.uuid,
        memory_bytes=usage.gpu.memory,
        allocated_bytes=usage.allocated,
        core_percent=usage.core_percent,
        instances=usage.instances,
    )


def gpu_usage_from_pb(msg: pb.GpuUsage) -> model.GpuUsage:
    return model.GpuUsage(
        gpu=model.GpuCapacity(index=msg.index, uuid=msg.uuid, memory=msg.memory_bytes),
        allocated=msg.allocated_bytes,
        core_percent=msg.core_percent,
        instances=msg.instances,
    )


def node_info_to_pb(info: model.NodeInfo) -> pb.NodeInfo:
    return pb.NodeInfo(
        **_same(info, *_NODE_SCALARS),
        policy=policy_to_pb(info.policy),
        gpus=[gpu_usage_to_pb(g) for g in info.gpus],
    )


def node_info_from_pb(msg: pb.NodeInfo) -> model.NodeInfo:
    return model.NodeInfo(
        **_same(msg, *_NODE_SCALARS),
        policy=policy_from_pb(msg.policy),
        gpus=tuple(gpu_usage_from_pb(g) for g in msg.gpus),
    )


# ---- bypass events -----------------------------------------------------------------


@dataclass(frozen=True)
class BypassListing:
    """ListBypassEvents' answer: events newest last, and whether the
    watchdog looks at the GPUs now (when not, `watch_detail` says why)."""

    events: tuple[BypassEvent, ...]
    watching: bool
    watch_detail: str = ""


def bypass_event_to_pb(event: BypassEvent) -> pb.BypassEvent:
    v = event.violation
    return pb.BypassEvent(
        time=event.time,
        kind=v.kind.value,
        pids=list(v.pids),
        action=event.action.value,
        killed=list(event.killed),
        action_detail=event.detail,
        **_same(v, *_VIOLATION_SCALARS),
    )


def bypass_event_from_pb(msg: pb.BypassEvent) -> BypassEvent:
    violation = Violation(
        kind=_enum(ViolationKind, msg.kind, "event.kind"),
        pids=tuple(msg.pids),
        **_same(msg, *_VIOLATION_SCALARS),
    )
    return BypassEvent(
        time=msg.time,
        violation=violation,
        action=_enum(EventAction, msg.action, "event.action"),
        killed=tuple(msg.killed),
        detail=msg.action_detail,
    )


def bypass_listing_to_pb(listing: BypassListing) -> pb.ListBypassEventsResponse:
    return pb.ListBypassEventsResponse(
        events=[bypass_event_to_pb(e) for e in listing.events],
        watching=listing.watching,
        watch_detail=listing.watch_detail,
    )


def bypass_listing_from_pb(msg: pb.ListBypassEventsResponse) -> BypassListing:
    return BypassListing(tuple(bypass_event_from_pb(e) for e in msg.events), msg.watching, msg.watch_detail)
