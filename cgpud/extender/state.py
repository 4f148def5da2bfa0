"""The extender's live view of the cluster: each node's last NodeView from its
WatchNode stream, whether the stream is up, and the reservations this
extender made that the node's view does not show yet.

Reads are the hot path (filter and prioritize look up every node for every
pod): each node's record is immutable and replaced whole under the lock, so
a read is one dictionary look-up and never waits for a writer.

The overlay: a Reserve answers with the node's (incarnation, revision) once
the reservation is held; until a view of that incarnation at that revision
or later arrives (which counts it itself), the extender adds the
reservation's shares to the node's view, so the next pod is not placed on
capacity already promised. A view of another incarnation (the node
restarted, or the stream is behind a restart) cannot be ordered against the
reservation: the overlay stays until the view shows the pod (a persisted
reservation or its instance), the pod's reservation is given back, or the
reservation's time runs out.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cgpud.node import placement as admission
from cgpud.node.model import GpuCapacity, GpuUsage, Reservation, Share
from cgpud.extender.fit import NodeSummary, Placement, Rendered, summarize
from cgpud.extender.model import ClusterView, GpuState, NodeEntry, NodeState, PodShare


CHANGE_LOG = 4096  # node writes remembered for changed_since


@dataclass(frozen=True)
class Hold:
    """A reservation this extender made on a node; pending (incarnation "")
    while its Reserve is under way, counted whatever the views say. Or, with
    `picked`, the node the filter passed the pod alone (--pick-at-filter),
    held until the pod's bind."""

    pod_uid: str
    pod_namespace: str
    pod_name: str
    shares: tuple[Share, ...]
    incarnation: str
    revision: int
    expires: float  # Unix seconds
    picked: Picked | None = None


@dataclass(frozen=True)
class Picked:
    """What the filter's pick placed: the bind of the same pod shape on the
    node places it so, without a fit that would count the pick itself."""

    fit_key: Any  # PodDemand.fit_key
    placement: Placement


@dataclass(frozen=True)
class NodeRecord:
    entry: NodeEntry  # its state is the node's view with the holds added
    summary: NodeSummary | None  # of entry.state; None until a view arrived
    view: NodeState | None  # the node's own last view
    holds: tuple[Hold, ...] = ()


class ClusterState:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, NodeRecord] = {}
        self._clock = clock
        # Called after each write (the extender's server keeps the garbage
        # collector off its hot path with it).
        self.on_write: Callable[[], None] | None = None
        # Called with each new node summary before readers see it (the
        # server answers recent pod shapes there, off the request path).
        self.on_summary: Callable[[NodeSummary], None] | None = None
        # Called after a node's record is replaced, with its name, its
        # summary (None: no view or the stream is down) and the generation
        # that write has, under the writers' lock: the server patches the
        # answers it keeps there. It must not wait for a lock a reader may
        # hold while it calls changed_since.
        self.on_put: Callable[[str, NodeSummary | None, int], None] | None = None
        # Every write bumps the generation and logs the node's name, so a
        # reader that kept answers for many nodes redoes only the changed ones.
        self._generation = 0
        self._changes: deque[tuple[int, str]] = deque(maxlen=CHANGE_LOG)
        # Each node's summary's rendered answers (NodeSummary.rendered), for
        # a pass over many nodes: one look-up and the answer, without the
        # record and the summary between (right after a burst of new views
        # those are memory the CPU's caches do not hold).
        self._answers: dict[str, dict[Any, Rendered]] = {}

    # ---- reads ------------------------------------------------------------------------

    def record(self, name: str) -> NodeRecord | None:
        return self._records.get(name)

    @property
    def records(self) -> Mapping[str, NodeRecord]:
        """Every node's record, for loops over many nodes (read only: a
        writer replaces a record whole, never changes one)."""
        return self._records

    @property
    def answers(self) -> Mapping[str, dict[Any, Rendered]]:
        """Each node's rendered answers by pod shape (its summary's
        `rendered`), for nodes that have a summary (read only)."""
        return self._answers

    @property
    def generation(self) -> int:
        """How many writes so far (read it before reading the nodes)."""
        return self._generation

    def changed_since(self, generation: int) -> tuple[int, set[str] | None]:
        """(the generation now, the nodes written after `generation`), or
        None for the names when the log no longer reaches back that far."""
        with self._lock:
            now = self._generation
            if generation == now:
                return now, set()
            if generation > now or not self._changes or self._changes[0][0] > generation + 1:
                return now, None
            # Newest first, stopping at `generation`: a reader that is nearly
            # current (the usual case) pays for the few writes it missed, not
            # for the whole log.
            names: set[str] = set()
            for g, name in reversed(self._changes):
                if g <= generation:
                    break
                names.add(name)
            return now, names

    def entry(self, name: str) -> NodeEntry | None:
        rec = self._records.get(name)
        return None if rec is None else rec.entry

    def names(self) -> list[str]:
        return sorted(self._records)

    def view(self) -> ClusterView:
        records = dict(self._records)
        return ClusterView(tuple(records[n].entry for n in sorted(records)))

    # ---- writes (watchers, bind) --------------------------------------------------------

    def set_state(self, name: str, address: str, state: NodeState) -> None:
        with self._lock:
            old = self._records.get(name)
            holds = old.holds if old is not None else ()
            self._put(name, address, True, "", state, _live(holds, state, self._clock()))

    def set_down(self, name: str, address: str, error: str) -> None:
        """The node's stream is down: the node is refused until it is back.
        Its last view stays visible (for /inspect), marked down."""
        with self._lock:
            old = self._records.get(name)
            view = old.view if old is not None else None
            holds = old.holds if old is not None else ()
            self._put(name, address, False, error or "stream down", view, holds)

    def remove(self, name: str) -> None:
        with self._lock:
            self._answers.pop(name, None)
            if self._records.pop(name, None) is not None:
                self._logged(name)

    def hold(self, name: str, hold: Hold) -> None:
        """Count a reservation just made on `name` until its view does."""
        with self._lock:
            old = self._records.get(name)
            if old is None:
                return
            mine = [i for i, h in enumerate(old.holds) if h.pod_uid == hold.pod_uid]
            if mine:  # in its place: the node's state lists the pods in the holds' order
                holds = (
                    old.holds[: mine[0]]
                    + (hold,)
                    + tuple(h for h in old.holds[mine[0] + 1 :] if h.pod_uid != hold.pod_uid)
                )
            else:
                holds = old.holds + (hold,)
            if old.view is not None:
                holds = _live(holds, old.view, self._clock())
            if old.summary is not None and counted(holds) == counted(old.holds):
                # The same shares for the same pods (a pending hold its Reserve
                # answered): the node's state and summary stand, readers have
                # nothing to redo.
                self._records[name] = replace(old, holds=holds)
                return
            self._put(name, old.entry.capacity_address, old.entry.connected, old.entry.error, old.view, holds)

    def release(self, name: str, pod_uid: str, picked_only: bool = False) -> None:
        """The pod's reservation on `name` was given back (picked_only: only
        a filter's pick, not a hold its bind made)."""
        with self._lock:
            old = self._records.get(name)
            if old is None or not any(
                h.pod_uid == pod_uid and (h.picked is not None or not picked_only) for h in old.holds
            ):
                return
            holds = tuple(h for h in old.holds if h.pod_uid != pod_uid)
            self._put(name, old.entry.capacity_address, old.entry.connected, old.entry.error, old.view, holds)

    def expire(self) -> None:
        """Drop holds whose time ran out (called now and then)."""
        now = self._clock()
        with self._lock:
            for name, old in list(self._records.items()):
                holds = tuple(h for h in old.holds if h.expires > now)
                if len(holds) != len(old.holds):
                    self._put(name, old.entry.capacity_address, old.entry.connected, old.entry.error, old.view, holds)

    def _put(
        self, name: str, address: str, connected: bool, error: str, view: NodeState | None, holds: tuple[Hold, ...]
    ) -> None:
        state = view if view is None or not holds else with_holds(view, holds)
        entry = NodeEntry(name, address, connected, "" if connected else error, state)
        summary = summarize(state, name) if state is not None and connected else None
        if summary is not None and self.on_summary is not None:
            self.on_summary(summary)
        self._records[name] = NodeRecord(entry, summary, view, holds)
        if summary is not None:
            self._answers[name] = summary.rendered
        else:
            self._answers.pop(name, None)
        self._logged(name)
        if self.on_put is not None:
            self.on_put(name, summary, self._generation)
        if self.on_write is not None:
            self.on_write()

    def _logged(self, name: str) -> None:
        self._generation += 1
        self._changes.append((self._generation, name))


def counted(holds: Sequence[Hold]) -> list[tuple[str, str, str, tuple[Share, ...]]]:
    """What of the holds the node's state shows (with_holds): the rest (the
    incarnation, revision and time a hold lives) only decides when it goes."""
    return [(h.pod_uid, h.pod_namespace, h.pod_name, h.shares) for h in holds]


def _live(holds: Sequence[Hold], view: NodeState, now: float) -> tuple[Hold, ...]:
    """The holds `view` does not count yet."""
    shown = {p.pod_uid for p in view.pods if p.pod_uid}  # whole GPUs come without one
    out = []
    for h in holds:
        if h.expires <= now or h.pod_uid in shown:
            continue
        if h.incarnation == view.incarnation and view.revision >= h.revision:
            continue
        out.append(h)
    return tuple(out)


def with_holds(view: NodeState, holds: Sequence[Hold]) -> NodeState:
    """The view as it is once the holds are counted, as the node counts a
    reservation (placement.gpu_usage): memory, compute and instance slots
    taken on each GPU."""
    gpus = [GpuCapacity(g.index, g.uuid, g.memory_total) for g in view.gpus]
    reserved = [Reservation(h.pod_uid, h.pod_namespace, h.pod_name, h.shares, h.expires) for h in holds]
    held = {u.gpu.index: u for u in admission.gpu_usage(gpus, (), reserved)}
    pods = view.pods + tuple(
        PodShare(
            h.pod_uid,
            h.pod_namespace,
            h.pod_name,
            "",
            tuple((s.gpu_index, s.memory, s.core_percent) for s in h.shares),
            reserved=True,
        )
        for h in holds
    )
    return replace(view, gpus=tuple(_plus(g, held[g.index]) for g in view.gpus), pods=pods)


def _plus(g: GpuState, u: GpuUsage) -> GpuState:
    if not u.instances and not u.allocated:
        return g
    return replace(
        g,
        memory_allocated=g.memory_allocated + u.allocated,
        core_allocated=g.core_allocated + u.core_percent,
        instances=g.instances + u.instances,
        memory_reserved=g.memory_reserved + u.allocated,
        core_reserved=g.core_reserved + u.core_percent,
    )
