"""cgpu.v1.Capacity (proto/cgpu/v1/capacity.proto): the node's capacity for
cluster schedulers. GetNode and WatchNode show a NodeView; Reserve and
Unreserve hold capacity for a pod until its Allocate consumes it.

The view is a pure function of a NodeSnapshot (node_view), so what a
scheduler sees is tested without a server. A snapshot reads the revision
first and the state after it: a view claiming revision R holds every change
up to R (perhaps a later one too, which the next view repeats).

Serving (TLS, listen address, health) is capacity_server.py's."""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import structlog

from cgpud.api.cgpu.v1 import capacity_pb2 as pb
from cgpud.api.cgpu.v1 import capacity_pb2_grpc as pb_grpc
from cgpud.api.status import abort_rpc
from cgpud.node import placement
from cgpud.node.inventory import Inventory, pci_key
from cgpud.node.topology import Link
from cgpud.node.model import GpuCapacity, Instance, NodePolicy, OwnerKind, Reservation, Share
from cgpud.errors import UsageError
from cgpud.node.model import PodContainer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Capacity"].full_name  # "cgpu.v1.Capacity"
MAX_TTL_SECONDS = 3600
# How long a WatchNode stream waits for a change before it looks whether
# its client is still there: a cancelled stream ends within this.
WATCH_POLL = 0.5
# At most one view per stream this often. A view costs the node a snapshot
# and an encoding and the scheduler a decoding and a new summary, and under
# a stream of binds each Reserve moved the revision: most views were
# outdated by the next one. A scheduler counts its own reservations until a
# view shows them (the Reserve's revision), so a later view only delays
# what others changed (a pod gone, a GPU's health) by at most this.
WATCH_PACE = 0.05

# GPU index -> (healthy, why not). A GPU it does not name is healthy.
HealthProvider = Callable[[], Mapping[int, tuple[bool, str]]]


class Changes(Protocol):
    """cgpud.node.changes.Changes, as far as the API reads it."""

    incarnation: str

    @property
    def revision(self) -> int: ...

    def wait(self, after: int, timeout: float) -> int: ...


class CapacityService(Protocol):
    """What the servicer needs of the daemon (InstanceService has it)."""

    @property
    def changes(self) -> Changes: ...

    def policy(self) -> NodePolicy: ...

    def gpus(self) -> tuple[GpuCapacity, ...]: ...

    def list(self, include_released: bool = False) -> list[Instance]: ...

    def reservations(self) -> builtins.list[Reservation]: ...

    def holdings(self) -> tuple[builtins.list[Instance], builtins.list[Reservation]]: ...

    def whole_held(self) -> Mapping[int, str]: ...

    def reserve(
        self, pod_uid: str, namespace: str, name: str, shares: Sequence[Share], ttl: float | None = None
    ) -> Reservation: ...

    def unreserve(self, pod_uid: str) -> bool: ...


# ---- the model ----------------------------------------------------------------------


@dataclass(frozen=True)
class NodeFacts:
    """What does not change while cgpud runs: who the node is and its cards."""

    name: str
    addresses: tuple[str, ...]
    driver_version: str = ""
    card_name: str = ""  # as ACK's aliyun.accelerator/nvidia_name label
    card_memory: int = 0  # bytes per GPU
    card_count: int = 0
    models: Mapping[int, str] = field(default_factory=dict)  # GPU index -> model name
    nvlinks: tuple[tuple[int, int], ...] = ()  # each pair once, a < b
    links: Mapping[tuple[int, int], Link] = field(default_factory=dict)  # inventory.links()


def nvlink_pairs(gpus: Sequence[Any]) -> tuple[tuple[int, int], ...]:
    """NVLink peers (PCI bus ids, inventory.Gpu.nvlink_peers) as pairs of GPU
    indexes, each once with a < b; links to anything not among `gpus` (an
    NVSwitch) are left out."""
    by_pci = {pci_key(g.pci_bus_id): g.index for g in gpus}
    by_pci.pop(None, None)
    pairs = set()
    for g in gpus:
        for peer in g.nvlink_peers:
            other = by_pci.get(pci_key(peer))
            if other is not None and other != g.index:
                pairs.add((min(g.index, other), max(g.index, other)))
    return tuple(sorted(pairs))


def node_facts(inventory: Inventory, name: str, addresses: Sequence[str]) -> NodeFacts:
    labels = inventory.card_labels()
    first = inventory.gpus[0] if inventory.gpus else None
    return NodeFacts(
        name=name,
        addresses=tuple(dict.fromkeys(a for a in addresses if a)),
        driver_version=inventory.driver_version,
        card_name=labels.get("aliyun.accelerator/nvidia_name", ""),
        card_memory=first.memory_total if first else 0,
        card_count=len(inventory.gpus),
        models={g.index: g.name for g in inventory.gpus},
        nvlinks=nvlink_pairs(inventory.gpus),
        links=inventory.links(),
    )


@dataclass(frozen=True)
class NodeSnapshot:
    facts: NodeFacts
    incarnation: str
    revision: int
    policy: NodePolicy
    gpus: tuple[GpuCapacity, ...]
    active: tuple[Instance, ...]  # released ones are skipped
    reservations: tuple[Reservation, ...]  # live ones
    health: Mapping[int, tuple[bool, str]] = field(default_factory=dict)
    # GPUs pods hold whole: index -> "namespace/pod/container" (InstanceService.set_whole_held)
    whole: Mapping[int, str] = field(default_factory=dict)


def _share_pb(share: Share) -> pb.Share:
    return pb.Share(
        gpu_index=share.gpu_index, memory_bytes=share.memory, core_percent=share.core_percent, instances=share.instances
    )


def reservation_to_pb(r: Reservation, revision: int = 0, incarnation: str = "") -> pb.Reservation:
    return pb.Reservation(
        pod_uid=r.pod_uid,
        pod_namespace=r.pod_namespace,
        pod_name=r.pod_name,
        shares=[_share_pb(s) for s in r.shares],
        expires_unix_ms=round(r.expires * 1000),
        revision=revision,
        incarnation=incarnation,
    )


def _pod_instance(instance: Instance) -> pb.PodInstance:
    owner = PodContainer.parse(instance.owner.id)
    # An owner id the device plugin did not write (an older cgpud) still
    # names the pod somehow: show it whole as the UID.
    uid, namespace, name, container = (
        (owner.uid, owner.namespace, owner.name, owner.container) if owner else (instance.owner.id, "", "", "")
    )
    shares = [
        pb.Share(gpu_index=g.gpu_index, memory_bytes=g.memory, core_percent=g.core_percent, instances=1)
        for g in sorted(instance.grants, key=lambda g: g.gpu_index)
    ]
    return pb.PodInstance(
        instance_id=instance.id, pod_uid=uid, pod_namespace=namespace, pod_name=name, container=container, shares=shares
    )


def _whole_gpu_pod(index: int, holder: str, gpus: Sequence[GpuCapacity]) -> pb.PodInstance:
    """A pod's whole GPU, as the kubelet lists it: no instance of cgpud's and
    no UID (pod-resources names pods by namespace and name)."""
    namespace, _, rest = holder.partition("/")
    name, _, container = rest.partition("/")
    memory = next((g.memory for g in gpus if g.index == index), 0)
    share = pb.Share(gpu_index=index, memory_bytes=memory, core_percent=100, instances=1)
    return pb.PodInstance(pod_namespace=namespace, pod_name=name, container=container, shares=[share])


class ReservationPieces:
    """Each reservation's part of a NodeView, encoded once: a new view after
    a Reserve re-encodes the one reservation that is new, not all the node
    holds (40 of them cost more than the rest of the view). Kept by the
    Reservation object, which the store hands out again while its row is
    unchanged (Store's decoded rows), and only for the last view's
    reservations. Thread-safety: views built at once each swap the whole
    dict; a lost swap only encodes again."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[Reservation, bytes]] = {}

    def encoded(self, reservations: Sequence[Reservation]) -> bytes:
        """`reservations` as NodeView's repeated field, in order."""
        kept, now, out = self._kept, {}, []
        for r in reservations:
            hit = kept.get(id(r))
            if hit is not None and hit[0] is r:
                data = hit[1]
            else:
                data = pb.NodeView(reservations=[reservation_to_pb(r)]).SerializeToString()
            now[id(r)] = (r, data)
            out.append(data)
        self._kept = now
        return b"".join(out)


def node_view(s: NodeSnapshot, pieces: ReservationPieces | None = None) -> pb.NodeView:
    """The NodeView of a snapshot: per GPU what instances and reservations
    hold together (what admission sees as taken), the reserved part alone.
    With `pieces`, the reservations come from its encodings (the same view)."""
    active = [i for i in s.active if i.active]
    # Placement's own count, so the view and admission cannot disagree.
    held = placement.gpu_usage(s.gpus, active, s.reservations, s.whole)
    reserved = {u.gpu.index: u for u in placement.gpu_usage(s.gpus, (), s.reservations)}
    gpus = []
    for u in held:
        index = u.gpu.index
        healthy, reason = s.health.get(index, (True, ""))
        gpus.append(
            pb.GpuView(
                index=index,
                uuid=u.gpu.uuid,
                model=s.facts.models.get(index, ""),
                memory_total_bytes=u.gpu.memory,
                memory_allocated_bytes=u.allocated,
                core_allocated_percent=u.core_percent,
                instances=u.instances,
                max_instances=s.policy.max_instances_per_gpu,
                healthy=healthy,
                health_reason="" if healthy else (reason or "unhealthy"),
                memory_reserved_bytes=reserved[index].allocated,
                core_reserved_percent=reserved[index].core_percent,
            )
        )
    pods = [i for i in active if i.owner.kind is OwnerKind.POD]
    by_uid = sorted(s.reservations, key=lambda r: r.pod_uid)
    view = pb.NodeView(
        incarnation=s.incarnation,
        revision=s.revision,
        node_name=s.facts.name,
        addresses=list(s.facts.addresses),
        mode=s.policy.mode.value,
        placement=s.policy.placement.value,
        core_step=s.policy.core_step,
        card=pb.CardModel(name=s.facts.card_name, memory_bytes=s.facts.card_memory, count=s.facts.card_count),
        gpus=gpus,
        nvlinks=[pb.NvLink(gpu_a=a, gpu_b=b) for a, b in s.facts.nvlinks],
        links=[
            pb.GpuLink(gpu_a=a, gpu_b=b, pcie_level=link.level, nvlinks=link.nvlinks)
            for (a, b), link in sorted(s.facts.links.items())
        ],
        reservations=[] if pieces is not None else [reservation_to_pb(r) for r in by_uid],
        pod_instances=[_pod_instance(i) for i in sorted(pods, key=lambda i: (i.owner.id, i.id))]
        + [_whole_gpu_pod(index, who, s.gpus) for index, who in sorted(s.whole.items())],
        driver_version=s.facts.driver_version,
        other_instances=len(active) - len(pods),
    )
    if pieces is not None:
        view.MergeFromString(pieces.encoded(by_uid))  # a repeated field's entries append in order
    return view


# ---- requests -------------------------------------------------------------------------


@dataclass(frozen=True)
class ReserveArgs:
    pod_uid: str
    namespace: str
    name: str
    shares: tuple[Share, ...]
    ttl: float | None  # None: the node's default


def reserve_from_pb(request: pb.ReserveRequest) -> ReserveArgs:
    """A ReserveRequest checked for what the protobuf cannot say; the
    service checks the rest against the node (UsageError either way)."""
    uid = request.pod_uid.strip()
    if not uid:
        raise UsageError("Reserve needs the pod's UID (pod_uid is empty)")
    for what, text in (("pod_uid", uid), ("pod_namespace", request.pod_namespace), ("pod_name", request.pod_name)):
        if "/" in text:
            raise UsageError(f"{what} {text!r} holds a '/': not a Kubernetes {what.removeprefix('pod_')}")
    if request.ttl_seconds > MAX_TTL_SECONDS:
        raise UsageError(
            f"ttl_seconds {request.ttl_seconds} is too long: at most {MAX_TTL_SECONDS} "
            "(0 takes the node's reservation_ttl)"
        )
    if not request.shares:
        raise UsageError(f"Reserve for pod {uid} names no GPU share")
    seen: set[int] = set()
    for s in request.shares:
        if s.gpu_index in seen:
            raise UsageError(f"Reserve for pod {uid} names GPU {s.gpu_index} twice: give each GPU one share")
        seen.add(s.gpu_index)
    shares = tuple(
        sorted(
            (Share(s.gpu_index, s.memory_bytes, s.core_percent, max(1, s.instances)) for s in request.shares),
            key=lambda s: s.gpu_index,
        )
    )
    return ReserveArgs(
        uid,
        request.pod_namespace,
        request.pod_name,
        shares,
        float(request.ttl_seconds) if request.ttl_seconds else None,
    )


# ---- the servicer ------------------------------------------------------------------------


class CapacityServicer(pb_grpc.CapacityServicer):
    """cgpu.v1.Capacity over a CapacityService. `health` answers each GPU's
    health when a view is built (lambda: {} when nothing watches it)."""

    def __init__(
        self,
        service: CapacityService,
        facts: NodeFacts,
        health: HealthProvider | None = None,
        watch_poll: float = WATCH_POLL,
        watch_pace: float = WATCH_PACE,
    ) -> None:
        self._service = service
        self._facts = facts
        self._pieces = ReservationPieces()
        self._health = health or (lambda: {})
        self._watch_poll = watch_poll
        self._watch_pace = watch_pace
        self._stopping = threading.Event()
        self._log = structlog.get_logger("cgpud.capacity")

    def stop(self) -> None:
        """Ends every WatchNode stream within one poll (server shutdown)."""
        self._stopping.set()

    def snapshot(self) -> NodeSnapshot:
        changes = self._service.changes
        revision = changes.revision  # first: the state read after it holds every change up to it
        # One store snapshot: an instance that just drew on its pod's
        # reservation is counted once, never twice or not at all.
        active, reserved = self._service.holdings()
        return NodeSnapshot(
            facts=self._facts,
            incarnation=changes.incarnation,
            revision=revision,
            policy=self._service.policy(),
            gpus=tuple(self._service.gpus()),
            active=tuple(active),
            reservations=tuple(reserved),
            health=dict(self._health()),
            whole=self._service.whole_held(),
        )

    def view(self) -> pb.NodeView:
        return node_view(self.snapshot(), self._pieces)

    def GetNode(self, request: pb.GetNodeRequest, context: grpc.ServicerContext) -> pb.NodeView:
        try:
            return self.view()
        except Exception as e:  # CgpuError: its status; anything else is a bug, INTERNAL
            abort_rpc(context, self._log, "GetNode", e, "cgpud")

    def WatchNode(self, request: pb.WatchNodeRequest, context: grpc.ServicerContext) -> Iterator[pb.NodeView]:
        """The full view, then a full view whenever the revision moved, at
        most one a pace: a burst of changes may come as one view, never as a
        stale one."""
        changes = self._service.changes
        peer = context.peer()
        self._log.info("watch started", peer=peer)
        sent: int | None = None
        built = -self._watch_pace  # monotonic time of the last view
        try:
            while context.is_active() and not self._stopping.is_set():
                if changes.revision != sent:
                    early = built + self._watch_pace - time.monotonic()
                    if early > 0:
                        self._stopping.wait(min(early, self._watch_poll))
                        continue
                    built = time.monotonic()
                    view = self.view()
                    sent = view.revision
                    yield view
                    continue  # another change may have come while it was sent
                changes.wait(sent, self._watch_poll)
        except Exception as e:
            abort_rpc(context, self._log, "WatchNode", e, "cgpud")
        finally:
            self._log.info("watch ended", peer=peer)

    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.Reservation:
        try:
            args = reserve_from_pb(request)
            held = self._service.reserve(args.pod_uid, args.namespace, args.name, args.shares, ttl=args.ttl)
            changes = self._service.changes  # the service logged it
            return reservation_to_pb(held, changes.revision, changes.incarnation)
        except Exception as e:
            abort_rpc(context, self._log, "Reserve", e, "cgpud")

    def Unreserve(self, request: pb.UnreserveRequest, context: grpc.ServicerContext) -> pb.UnreserveResponse:
        try:
            uid = request.pod_uid.strip()
            if not uid:
                raise UsageError("Unreserve needs the pod's UID (pod_uid is empty)")
            released = self._service.unreserve(uid)
            changes = self._service.changes
            return pb.UnreserveResponse(released=released, revision=changes.revision, incarnation=changes.incarnation)
        except Exception as e:
            abort_rpc(context, self._log, "Unreserve", e, "cgpud")
