"""Keeping the cluster view live: one thread per node following its cgpud's
WatchNode stream (no polling), and where the nodes come from: a node file
or the API server's Nodes (the cgpu.io/capacity-address annotation cgpud
writes). A stream that ends or fails marks its node down at once, so the
extender never places a pod on a view it can no longer trust; the thread
reconnects with backoff and the node is back with its first view."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import structlog

from cgpud.api.cgpu.v1 import capacity_pb2 as pb
from cgpud.errors import UsageError
from cgpud.extender.client import Clients
from cgpud.extender.model import KeptShares, node_from_pb
from cgpud.extender.state import ClusterState
from cgpud.kube.model import ANNOTATION_CAPACITY_ADDRESS
from cgpud.kube.rest import RestClient

_log = structlog.get_logger("cgpud.extender")

FIRST_BACKOFF = 0.2
MAX_BACKOFF = 5.0


class NodeWatcher:
    def __init__(
        self,
        name: str,
        address: str,
        state: ClusterState,
        clients: Clients,
        first_backoff: float = FIRST_BACKOFF,
        max_backoff: float = MAX_BACKOFF,
    ) -> None:
        self.name = name
        self.address = address
        self._state = state
        self._clients = clients
        self._first = first_backoff
        self._max = max_backoff
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)

    def start(self) -> NodeWatcher:
        self._state.set_down(self.name, self.address, "connecting to the node's Capacity API")
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout)

    def _run(self) -> None:
        delay = self._first
        said = ""
        while not self._stop.is_set():
            reason, had_view = self._follow()
            if self._stop.is_set():
                break
            if had_view:  # it was up: reconnect at once, then back off
                delay, said = self._first, ""
            self._state.set_down(self.name, self.address, reason)
            if reason != said:  # once per outage and cause, not once per retry
                _log.warning("node stream down", node=self.name, address=self.address, reason=reason)
                said = reason
            if self._stop.wait(delay):
                break
            delay = min(delay * 2, self._max)

    def _follow(self) -> tuple[str, bool]:
        """Follow one stream until it ends: why it ended, and whether at
        least one view arrived."""
        got = False
        kept = KeptShares()  # this stream's pods, from one view to the next
        try:
            call = self._clients.get(self.name, self.address).stub.WatchNode(pb.WatchNodeRequest())
            with self._lock:
                self._call = call
            if self._stop.is_set():
                call.cancel()
            for msg in call:
                view = node_from_pb(msg, kept)
                if view.name != self.name:
                    # The address came from the Node (or the node file); the
                    # view is the node's own word: a view of another node
                    # would place pods on N and reserve them on A.
                    call.cancel()
                    return (
                        f"the Capacity API at {self.address} speaks for node {view.name!r}, not "
                        f"{self.name!r}: its views are refused (check the node's cgpu.io/capacity-address)"
                    ), got
                self._state.set_state(self.name, self.address, view)
                if not got:
                    _log.info("node stream up", node=self.name, address=self.address, revision=msg.revision)
                got = True
            reason = "the node ended its Capacity stream"
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            reason = f"{code.name if code else 'UNKNOWN'}: {details}"
        except Exception as e:  # a bad view or a bug: the node is not trusted
            reason = f"cannot read the node's view: {e!r}"
        finally:
            with self._lock:
                self._call = None
        return reason, got


class Watchers:
    """The set of node watchers, kept equal to the nodes a source names."""

    def __init__(self, state: ClusterState, clients: Clients) -> None:
        self._state = state
        self._clients = clients
        self._lock = threading.Lock()
        self._watchers: dict[str, NodeWatcher] = {}

    def sync(self, nodes: Mapping[str, str]) -> None:
        """Watch exactly `nodes` (name -> HOST:PORT)."""
        with self._lock:
            stale = [w for n, w in self._watchers.items() if nodes.get(n) != w.address]
            for w in stale:
                del self._watchers[w.name]
            fresh = [NodeWatcher(n, a, self._state, self._clients) for n, a in nodes.items() if n not in self._watchers]
            for w in fresh:
                self._watchers[w.name] = w
        for w in stale:
            w.stop()
            if w.name not in nodes:
                self._state.remove(w.name)
        for w in fresh:
            w.start()

    def stop(self) -> None:
        with self._lock:
            watchers, self._watchers = list(self._watchers.values()), {}
        for w in watchers:
            w._stop.set()
        for w in watchers:
            w.stop()


# ---- node sources -------------------------------------------------------------------------


def parse_node_file(text: str, where: str = "node file") -> dict[str, str]:
    """`NAME HOST:PORT` a line; `#` starts a comment."""
    nodes: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not _is_address(parts[1]):
            raise UsageError(f"{where} line {number}: {line!r} is not `NAME HOST:PORT`")
        name, address = parts
        if name in nodes:
            raise UsageError(f"{where} line {number}: node {name} is listed twice")
        nodes[name] = address
    return nodes


def read_node_file(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError as e:
        raise UsageError(f"cannot read the node file: {e}") from None
    return parse_node_file(text, str(path))


def _is_address(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return False
    if host.startswith("["):
        return host.endswith("]") and len(host) > 2
    return ":" not in host


def capacity_addresses(nodes: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, str]]:
    """(name -> Capacity address, name -> why it is not a cgpu node) from
    v1.Node JSON objects."""
    found: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for n in nodes:
        meta = n.get("metadata") or {}
        name = meta.get("name")
        if not name:
            continue
        address = (meta.get("annotations") or {}).get(ANNOTATION_CAPACITY_ADDRESS, "")
        if not address:
            skipped[name] = f"no {ANNOTATION_CAPACITY_ADDRESS} annotation: not a cgpu node (or its Capacity API is off)"
        elif not _is_address(address):
            skipped[name] = f"annotation {ANNOTATION_CAPACITY_ADDRESS}={address!r} is not HOST:PORT"
        else:
            found[name] = address
    return found, skipped


class ApiNodeSource:
    """Nodes from the API server: list, then watch; again from a fresh list
    after any failure (with backoff)."""

    def __init__(
        self,
        client: RestClient,
        on_nodes: Callable[[dict[str, str]], None],
        on_skipped: Callable[[dict[str, str]], None] = lambda _: None,
    ) -> None:
        self._client = client
        self._on_nodes = on_nodes
        self._on_skipped = on_skipped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-source", daemon=True)

    def start(self) -> ApiNodeSource:
        self._thread.start()
        return self

    def stop(self, timeout: float = 0.5) -> None:
        """Bounded: a read blocked on an idle watch ends only with its
        timeout, and the thread is a daemon that ends with the process."""
        self._stop.set()
        self._thread.join(timeout)

    def _publish(self, objects: dict[str, dict[str, Any]]) -> None:
        found, skipped = capacity_addresses(list(objects.values()))
        self._on_skipped(skipped)
        self._on_nodes(found)

    def _run(self) -> None:
        delay = FIRST_BACKOFF
        while not self._stop.is_set():
            try:
                data = self._client.call("GET", "/api/v1/nodes", timeout=10)
                objects = {n["metadata"]["name"]: n for n in data.get("items") or []}
                self._publish(objects)
                version = (data.get("metadata") or {}).get("resourceVersion", "")
                delay = FIRST_BACKOFF
                query = {"resourceVersion": version, "timeoutSeconds": "300"}
                for event in self._client.watch("/api/v1/nodes", query, timeout=330):
                    if self._stop.is_set():
                        break
                    obj = event.get("object") or {}
                    name = (obj.get("metadata") or {}).get("name")
                    if event.get("type") == "ERROR" or not name:
                        break  # expired resourceVersion and the like: list again
                    if event["type"] == "DELETED":
                        objects.pop(name, None)
                    else:
                        objects[name] = obj
                    self._publish(objects)
            except Exception as e:  # the API server is away: keep the nodes we have, retry
                _log.warning("cannot list or watch Nodes", error=str(e), retry_in=delay)
                if self._stop.wait(delay):
                    break
                delay = min(delay * 2, MAX_BACKOFF)
