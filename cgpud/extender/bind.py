"""Bind: the one step that changes anything. The pod's placement is checked on
the node's current view, the node reserves it (the node's admission is the
judge), and one Binding carries the gpushare annotations with it: the API
server writes a Binding's annotations onto the pod in the same update that
sets its node (BindingREST, setPodHostAndAnnotations), so a pod is never
seen bound without its GPUs or annotated without its node, and a bind costs
one API call.
Anything that fails after the Reserve gives the reservation back, so a
failed bind leaves nothing held; kube-scheduler retries the pod.

Which copy of the pod decides: the API server's, read at bind, unless the
callers are verified (a client certificate of the extender's client CA:
only kube-scheduler calls the verbs). Then the pod kube-scheduler sent at
filter or prioritize is its informer's copy of the API server's, and the
Binding names that copy's resourceVersion as its precondition: no GET per
bind, and no Binding from a stale copy. When the pod was written since
(409), it is read once and bound under its new version if its GPU request
is the same; a changed request is refused.

Standalone (no API server): the reservation is made and the assignment
reported (log, /inspect) without annotations or a Binding."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import structlog

from cgpud.errors import CgpuError
from cgpud.extender.client import CapacityError, Clients

# Under another name: `annotations` here is the __future__ import's.
from cgpud.extender.fit import Placement, Reason, fit, shares
from cgpud.extender.fit import annotations as pod_annotations
from cgpud.extender.pod import PodDemand, PodError, pod_demand
from cgpud.kube.model import Resource
from cgpud.extender.state import ClusterState, Hold, Picked
from cgpud.kube.apiserver import ApiServerError, client_from
from cgpud.kube.rest import RestError

_log = structlog.get_logger("cgpud.extender")

_OURS = (Resource.GPU_MEM.value, Resource.GPU_CORE.value, Resource.GPU_COUNT.value)
PENDING_HOLD = 30.0  # seconds a hold lives while its Reserve is under way (the RPC times out long before)
PICKS = 4096  # pods whose filter's pick is remembered

# Reserve answers that mean the node decided and holds nothing new; any other
# failure (a timeout, a dropped connection) leaves it unknown.
_REFUSED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
)


# Whose copy of the pod a bind placed: the `bound` log's pod_from, and on a
# 409 only kube-scheduler's copy is read again.
FROM_FILTER = "filter"
FROM_KUBE_SCHEDULER = "kube-scheduler"
FROM_API_SERVER = "API server"
FROM_API_SERVER_AFTER_CONFLICT = "API server, after a conflict"


class BindError(CgpuError):
    """The pod was not bound; nothing is held for it."""


class BindConflict(BindError):
    """The API server refused the Binding with 409: the pod is bound
    already, or is not at the resourceVersion (or UID) the Binding named."""


@dataclass(frozen=True)
class BindArgs:
    """ExtenderBindingArgs."""

    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str


@dataclass(frozen=True)
class Assignment:
    pod: str  # namespace/name
    uid: str
    node: str
    gpus: tuple[int, ...]
    annotations: Mapping[str, str]
    bound: bool  # a Binding was created (False standalone)
    unix_time: float


class PodApi(Protocol):
    def get_pod(self, namespace: str, name: str) -> dict[str, Any]: ...
    def bind(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str], resource_version: str = ""
    ) -> None: ...


class KubePodApi:
    """The two calls bind makes."""

    def __init__(self, kubeconfig: Path | None, timeout: float = 5.0, connections: int = 32) -> None:
        # kube-scheduler binds up to 16 pods at once: a connection each, kept.
        try:
            self._client = client_from(kubeconfig, timeout, connections)
        except ApiServerError as e:
            raise BindError(str(e)) from e

    def close(self) -> None:
        self._client.close()

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        with _bind_error(f"read pod {namespace}/{name}"):
            return self._client.call(
                "GET", "/api/v1/namespaces/{namespace}/pods/{name}", {"namespace": namespace, "name": name}
            )

    def bind(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str], resource_version: str = ""
    ) -> None:
        """resource_version: the pod's, as the placement read it; the API
        server refuses the Binding (409) if the pod has another by now."""
        meta: dict[str, Any] = {"name": name, "namespace": namespace}
        if uid:
            meta["uid"] = uid
        if resource_version:
            meta["resourceVersion"] = resource_version
        if annotations:
            meta["annotations"] = dict(annotations)
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        where = {"namespace": namespace, "name": name}
        with _bind_error(f"bind pod {namespace}/{name} to node {node}"):
            self._client.send("POST", "/api/v1/namespaces/{namespace}/pods/{name}/binding", where, body)


@contextmanager
def _bind_error(what: str) -> Iterator[None]:
    try:
        yield
    except RestError as e:
        raise (BindConflict if e.status == 409 else BindError)(f"cannot {what}: {e}") from None


class Demands:
    """Pods' demands by UID, bounded: the oldest are forgotten (a pod seen at
    filter but forgotten is read from the API server at its bind)."""

    def __init__(self, size: int = 4096) -> None:
        self._lock = threading.Lock()
        self._pods: OrderedDict[str, PodDemand] = OrderedDict()
        self._size = size

    def put(self, demand: PodDemand) -> None:
        if not demand.uid:
            return
        with self._lock:
            self._pods[demand.uid] = demand
            self._pods.move_to_end(demand.uid)
            while len(self._pods) > self._size:
                self._pods.popitem(last=False)

    def get(self, uid: str) -> PodDemand | None:
        with self._lock:
            return self._pods.get(uid)

    def forget(self, uid: str) -> None:
        with self._lock:
            self._pods.pop(uid, None)


class Binder:
    def __init__(
        self,
        state: ClusterState,
        clients: Clients,
        api: PodApi | None = None,
        ttl: int = 0,
        keep: int = 100,
        clock: Callable[[], float] = time.time,
        callers_verified: bool = False,
    ) -> None:
        """callers_verified: every caller of the verbs showed a client
        certificate of the extender's client CA (kube-scheduler's), so the
        pod sent at filter is kube-scheduler's copy and bind may place from
        it (see the module's doc)."""
        self.state = state
        self.clients = clients
        self.api = api
        self.demands = Demands()
        self._filter_copy = callers_verified
        # Pods this extender bound (bounded, oldest forgotten). A second bind
        # of one (kube-scheduler retrying a bind whose answer it lost) reads
        # the pod, so it is refused as bound before its Reserve, which would
        # replace the first bind's reservation on the node.
        self._bound = Demands()
        self._ttl = ttl
        self._clock = clock
        self._recent: deque[Assignment] = deque(maxlen=keep)
        self._locks_lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        # The node the filter last picked for each pod (--pick-at-filter), by
        # UID, bounded: a pod picked again elsewhere gives the first pick back.
        self._picks: OrderedDict[str, str] = OrderedDict()

    def remember(self, demand: PodDemand) -> None:
        # With an API server and callers anyone may be, the pod is read from
        # it at bind, so filter need not keep a copy.
        if self.api is None or self._filter_copy:
            self.demands.put(demand)

    def picked(self, demand: PodDemand, node: str, placement: Placement) -> None:
        """The filter passed the pod `node` alone (--pick-at-filter): the
        placement is held there until the pod's bind, so that the next
        pod's filter counts it, as kube-scheduler assumes a pod on its node
        before binding it. Only for verified callers (kube-scheduler's
        client certificate): a filter from anyone would let anyone who
        reaches the port make every node look full."""
        if not self._filter_copy or not demand.uid:
            return
        record = self.state.record(node)
        if record is None or any(h.pod_uid == demand.uid and h.picked is None for h in record.holds):
            return  # its bind is under way there
        forgotten: list[tuple[str, str]] = []
        with self._locks_lock:
            before = self._picks.pop(demand.uid, None)
            self._picks[demand.uid] = node
            while len(self._picks) > PICKS:
                forgotten.append(self._picks.popitem(last=False))
        if before is not None and before != node:
            forgotten.append((demand.uid, before))
        for uid, where in forgotten:  # a pick not remembered is not held: at most PICKS are
            self.state.release(where, uid, picked_only=True)
        self.state.hold(
            node,
            Hold(
                demand.uid,
                demand.namespace,
                demand.name,
                shares(placement),
                "",
                0,
                self._clock() + PENDING_HOLD,
                Picked(demand.fit_key, placement),
            ),
        )

    def _unpick(self, uid: str, bound_on: str = "") -> None:
        """Forget the pod's pick; give it back unless it is on `bound_on`."""
        with self._locks_lock:
            node = self._picks.pop(uid, None)
        if node is not None and node != bound_on:
            self.state.release(node, uid, picked_only=True)

    def _node_lock(self, node: str) -> threading.Lock:
        with self._locks_lock:
            lock = self._locks.get(node)
            if lock is None:
                lock = self._locks[node] = threading.Lock()
            return lock

    def recent(self) -> list[dict[str, Any]]:
        return [asdict(a) for a in list(self._recent)]

    def bind(self, args: BindArgs) -> Assignment:
        demand, source = self._demand(args)
        key = f"{args.pod_namespace}/{args.pod_name}"
        if not demand.containers:
            # kube-scheduler sends the extender only pods asking for its
            # managedResources; anyone else calling /bind is not placing a
            # GPU share and gets no Binding from us.
            raise BindError(
                f"pod {key} asks for no GPU share ({', '.join(_OURS)}): cgpu-scheduler binds only pods it places"
            )
        if demand.whole:
            # Whole GPUs are the kubelet's to give (GetPreferredAllocation):
            # nothing to reserve or annotate; kube-scheduler binds them itself
            # (deploy/kube-scheduler-config.yaml gives that entry no bindVerb).
            raise BindError(
                f"pod {key} asks for whole GPUs ({Resource.GPU_TOPOLOGY.value}), which cgpu-scheduler filters and "
                "scores but does not bind: give aliyun.com/gpu its own extender entry without bindVerb "
                "(deploy/kube-scheduler-config.yaml)"
            )
        # Fit and a pending hold under the node's lock, the Reserve outside
        # it: a second pod for the node is placed at once on a view that
        # counts the first (not on the same GPU, to be refused by the node),
        # and Reserves to one node still overlap.
        uid = demand.uid or args.pod_uid
        if self.state.record(args.node) is None:  # no lock for a name nobody knows
            self._place(args, demand)
        with self._node_lock(args.node):
            placement, address, picked = self._place(args, demand)
            held = shares(placement)
            if not picked:
                self.state.hold(
                    args.node, Hold(uid, args.pod_namespace, args.pod_name, held, "", 0, self._clock() + PENDING_HOLD)
                )
        self._unpick(uid, bound_on=args.node)
        try:
            reservation = self.clients.get(args.node, address).reserve(
                uid, args.pod_namespace, args.pod_name, held, self._ttl
            )
        except CapacityError as e:
            self.state.release(args.node, uid)
            if e.code not in _REFUSED:
                # The answer was lost, not the request: the node may hold it.
                self._give_back(args.node, address, uid)
            raise BindError(f"node {args.node} did not reserve for pod {key}: {e}") from None
        except BaseException:
            self.state.release(args.node, uid)
            raise
        uid = reservation.pod_uid
        self.state.hold(
            args.node,
            Hold(
                uid,
                args.pod_namespace,
                args.pod_name,
                held,
                reservation.incarnation,
                reservation.revision,
                reservation.expires_unix_ms / 1000,
            ),
        )
        record = self.state.record(args.node)
        view = record.entry.state if record is not None and record.entry.state is not None else None
        notes = pod_annotations(demand, placement, view, int(self._clock() * 1e9)) if view is not None else {}
        try:
            try:
                return self._finish(args, demand, placement, notes, source)
            except BindConflict:
                if source != FROM_KUBE_SCHEDULER:
                    raise
                # kube-scheduler's copy is behind: the pod was written since
                # its filter (kube-scheduler itself writes nominatedNodeName
                # before a PreBind that has work, NominatedNodeNameForExpectation,
                # beta since v1.35). Whatever did not change the GPU request
                # does not change the placement: bind under the pod as it is.
                fresh = self._read(args)
                if fresh.containers != demand.containers:
                    raise BindError(
                        f"pod {key} changed its GPU request since kube-scheduler filtered it; "
                        "kube-scheduler schedules it again"
                    ) from None
                return self._finish(args, fresh, placement, notes, FROM_API_SERVER_AFTER_CONFLICT)
        except BaseException as e:
            self._give_back(args.node, address, uid)
            if isinstance(e, BindError):
                raise
            raise BindError(f"binding pod {key} to node {args.node} failed: {e!r}") from None

    def _demand(self, args: BindArgs) -> tuple[PodDemand, str]:
        """The pod the placement reads, and whose copy it is (for the log).
        The API server's, read now: what /filter was sent is the caller's
        word, and a caller of /bind need not be kube-scheduler. But with
        verified callers, kube-scheduler's copy seen at filter, if it has a
        resourceVersion for the Binding's precondition. Standalone (no API
        server, no Binding) the pod seen at filter is all there is."""
        key = f"{args.pod_namespace}/{args.pod_name}"
        seen = self.demands.get(args.pod_uid) if args.pod_uid else None
        if seen is not None and (seen.namespace, seen.name) != (args.pod_namespace, args.pod_name):
            seen = None
        if self.api is None:
            if seen is None:
                raise BindError(
                    f"pod {key} (uid {args.pod_uid or '?'}) was not seen at filter or prioritize and "
                    "there is no API server to read it from"
                )
            return seen, FROM_FILTER
        if seen is not None and self._filter_copy and seen.resource_version and self._bound.get(seen.uid) is None:
            return seen, FROM_KUBE_SCHEDULER
        return self._read(args), FROM_API_SERVER

    def _read(self, args: BindArgs) -> PodDemand:
        """The pod from the API server: unbound, and the UID kube-scheduler named."""
        assert self.api is not None
        key = f"{args.pod_namespace}/{args.pod_name}"
        pod = self.api.get_pod(args.pod_namespace, args.pod_name)
        try:
            demand = pod_demand(pod)
        except PodError as e:
            raise BindError(str(e)) from None
        if args.pod_uid and demand.uid != args.pod_uid:
            raise BindError(f"pod {key} is uid {demand.uid or '?'}, not {args.pod_uid}: it was recreated")
        spec = pod.get("spec")
        bound = spec.get("nodeName") if isinstance(spec, dict) else None
        if bound:
            raise BindError(f"pod {key} is already bound to node {bound}")
        return demand

    def _place(self, args: BindArgs, demand: PodDemand) -> tuple[Placement, str, bool]:
        """(the placement, the node's Capacity address, whether it is the
        filter's pick held there: a fit now would count the pick itself)."""
        # Holds whose time ran out are dropped by the main loop each second
        # (ClusterState.expire): until then they only make the node look fuller.
        record = self.state.record(args.node)
        if record is None:
            raise BindError(f"node {args.node} is unknown to cgpu-scheduler (no Capacity address for it)")
        if not record.entry.connected:
            raise BindError(f"node {args.node}'s Capacity stream is down ({record.entry.error}): not binding there")
        if record.summary is None:
            raise BindError(f"node {args.node} has sent no view yet")
        uid = demand.uid or args.pod_uid
        for h in record.holds:
            if h.pod_uid == uid and h.picked is not None and h.picked.fit_key == demand.fit_key:
                return h.picked.placement, record.entry.capacity_address, True
        answer = fit(demand, record.summary)
        if isinstance(answer, Reason):
            raise BindError(f"pod {demand.key} no longer fits node {args.node}: {answer.text}")
        return answer, record.entry.capacity_address, False

    def _finish(
        self, args: BindArgs, demand: PodDemand, placement: Placement | None, notes: Mapping[str, str], source: str
    ) -> Assignment:
        key = f"{args.pod_namespace}/{args.pod_name}"
        if self.api is not None:
            self.api.bind(args.pod_namespace, args.pod_name, args.pod_uid, args.node, notes, demand.resource_version)
        done = Assignment(
            key,
            demand.uid or args.pod_uid,
            args.node,
            placement.gpus if placement else (),
            dict(notes),
            self.api is not None,
            self._clock(),
        )
        self._recent.append(done)
        self.demands.forget(args.pod_uid)
        if self.api is not None:
            self._bound.put(demand)
        _log.info(
            "bound" if self.api is not None else "reserved (standalone, no Binding)",
            pod=key,
            node=args.node,
            gpus=list(done.gpus),
            pod_from=source,
        )
        return done

    def _give_back(self, node: str, address: str, uid: str) -> None:
        try:
            self.clients.get(node, address).unreserve(uid)
        except CapacityError as e:
            # It expires on the node after its time to live.
            _log.warning("cannot give a reservation back", node=node, pod_uid=uid, error=str(e))
        self.state.release(node, uid)
