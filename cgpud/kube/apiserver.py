"""The API server, as far as the node agent talks to it: the pods on this
node, one pod, its annotations, this Node and its labels.

A thin edge over cgpud.kube.rest (auth, TLS, JSON): answers are plain
dataclasses, failures CgpuError subclasses.
An API server that cannot be reached, or no credentials at all, is its own
kind (ApiServerUnavailable): callers keep running on the node's config and
catch up later, while an answer the API server gave (403, 404, 422) is an
ApiServerError that says which call and why."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from cgpud.containers.request import ENV_PRIORITY, ENV_WEIGHT
from cgpud.errors import CgpuError
from cgpud.kube.model import Resource
from cgpud.kube.quantity import parse_quantity
from cgpud.kube.rest import JSON, MERGE_PATCH, CredentialsError, RestClient, RestError, server_from

# Pods past these phases hold no device: the kubelet frees what they had.
TERMINAL_PHASES = ("Succeeded", "Failed")
# What the agent calls (deploy/cgpud-rbac.yaml grants exactly these).
PODS = "/api/v1/pods"
POD = "/api/v1/namespaces/{namespace}/pods/{name}"
EVENTS = "/api/v1/namespaces/{namespace}/events"
NODE = "/api/v1/nodes/{name}"
DEFAULT_TIMEOUT = 5.0  # seconds per call: a sweep or an Allocate must not hang on a dead API server
_OUR_RESOURCES = tuple(r.value for r in Resource)


class ApiServerError(CgpuError):
    """The API server answered a call with an error."""


class ApiServerUnavailable(ApiServerError):
    """The API server cannot be reached, or there are no credentials for it:
    run on the node's own config and try again later."""


# The env a container may ask for its compute weight and priority by
# (cgpud.kube.share_priority); an entry set by valueFrom reads as NOT_LITERAL.
POD_SHARE_ENV = (ENV_WEIGHT, ENV_PRIORITY)
NOT_LITERAL = "\0valueFrom"


@dataclass(frozen=True)
class ContainerInfo:
    name: str
    limits: Mapping[str, int]  # our resources only, by resource name; absent: not asked
    init: bool = False
    env: Mapping[str, str] = field(default_factory=dict)  # POD_SHARE_ENV entries only

    def limit(self, resource: Resource) -> int:
        return self.limits.get(resource.value, 0)


@dataclass(frozen=True)
class PodInfo:
    uid: str
    namespace: str
    name: str
    node: str = ""
    phase: str = ""
    annotations: Mapping[str, str] = field(default_factory=dict)
    # Init containers first, then the others: the order the kubelet admits them in.
    containers: tuple[ContainerInfo, ...] = ()
    deleting: bool = False  # a deletion timestamp is set
    priority: int = 0  # spec.priority, from the pod's PriorityClass

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES


@dataclass(frozen=True)
class NodeInfo:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


def _whole(quantity: str, what: str) -> int:
    try:
        value = parse_quantity(quantity)
    except (ValueError, InvalidOperation, TypeError) as e:
        raise ApiServerError(f"{what} = {quantity!r} is not a quantity") from e
    if value != Decimal(int(value)):
        raise ApiServerError(f"{what} = {quantity!r} is not a whole number")
    return int(value)


def _containers(spec: Mapping[str, Any], pod: str) -> tuple[ContainerInfo, ...]:
    out = []
    for init, items in ((True, spec.get("initContainers") or []), (False, spec.get("containers") or [])):
        for c in items:
            limits = (c.get("resources") or {}).get("limits") or {}
            ours = {
                name: _whole(str(q), f"pod {pod} container {c.get('name')} limit {name}")
                for name, q in limits.items()
                if name in _OUR_RESOURCES
            }
            env = {
                str(e["name"]): str(e["value"]) if "value" in e else NOT_LITERAL
                for e in c.get("env") or []
                if isinstance(e, Mapping) and e.get("name") in POD_SHARE_ENV
            }
            out.append(ContainerInfo(str(c.get("name") or ""), ours, init, env))
    return tuple(out)


def pod_info(pod: Mapping[str, Any]) -> PodInfo:
    """A PodInfo from a Pod as the API server sends it (JSON)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec")
    key = f"{meta.get('namespace')}/{meta.get('name')}"
    return PodInfo(
        uid=meta.get("uid") or "",
        namespace=meta.get("namespace") or "",
        name=meta.get("name") or "",
        node=(spec or {}).get("nodeName") or "",
        phase=(pod.get("status") or {}).get("phase") or "",
        annotations=dict(meta.get("annotations") or {}),
        containers=_containers(spec, key) if spec is not None else (),
        deleting=meta.get("deletionTimestamp") is not None,
        priority=_priority((spec or {}).get("priority"), key),
    )


def _priority(value: Any, pod: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiServerError(f"pod {pod}: spec.priority = {value!r} is not an integer")
    return value


def client_from(kubeconfig: Path | None = None, timeout: float = DEFAULT_TIMEOUT, connections: int = 4) -> RestClient:
    """A client from a kubeconfig file when one is given, else the pod's
    service account (in-cluster). No credentials is ApiServerUnavailable."""
    try:
        return RestClient(server_from(kubeconfig), timeout, connections)
    except CredentialsError as e:
        raise ApiServerUnavailable(str(e)) from e


class ApiServer:
    """The calls the node agent makes. Thread-safe as the client is (one
    urllib3 pool)."""

    def __init__(self, client: RestClient) -> None:
        self._client = client

    @classmethod
    def connect(cls, kubeconfig: Path | None = None, timeout: float = DEFAULT_TIMEOUT) -> ApiServer:
        return cls(client_from(kubeconfig, timeout))

    def close(self) -> None:
        self._client.close()

    # ---- pods ----------------------------------------------------------------------

    def pods_on_node(self, node: str) -> list[PodInfo]:
        answer = self._call(
            f"list the pods of node {node}", "GET", PODS, {}, query={"fieldSelector": f"spec.nodeName={node}"}
        )
        return [pod_info(p) for p in answer.get("items") or []]

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        """The pod, or None when there is no such pod."""
        try:
            return pod_info(
                self._call(f"read pod {namespace}/{name}", "GET", POD, {"namespace": namespace, "name": name})
            )
        except _NotFound:
            return None

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> PodInfo:
        """Merge-patch the pod's annotations (None removes one)."""
        body = {"metadata": {"annotations": dict(annotations)}}
        return pod_info(
            self._call(
                f"annotate pod {namespace}/{name}",
                "PATCH",
                POD,
                {"namespace": namespace, "name": name},
                body,
                content_type=MERGE_PATCH,
            )
        )

    def warn_pod(self, pod: PodInfo, node: str, reason: str, message: str) -> None:
        """A Warning event on the pod (what `kubectl describe pod` shows)."""
        self.event_pod(pod, node, reason, message, "Warning")

    def event_pod(self, pod: PodInfo, node: str, reason: str, message: str, kind: str = "Normal") -> None:
        """An event of `kind` (Normal or Warning) on the pod."""
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{pod.name}.", "namespace": pod.namespace},
            "involvedObject": {
                "kind": "Pod",
                "apiVersion": "v1",
                "namespace": pod.namespace,
                "name": pod.name,
                "uid": pod.uid,
            },
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "count": 1,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "source": {"component": "cgpud", "host": node},
            "reportingComponent": "cgpud",
            "reportingInstance": node,
        }
        self._call(
            f"record an event on pod {pod.key}",
            "POST",
            EVENTS,
            {"namespace": pod.namespace},
            body,
        )

    # ---- nodes ----------------------------------------------------------------------

    def node(self, name: str) -> NodeInfo:
        return _node_info(self._call(f"read node {name}", "GET", NODE, {"name": name}), name)

    def label_node(self, name: str, labels: Mapping[str, str | None]) -> NodeInfo:
        """Merge-patch the Node's labels (None removes one)."""
        body = {"metadata": {"labels": dict(labels)}}
        return _node_info(
            self._call(f"label node {name}", "PATCH", NODE, {"name": name}, body, content_type=MERGE_PATCH), name
        )

    def annotate_node(self, name: str, annotations: Mapping[str, str | None]) -> NodeInfo:
        """Merge-patch the Node's annotations (None removes one)."""
        body = {"metadata": {"annotations": dict(annotations)}}
        return _node_info(
            self._call(f"annotate node {name}", "PATCH", NODE, {"name": name}, body, content_type=MERGE_PATCH), name
        )

    # ---- edge ---------------------------------------------------------------------------

    def _call(
        self,
        what: str,
        method: str,
        path: str,
        params: Mapping[str, str],
        body: Any = None,
        *,
        query: Mapping[str, str] | None = None,
        content_type: str = JSON,
    ) -> dict[str, Any]:
        try:
            return self._client.call(method, path, params, query=query, body=body, content_type=content_type)
        except RestError as e:
            if e.status == 404:
                raise _NotFound(f"cannot {what}: not found") from e
            if e.status in (401, 403):
                raise ApiServerError(
                    f"cannot {what}: the API server refused it ({e.status} {e.reason}): "
                    "check cgpud's RBAC (deploy/cgpud-rbac.yaml)"
                ) from e
            if e.status == 0:
                raise ApiServerUnavailable(f"cannot {what}: {e.reason}") from e
            if e.status >= 500:
                raise ApiServerUnavailable(f"cannot {what}: the API server failed ({e.status} {e.reason})") from e
            raise ApiServerError(f"cannot {what}: {e.status} {e.reason}") from e


class _NotFound(ApiServerError):
    pass


def _node_info(node: Mapping[str, Any], name: str) -> NodeInfo:
    meta = node.get("metadata") or {}
    return NodeInfo(meta.get("name") or name, dict(meta.get("labels") or {}), dict(meta.get("annotations") or {}))


class LazyApiServer:
    """An ApiServer made at first use and again after each failure to make
    one: credentials that are missing at start (no service account yet, a
    kubeconfig not yet written) are picked up when they appear, and until
    then every call is ApiServerUnavailable, which callers treat as an
    outage."""

    def __init__(self, kubeconfig: Path | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._kubeconfig = kubeconfig
        self._timeout = timeout
        self._api: ApiServer | None = None

    def _connected(self) -> ApiServer:
        if self._api is None:
            self._api = ApiServer.connect(self._kubeconfig, self._timeout)
        return self._api

    def pods_on_node(self, node: str) -> list[PodInfo]:
        return self._connected().pods_on_node(node)

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        return self._connected().pod(namespace, name)

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> PodInfo:
        return self._connected().annotate_pod(namespace, name, annotations)

    def warn_pod(self, pod: PodInfo, node: str, reason: str, message: str) -> None:
        self._connected().warn_pod(pod, node, reason, message)

    def event_pod(self, pod: PodInfo, node: str, reason: str, message: str, kind: str = "Normal") -> None:
        self._connected().event_pod(pod, node, reason, message, kind)

    def node(self, name: str) -> NodeInfo:
        return self._connected().node(name)

    def label_node(self, name: str, labels: Mapping[str, str | None]) -> NodeInfo:
        return self._connected().label_node(name, labels)

    def annotate_node(self, name: str, annotations: Mapping[str, str | None]) -> NodeInfo:
        return self._connected().annotate_node(name, annotations)

    def close(self) -> None:
        if self._api is not None:
            self._api.close()
