"""The API server, as far as the node agent talks to it: the pods on this
node, one pod, its annotations, this Node and its labels.

A thin edge over the official `kubernetes` client (which keeps auth, TLS and
the API types): answers are plain dataclasses, failures CgpuError subclasses.
An API server that cannot be reached, or no credentials at all, is its own
kind (ApiServerUnavailable): callers keep running on the node's config and
catch up later, while an answer the API server gave (403, 404, 422) is an
ApiServerError that says which call and why.

The client is imported where it is first used, not with this module: it is
150 ms of every cgpud start (a third of it), and only kubernetes mode calls it."""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgpud.errors import CgpuError
from cgpud.kube.model import Resource

if TYPE_CHECKING:
    from kubernetes import client as k8s
    from kubernetes.client.exceptions import ApiException

MERGE_PATCH = "application/merge-patch+json"
# Pods past these phases hold no device: the kubelet frees what they had.
TERMINAL_PHASES = ("Succeeded", "Failed")
DEFAULT_TIMEOUT = 5.0  # seconds per call: a sweep or an Allocate must not hang on a dead API server
_OUR_RESOURCES = tuple(r.value for r in Resource)


class ApiServerError(CgpuError):
    """The API server answered a call with an error."""


class ApiServerUnavailable(ApiServerError):
    """The API server cannot be reached, or there are no credentials for it:
    run on the node's own config and try again later."""


@dataclass(frozen=True)
class ContainerInfo:
    name: str
    limits: Mapping[str, int]  # our resources only, by resource name; absent: not asked
    init: bool = False

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
    from kubernetes.utils import parse_quantity

    try:
        value = parse_quantity(quantity)
    except (ValueError, InvalidOperation, TypeError) as e:
        raise ApiServerError(f"{what} = {quantity!r} is not a quantity") from e
    if value != Decimal(int(value)):
        raise ApiServerError(f"{what} = {quantity!r} is not a whole number")
    return int(value)


def _containers(spec: Any, pod: str) -> tuple[ContainerInfo, ...]:
    out = []
    for init, items in ((True, spec.init_containers or []), (False, spec.containers or [])):
        for c in items:
            limits = (c.resources.limits if c.resources is not None else None) or {}
            ours = {
                name: _whole(str(q), f"pod {pod} container {c.name} limit {name}")
                for name, q in limits.items()
                if name in _OUR_RESOURCES
            }
            out.append(ContainerInfo(c.name, ours, init))
    return tuple(out)


def pod_info(pod: Any) -> PodInfo:
    """A PodInfo from the client's V1Pod."""
    meta = pod.metadata
    key = f"{meta.namespace}/{meta.name}"
    return PodInfo(
        uid=meta.uid or "",
        namespace=meta.namespace or "",
        name=meta.name or "",
        node=(pod.spec.node_name if pod.spec is not None else None) or "",
        phase=(pod.status.phase if pod.status is not None else None) or "",
        annotations=dict(meta.annotations or {}),
        containers=_containers(pod.spec, key) if pod.spec is not None else (),
        deleting=meta.deletion_timestamp is not None,
    )


def client_from(kubeconfig: Path | None = None) -> k8s.ApiClient:
    """An API client from a kubeconfig file when one is given, else the pod's
    service account (in-cluster). No credentials is ApiServerUnavailable."""
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config
    from kubernetes.config.config_exception import ConfigException

    configuration = k8s.Configuration()
    try:
        if kubeconfig is not None:
            if not kubeconfig.is_file():
                raise ApiServerUnavailable(f"kubeconfig {kubeconfig} does not exist")
            k8s_config.load_kube_config(
                config_file=str(kubeconfig), client_configuration=configuration, persist_config=False
            )
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s_config.load_incluster_config(client_configuration=configuration)
        else:
            raise ApiServerUnavailable(
                "no credentials for the API server: not in a pod (KUBERNETES_SERVICE_HOST is unset) and no "
                "kubeconfig given"
            )
    except ConfigException as e:
        raise ApiServerUnavailable(f"cannot load the API server's credentials: {e}") from e
    configuration.retries = 0  # callers retry on their own schedule; a dead server must fail fast
    return k8s.ApiClient(configuration)


class ApiServer:
    """The calls the node agent makes. Thread-safe as the client is (one
    urllib3 pool)."""

    def __init__(self, api_client: k8s.ApiClient, timeout: float = DEFAULT_TIMEOUT) -> None:
        from kubernetes import client as k8s

        self._client = api_client
        self._core = k8s.CoreV1Api(api_client)
        self._timeout = timeout

    @classmethod
    def connect(cls, kubeconfig: Path | None = None, timeout: float = DEFAULT_TIMEOUT) -> ApiServer:
        return cls(client_from(kubeconfig), timeout)

    def close(self) -> None:
        self._client.close()

    # ---- pods ----------------------------------------------------------------------

    def pods_on_node(self, node: str) -> list[PodInfo]:
        answer = self._call(
            f"list the pods of node {node}",
            self._core.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={node}",
        )
        return [pod_info(p) for p in answer.items or []]

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        """The pod, or None when there is no such pod."""
        try:
            return pod_info(self._call(f"read pod {namespace}/{name}", self._core.read_namespaced_pod, name, namespace))
        except _NotFound:
            return None

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> PodInfo:
        """Merge-patch the pod's annotations (None removes one)."""
        body = {"metadata": {"annotations": dict(annotations)}}
        return pod_info(
            self._call(
                f"annotate pod {namespace}/{name}",
                self._core.patch_namespaced_pod,
                name,
                namespace,
                body,
                _content_type=MERGE_PATCH,
            )
        )

    def warn_pod(self, pod: PodInfo, node: str, reason: str, message: str) -> None:
        """A Warning event on the pod (what `kubectl describe pod` shows)."""
        from kubernetes import client as k8s

        now = datetime.datetime.now(datetime.UTC)
        body = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(generate_name=f"{pod.name}.", namespace=pod.namespace),
            involved_object=k8s.V1ObjectReference(
                kind="Pod", api_version="v1", namespace=pod.namespace, name=pod.name, uid=pod.uid
            ),
            reason=reason,
            message=message[:1024],
            type="Warning",
            count=1,
            first_timestamp=now,
            last_timestamp=now,
            source=k8s.V1EventSource(component="cgpud", host=node),
            reporting_component="cgpud",
            reporting_instance=node,
        )
        self._call(f"record an event on pod {pod.key}", self._core.create_namespaced_event, pod.namespace, body)

    # ---- nodes ----------------------------------------------------------------------

    def node(self, name: str) -> NodeInfo:
        return _node_info(self._call(f"read node {name}", self._core.read_node, name), name)

    def label_node(self, name: str, labels: Mapping[str, str | None]) -> NodeInfo:
        """Merge-patch the Node's labels (None removes one)."""
        body = {"metadata": {"labels": dict(labels)}}
        return _node_info(
            self._call(f"label node {name}", self._core.patch_node, name, body, _content_type=MERGE_PATCH), name
        )

    def annotate_node(self, name: str, annotations: Mapping[str, str | None]) -> NodeInfo:
        """Merge-patch the Node's annotations (None removes one)."""
        body = {"metadata": {"annotations": dict(annotations)}}
        return _node_info(
            self._call(f"annotate node {name}", self._core.patch_node, name, body, _content_type=MERGE_PATCH), name
        )

    # ---- edge ---------------------------------------------------------------------------

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, _request_timeout=self._timeout, **kwargs)
        except ApiException as e:
            if e.status == 404:
                raise _NotFound(f"cannot {what}: not found") from e
            reason = _reason(e)
            if e.status in (401, 403):
                raise ApiServerError(
                    f"cannot {what}: the API server refused it ({e.status} {reason}): "
                    "check cgpud's RBAC (deploy/cgpud-rbac.yaml)"
                ) from e
            if e.status is None or e.status >= 500 or e.status == 0:
                raise ApiServerUnavailable(f"cannot {what}: the API server failed ({e.status} {reason})") from e
            raise ApiServerError(f"cannot {what}: {e.status} {reason}") from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise ApiServerUnavailable(f"cannot {what}: the API server cannot be reached ({e})") from e


class _NotFound(ApiServerError):
    pass


def _node_info(node: Any, name: str) -> NodeInfo:
    meta = node.metadata
    return NodeInfo(meta.name or name, dict(meta.labels or {}), dict(meta.annotations or {}))


def _reason(e: ApiException) -> str:
    """The Status message the API server sent, else the HTTP reason."""
    try:
        status = json.loads(e.body or "")
        if isinstance(status, dict) and status.get("message"):
            return str(status["message"])
    except (ValueError, TypeError):
        pass
    return str(e.reason or "")


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

    def node(self, name: str) -> NodeInfo:
        return self._connected().node(name)

    def label_node(self, name: str, labels: Mapping[str, str | None]) -> NodeInfo:
        return self._connected().label_node(name, labels)

    def annotate_node(self, name: str, annotations: Mapping[str, str | None]) -> NodeInfo:
        return self._connected().annotate_node(name, annotations)

    def close(self) -> None:
        if self._api is not None:
            self._api.close()
