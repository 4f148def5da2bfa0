"""What the extender knows of a node: its cgpud's last NodeView, as plain
data. Built from the Capacity protobuf here and nowhere else; the same data
is the JSON of `GET /inspect`, which `kubectl inspect cgpu` reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from cgpud.node.topology import Link
from cgpud.api.cgpu.v1 import capacity_pb2 as pb


@dataclass(frozen=True)
class GpuState:
    index: int
    uuid: str
    model: str
    memory_total: int  # bytes
    memory_allocated: int  # instances and reservations together
    core_allocated: int  # percent
    instances: int  # instances and reserved slots
    max_instances: int
    healthy: bool
    health_reason: str = ""
    memory_reserved: int = 0  # the reservations' part of memory_allocated
    core_reserved: int = 0

    @property
    def memory_free(self) -> int:
        return self.memory_total - self.memory_allocated


@dataclass(frozen=True)
class PodShare:
    """A pod's hold on a node's GPUs: one container's instance, or a
    reservation (container "" and reserved True) the pod's Allocate has not
    consumed yet. `gpus` is ((GPU index, bytes, core percent), ...)."""

    pod_uid: str
    pod_namespace: str
    pod_name: str
    container: str
    gpus: tuple[tuple[int, int, int], ...]
    reserved: bool = False


@dataclass(frozen=True)
class NodeState:
    name: str
    incarnation: str
    revision: int
    addresses: tuple[str, ...]
    mode: str
    placement: str
    core_step: int
    card_name: str
    gpus: tuple[GpuState, ...]
    nvlinks: tuple[tuple[int, int], ...] = ()
    pods: tuple[PodShare, ...] = ()
    # (a, b) -> (PCIe level, NVLinks), each pair once (cgpud.node.topology.Link)
    links: tuple[tuple[int, int, int, int], ...] = ()
    driver_version: str = ""
    other_instances: int = 0

    @property
    def memory_total(self) -> int:
        return sum(g.memory_total for g in self.gpus)

    def topology(self) -> dict[tuple[int, int], Link]:
        """How the node's GPUs are joined, as its cgpud read them; {} from a
        cgpud too old to say (choices then go by placement alone)."""
        return {(a, b): Link(level, n) for a, b, level, n in self.links}

    @property
    def memory_allocated(self) -> int:
        return sum(g.memory_allocated for g in self.gpus)


@dataclass(frozen=True)
class NodeEntry:
    """One node of the cluster view: where its Capacity API is, whether its
    stream is up, and its last view (None until the first arrives)."""

    name: str
    capacity_address: str  # HOST:PORT
    connected: bool
    error: str = ""  # why the stream is down; "" while connected
    state: NodeState | None = None


@dataclass(frozen=True)
class ClusterView:
    nodes: tuple[NodeEntry, ...] = field(default_factory=tuple)


# ---- protobuf -> model --------------------------------------------------------------


def _shares(shares: Any) -> tuple[tuple[int, int, int], ...]:
    return tuple(sorted((s.gpu_index, s.memory_bytes, s.core_percent) for s in shares))


# GpuState's fields are GpuView's; these drop the unit from the name.
_GPU_VIEW_RENAMED = {
    "memory_total": "memory_total_bytes",
    "memory_allocated": "memory_allocated_bytes",
    "core_allocated": "core_allocated_percent",
    "memory_reserved": "memory_reserved_bytes",
    "core_reserved": "core_reserved_percent",
}


def _gpu_from_pb(g: pb.GpuView) -> GpuState:
    return GpuState(**{f.name: getattr(g, _GPU_VIEW_RENAMED.get(f.name, f.name)) for f in fields(GpuState)})


def _pod_share(p: pb.PodInstance) -> PodShare:
    return PodShare(p.pod_uid, p.pod_namespace, p.pod_name, p.container, _shares(p.shares))


def _reserved_share(r: pb.Reservation) -> PodShare:
    return PodShare(r.pod_uid, r.pod_namespace, r.pod_name, "", _shares(r.shares), reserved=True)


class KeptShares:
    """A node stream's PodShares by their entries' encoded bytes: a view
    after a Reserve differs from the one before by a reservation, and
    making every pod's PodShare again was most of node_from_pb with 40
    held. Only the last view's are kept. One per stream (not thread-safe)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[bool, bytes], PodShare] = {}
        self._now: dict[tuple[bool, bytes], PodShare] = {}

    def shares(self, entries: Any, reserved: bool) -> tuple[PodShare, ...]:
        make = _reserved_share if reserved else _pod_share
        kept, now, out = self._kept, self._now, []
        for e in entries:
            key = (reserved, e.SerializeToString())
            share = kept.get(key)
            if share is None:
                share = make(e)
            now[key] = share
            out.append(share)
        return tuple(out)

    def done(self) -> None:
        """The view is read: keep its shares, forget the rest."""
        self._kept, self._now = self._now, {}


def node_from_pb(msg: pb.NodeView, kept: KeptShares | None = None) -> NodeState:
    """The model of a NodeView; with `kept`, PodShares equal to the last
    view's entries are the ones made then (the same state)."""
    gpus = tuple(_gpu_from_pb(g) for g in msg.gpus)
    if kept is not None:
        pods = kept.shares(msg.pod_instances, reserved=False)
        reserved = kept.shares(msg.reservations, reserved=True)
        kept.done()
    else:
        pods = tuple(_pod_share(p) for p in msg.pod_instances)
        reserved = tuple(_reserved_share(r) for r in msg.reservations)
    return NodeState(
        name=msg.node_name,
        incarnation=msg.incarnation,
        revision=msg.revision,
        addresses=tuple(msg.addresses),
        mode=msg.mode,
        placement=msg.placement,
        core_step=msg.core_step,
        card_name=msg.card.name,
        gpus=tuple(sorted(gpus, key=lambda g: g.index)),
        nvlinks=tuple((n.gpu_a, n.gpu_b) for n in msg.nvlinks),
        pods=pods + reserved,
        links=tuple((k.gpu_a, k.gpu_b, k.pcie_level, k.nvlinks) for k in msg.links),
        driver_version=msg.driver_version,
        other_instances=msg.other_instances,
    )


# ---- JSON (GET /inspect) ---------------------------------------------------------------


def view_to_json(view: ClusterView) -> dict[str, Any]:
    return {"nodes": [asdict(n) for n in view.nodes]}


def view_from_json(data: Any) -> ClusterView:
    """The inverse of view_to_json; ValueError on anything else."""
    try:
        return ClusterView(tuple(_entry(n) for n in data["nodes"]))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a cgpu-scheduler cluster view: {e!r}") from None


def _entry(d: dict[str, Any]) -> NodeEntry:
    state = d.get("state")
    return NodeEntry(
        d["name"],
        d["capacity_address"],
        bool(d["connected"]),
        d.get("error", ""),
        None if state is None else _state(state),
    )


def _state(d: dict[str, Any]) -> NodeState:
    return NodeState(
        **{k: d[k] for k in ("name", "incarnation", "revision", "mode", "placement", "core_step", "card_name")},
        addresses=tuple(d["addresses"]),
        gpus=tuple(GpuState(**g) for g in d["gpus"]),
        nvlinks=tuple((a, b) for a, b in d.get("nvlinks", ())),
        links=tuple((a, b, level, n) for a, b, level, n in d.get("links", ())),
        pods=tuple(
            PodShare(
                p["pod_uid"],
                p["pod_namespace"],
                p["pod_name"],
                p["container"],
                tuple((i, m, c) for i, m, c in p["gpus"]),
                bool(p.get("reserved", False)),
            )
            for p in d.get("pods", ())
        ),
        driver_version=d.get("driver_version", ""),
        other_instances=d.get("other_instances", 0),
    )
