"""Plays the Kubernetes API server for the node agent's few calls, over its
real REST paths and JSON, so cgpud's client (cgpud/kube/rest.py)
runs unchanged: list pods by node (field selector), read and merge-patch a
pod, read and merge-patch a Node. For the scheduler side (cgpu-scheduler):
bind a pod (POST pods/{name}/binding, or the bindings collection), record
an Event (POST events), list
Nodes and watch them (`?watch=true`: the current Nodes as ADDED, then each
change as it is seen). Plain HTTP on 127.0.0.1 (or a given address), a
kubeconfig file pointing at it. Objects live in dicts the test owns (`pods`,
`nodes`)."""

from __future__ import annotations

import http.client
import itertools
import socket
import json
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.harness.net import send_json

MAX_LINE = 65536  # http.server's bounds on a request head
MAX_HEADERS = 100
PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 (and what strategic merge does for plain maps)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def assumed(assume_time: int, gpu_index: int | str | None = None) -> dict[str, str]:
    """The annotations cgpu's scheduler extender leaves on a pod it has placed
    and the kubelet has not allocated yet: assumed at `assume_time` (the
    Allocate that comes takes the oldest pod of its size), not assigned, on
    GPU `gpu_index` when one is named (a string is written as it is: tests
    of malformed annotations give one)."""
    annotations = {"ALIYUN_COM_GPU_MEM_ASSUME_TIME": str(assume_time), "ALIYUN_COM_GPU_MEM_ASSIGNED": "false"}
    if gpu_index is not None:
        annotations["ALIYUN_COM_GPU_MEM_IDX"] = str(gpu_index)
    return annotations


def pod_json(
    name: str,
    node: str,
    *,
    namespace: str = "default",
    containers: Mapping[str, Mapping[str, Any]] | None = None,
    annotations: Mapping[str, str] | None = None,
    phase: str = "Pending",
    uid: str | None = None,
    init_containers: Mapping[str, Mapping[str, Any]] | None = None,
    env: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    priority: int | None = None,
) -> dict[str, Any]:
    """A Pod as the API server sends it; `containers` maps a name to its
    limits, `env` a container's name to its env entries ({"name", "value"}
    or {"name", "valueFrom"}); `priority` is spec.priority (absent if None)."""

    def container(cname: str, limits: Mapping[str, Any]) -> dict[str, Any]:
        made = {"name": cname, "image": "busybox", "resources": {"limits": {k: str(v) for k, v in limits.items()}}}
        if env and cname in env:
            made["env"] = [dict(e) for e in env[cname]]
        return made

    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or str(uuid.uuid4()),
            "annotations": dict(annotations or {}),
            "creationTimestamp": "2026-11-24T00:00:00Z",
        },
        "spec": {
            "nodeName": node,
            "initContainers": [container(c, lim) for c, lim in (init_containers or {}).items()],
            "containers": [container(c, lim) for c, lim in (containers or {"main": {}}).items()],
            **({} if priority is None else {"priority": priority}),
        },
        "status": {"phase": phase},
    }


def node_json(name: str, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": name, "uid": str(uuid.uuid4()), "labels": dict(labels or {})},
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class ApiState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name) -> Pod
        self.nodes: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path with query)
        self.patches: list[tuple[str, str, Any]] = []  # (path, content type, body)
        self.fail_patch: int | None = None  # answer pod PATCHes with this status
        self.fail_binding: int | None = None  # answer Binding POSTs with this status
        self.bindings: list[tuple[str, str, str]] = []  # (namespace, pod, node) of each Binding made
        self.events: list[dict[str, Any]] = []  # Events created (core/v1), as sent
        # A pod's resourceVersion moves with each write served here (add_pod,
        # a Binding, a PATCH), not when a test changes `pods` itself.
        self._versions = itertools.count(1)

    def new_version(self, pod: dict[str, Any]) -> None:
        """The pod was written: a new resourceVersion. Called with the lock held."""
        pod.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))

    def add_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            if "resourceVersion" not in pod["metadata"]:
                self.new_version(pod)
            self.pods[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod
        return pod

    def delete_pod(self, namespace: str, name: str) -> None:
        with self.lock:
            del self.pods[(namespace, name)]

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        with self.lock:
            return json.loads(json.dumps(self.pods[(namespace, name)]))

    def node(self, name: str) -> dict[str, Any]:
        with self.lock:
            return json.loads(json.dumps(self.nodes[name]))

    def bind(
        self,
        namespace: str,
        name: str,
        node: str,
        uid: str = "",
        annotations: Mapping[str, str] | None = None,
        resource_version: str = "",
    ) -> tuple[int, dict[str, Any]]:
        """What the API server does with a Binding: the pod gets its node,
        once (409 Conflict for a pod already bound, as kube-scheduler sees it
        when two binds race, or for a UID or resourceVersion precondition
        the pod no longer meets), and the Binding's annotations in the same
        update (BindingREST.setPodNodeAndMetadata). Called with the lock held."""
        pod = self.pods.get((namespace, name))
        if pod is None:
            return 404, _status(404, "NotFound", f'pods "{name}" not found')
        if uid and uid != pod["metadata"].get("uid"):
            return 409, _status(
                409,
                "Conflict",
                f"Precondition failed: UID in precondition: {uid}, UID in object meta: {pod['metadata'].get('uid')}",
            )
        if resource_version and resource_version != pod["metadata"].get("resourceVersion"):
            return 409, _status(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on pods "{name}": the object has been modified; please apply your '
                "changes to the latest version and try again",
            )
        if self.fail_binding is not None:
            return self.fail_binding, _status(self.fail_binding, "InternalError", "binding refused by test")
        if not node:
            return 400, _status(400, "BadRequest", "Binding target node name is empty")
        bound = pod["spec"].get("nodeName")
        if bound:
            return 409, _status(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on pods/binding "{name}": pod {name} is already '
                f'assigned to node "{bound}"',
            )
        pod["spec"]["nodeName"] = node
        if annotations:
            pod["metadata"].setdefault("annotations", {}).update(annotations)
        self.new_version(pod)
        self.bindings.append((namespace, name, node))
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}


class _Handler(BaseHTTPRequestHandler):
    # Keep-alive, as the API server keeps its clients' connections (HTTP/1.0
    # made every client call pay a connection and this server a thread).
    protocol_version = "HTTP/1.1"
    # The head and the body go in two writes: on a kept connection Nagle
    # would hold the body for the peer's delayed ACK (40 ms). Go's servers
    # set TCP_NODELAY too.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def parse_request(self) -> bool:
        """http.server's parse_request for a well-formed HTTP/1.x request,
        with the head's lines read by hand instead of through the email
        package (http.client.parse_headers): that parser was most of this
        stand-in's CPU per call, which in bench_extender's binds shares two
        vCPUs with the extender and the nodes, while the API server it
        plays (Go) reads a head for a few microseconds. The same fields come
        out (command, path, request_version, headers as an HTTPMessage,
        close_connection), with http.server's bounds (64 KiB a line, 100
        lines); any other request line goes to http.server's own."""
        words = self.raw_requestline.split()
        if len(words) != 3 or words[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
            return super().parse_request()
        self.requestline = self.raw_requestline.decode("iso-8859-1").rstrip("\r\n")
        command, path, version = (w.decode("iso-8859-1") for w in words)
        self.command, self.request_version = command, version
        self.path = "/" + path.lstrip("/") if path.startswith("//") else path
        headers = http.client.HTTPMessage()
        for _ in range(MAX_HEADERS + 1):
            line = self.rfile.readline(MAX_LINE + 1)
            if len(line) > MAX_LINE:
                self.close_connection = True
                self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long")
                return False
            if line in (b"\r\n", b"\n", b""):
                break
            name, colon, value = line.decode("iso-8859-1").partition(":")
            if not colon or name != name.strip():
                self.close_connection = True
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad header line {line[:100]!r}")
                return False
            headers[name] = value.strip()
        else:
            self.close_connection = True
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Too many headers")
            return False
        self.headers = headers
        conntype = headers.get("Connection", "").lower()
        self.close_connection = version != "HTTP/1.1" or conntype == "close"
        if conntype == "keep-alive":
            self.close_connection = False
        if headers.get("Expect", "").lower() == "100-continue" and version == "HTTP/1.1":
            return self.handle_expect_100()
        return True

    def _send(self, code: int, body: Mapping[str, Any]) -> None:
        send_json(self, code, json.dumps(body).encode())

    def _route(self) -> tuple[list[str], dict[str, list[str]]]:
        url = urlsplit(self.path)
        return [p for p in url.path.split("/") if p], parse_qs(url.query)

    def do_GET(self) -> None:
        state = self.server.state
        parts, query = self._route()
        if parts == ["api", "v1", "nodes"] and query.get("watch", ["false"])[0].lower() in ("true", "1"):
            with state.lock:
                state.requests.append(("GET", self.path))
            return self._watch_nodes(float(query.get("timeoutSeconds", ["300"])[0]))
        with state.lock:
            state.requests.append(("GET", self.path))
            if parts == ["api", "v1", "pods"]:
                selector = query.get("fieldSelector", [""])[0]
                node = selector.removeprefix("spec.nodeName=") if selector.startswith("spec.nodeName=") else None
                if selector and node is None:
                    return self._send(400, _status(400, "BadRequest", f"unsupported field selector {selector}"))
                items = [p for p in state.pods.values() if node is None or p["spec"].get("nodeName") == node]
                return self._send(
                    200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items}
                )
            if len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
                pod = state.pods.get((parts[3], parts[5]))
                if pod is None:
                    return self._send(404, _status(404, "NotFound", f'pods "{parts[5]}" not found'))
                return self._send(200, pod)
            if parts == ["api", "v1", "nodes"] and query.get("watch", ["false"])[0].lower() not in ("true", "1"):
                return self._send(
                    200,
                    {
                        "kind": "NodeList",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(self.server.revision)},
                        "items": list(state.nodes.values()),
                    },
                )
            if len(parts) == 4 and parts[:3] == ["api", "v1", "nodes"]:
                node_obj = state.nodes.get(parts[3])
                if node_obj is None:
                    return self._send(404, _status(404, "NotFound", f'nodes "{parts[3]}" not found'))
                return self._send(200, node_obj)
        self._send(404, _status(404, "NotFound", f"no route {self.path}"))

    def _watch_nodes(self, timeout: float) -> None:
        """A watch of Nodes, as the API server streams it: one JSON event a
        line, the current Nodes first (ADDED), then each change seen by
        comparing the Nodes every few milliseconds (tests change the dict
        directly), until the timeout, the client goes or the server stops."""
        state = self.server.state
        # Chunked, as the API server streams a watch: a client reading the
        # body (urllib3's stream) gets each event as it comes, not at the end.
        self.protocol_version = "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        seen: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and not self.server.stopping.is_set():
                with state.lock:
                    now = {name: json.dumps(obj, sort_keys=True) for name, obj in state.nodes.items()}
                events = [("DELETED", seen[n]) for n in seen if n not in now]
                events += [
                    ("ADDED" if n not in seen else "MODIFIED", text) for n, text in now.items() if seen.get(n) != text
                ]
                for kind, text in events:
                    obj = json.loads(text)
                    obj.setdefault("metadata", {})["resourceVersion"] = str(self.server.bump())
                    line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                if events:
                    self.wfile.flush()
                seen = now
                self.server.stopping.wait(0.02)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the watcher went away
            pass

    def do_POST(self) -> None:
        state = self.server.state
        parts, _ = self._route()
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"null")
        except ValueError:
            return self._send(400, _status(400, "BadRequest", "body is not JSON"))
        with state.lock:
            state.requests.append(("POST", self.path))
            target = body.get("target") if isinstance(body, dict) else None
            node = target.get("name", "") if isinstance(target, dict) else ""
            meta = (body.get("metadata") or {}) if isinstance(body, dict) else {}
            # pods/{name}/binding (the subresource kube-scheduler uses) or the bindings collection
            if len(parts) == 7 and parts[:3] == ["api", "v1", "namespaces"] and parts[4:7:2] == ["pods", "binding"]:
                name = parts[5]
            elif parts[:3] == ["api", "v1", "namespaces"] and parts[4:] == ["bindings"]:
                name = meta.get("name", "")
            else:
                name = None
            if name is not None:
                return self._send(
                    *state.bind(
                        parts[3],
                        name,
                        node,
                        meta.get("uid", ""),
                        meta.get("annotations"),
                        meta.get("resourceVersion", ""),
                    )
                )
            if parts[:3] == ["api", "v1", "namespaces"] and parts[4:] == ["events"] and isinstance(body, dict):
                event = dict(body, metadata=dict(meta, name=f"{meta.get('generateName', 'e.')}{len(state.events)}"))
                state.events.append(event)
                return self._send(201, event)
        self._send(404, _status(404, "NotFound", f"no route {self.path}"))

    def do_PATCH(self) -> None:
        state = self.server.state
        parts, _ = self._route()
        kind = self.headers.get("Content-Type", "")
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"null")
        with state.lock:
            state.requests.append(("PATCH", self.path))
            state.patches.append((self.path, kind, body))
            if kind not in PATCH_TYPES:
                return self._send(415, _status(415, "UnsupportedMediaType", f"patch type {kind} not served here"))
            if len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
                key = (parts[3], parts[5])
                if key not in state.pods:
                    return self._send(404, _status(404, "NotFound", f'pods "{parts[5]}" not found'))
                if state.fail_patch is not None:
                    return self._send(state.fail_patch, _status(state.fail_patch, "Forbidden", "patch refused by test"))
                state.pods[key] = merge_patch(state.pods[key], body)
                state.new_version(state.pods[key])
                return self._send(200, state.pods[key])
            if len(parts) == 4 and parts[:3] == ["api", "v1", "nodes"]:
                if parts[3] not in state.nodes:
                    return self._send(404, _status(404, "NotFound", f'nodes "{parts[3]}" not found'))
                state.nodes[parts[3]] = merge_patch(state.nodes[parts[3]], body)
                return self._send(200, state.nodes[parts[3]])
        self._send(404, _status(404, "NotFound", f"no route {self.path}"))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # many clients at once (nodes and a scheduler)

    def __init__(self, state: ApiState, port: int = 0, host: str = "127.0.0.1") -> None:
        super().__init__((host, port), _Handler)
        self.state = state
        self.stopping = threading.Event()  # ends the watches
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._revision = itertools.count(1)
        self.revision = 0

    def bump(self) -> int:
        self.revision = next(self._revision)
        return self.revision

    # The open connections, cut at stop: a kept-alive connection would
    # otherwise go on being answered through an outage.

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def cut_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                socket.socket.shutdown(conn, socket.SHUT_RDWR)
            except OSError:
                pass


class ApiServerProcess:
    """The server thread, startable again on the same port (an outage and
    its end)."""

    def __init__(self, state: ApiState, host: str = "127.0.0.1") -> None:
        self.state = state
        self.host = host
        self._server: _Server | None = _Server(state, host=host)
        self.port = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{'127.0.0.1' if self.host == '0.0.0.0' else self.host}:{self.port}"

    def start(self) -> ApiServerProcess:
        if self._server is None:
            for _ in range(50):  # the port lingers briefly after a stop
                try:
                    self._server = _Server(self.state, self.port, self.host)
                    break
                except OSError:
                    time.sleep(0.1)
            assert self._server is not None, f"cannot listen on port {self.port} again"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stopping.set()
            self._server.shutdown()
            self._server.server_close()
            self._server.cut_connections()
            self._server = None

    def kubeconfig(self, path: Path, address: str | None = None) -> Path:
        """A kubeconfig for this server; `address`: the host its client
        reaches it at (another network namespace's view), else `url`'s."""
        return write_kubeconfig(path, self.url if address is None else f"http://{address}:{self.port}")


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig at `path` for the API server at URL `server`, with a
    bearer token (what cgpud's and kubectl's clients read)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "cgpud", "user": {"token": "test-token"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "cgpud"}}],
    }
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


@contextmanager
def api_server(tmp: Path) -> Iterator[tuple[ApiServerProcess, Path]]:
    server = ApiServerProcess(ApiState()).start()
    try:
        yield server, server.kubeconfig(tmp / "kubeconfig")
    finally:
        server.stop()
