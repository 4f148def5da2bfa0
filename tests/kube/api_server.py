"""Plays the Kubernetes API server for the node agent's few calls, over its
real REST paths and JSON, so the official client library on cgpud's side
runs unchanged: list pods by node (field selector), read and merge-patch a
pod, read and merge-patch a Node. Plain HTTP on 127.0.0.1, a kubeconfig file
pointing at it. Objects live in dicts the test owns (`pods`, `nodes`)."""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

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


def pod_json(name: str, node: str, *, namespace: str = "default", containers: Mapping[str, Mapping[str, Any]] | None = None,
             annotations: Mapping[str, str] | None = None, phase: str = "Pending", uid: str | None = None,
             init_containers: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """A Pod as the API server sends it; `containers` maps a name to its limits."""
    def container(cname: str, limits: Mapping[str, Any]) -> dict[str, Any]:
        return {"name": cname, "image": "busybox", "resources": {"limits": {k: str(v) for k, v in limits.items()}}}

    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuid.uuid4()),
                     "annotations": dict(annotations or {}), "creationTimestamp": "2026-11-24T00:00:00Z"},
        "spec": {"nodeName": node,
                 "initContainers": [container(c, lim) for c, lim in (init_containers or {}).items()],
                 "containers": [container(c, lim) for c, lim in (containers or {"main": {}}).items()]},
        "status": {"phase": phase},
    }


def node_json(name: str, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    return {"kind": "Node", "apiVersion": "v1",
            "metadata": {"name": name, "uid": str(uuid.uuid4()), "labels": dict(labels or {})}}


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class ApiState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name) -> Pod
        self.nodes: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path with query)
        self.patches: list[tuple[str, str, Any]] = []  # (path, content type, body)
        self.fail_patch: int | None = None  # answer pod PATCHes with this status

    def add_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.pods[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod
        return pod

    def delete_pod(self, namespace: str, name: str) -> None:
        with self.lock:
            del self.pods[(namespace, name)]

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        with self.lock:
            return json.loads(json.dumps(self.pods[(namespace, name)]))


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self) -> tuple[list[str], dict[str, list[str]]]:
        url = urlsplit(self.path)
        return [p for p in url.path.split("/") if p], parse_qs(url.query)

    def do_GET(self) -> None:
        state = self.server.state
        parts, query = self._route()
        with state.lock:
            state.requests.append(("GET", self.path))
            if parts == ["api", "v1", "pods"]:
                selector = query.get("fieldSelector", [""])[0]
                node = selector.removeprefix("spec.nodeName=") if selector.startswith("spec.nodeName=") else None
                if selector and node is None:
                    return self._send(400, _status(400, "BadRequest", f"unsupported field selector {selector}"))
                items = [p for p in state.pods.values() if node is None or p["spec"].get("nodeName") == node]
                return self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                                        "items": items})
            if len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
                pod = state.pods.get((parts[3], parts[5]))
                if pod is None:
                    return self._send(404, _status(404, "NotFound", f'pods "{parts[5]}" not found'))
                return self._send(200, pod)
            if len(parts) == 4 and parts[:3] == ["api", "v1", "nodes"]:
                node_obj = state.nodes.get(parts[3])
                if node_obj is None:
                    return self._send(404, _status(404, "NotFound", f'nodes "{parts[3]}" not found'))
                return self._send(200, node_obj)
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
                return self._send(200, state.pods[key])
            if len(parts) == 4 and parts[:3] == ["api", "v1", "nodes"]:
                if parts[3] not in state.nodes:
                    return self._send(404, _status(404, "NotFound", f'nodes "{parts[3]}" not found'))
                state.nodes[parts[3]] = merge_patch(state.nodes[parts[3]], body)
                return self._send(200, state.nodes[parts[3]])
        self._send(404, _status(404, "NotFound", f"no route {self.path}"))


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: ApiState, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.state = state


class ApiServerProcess:
    """The server thread, startable again on the same port (an outage and
    its end)."""

    def __init__(self, state: ApiState) -> None:
        self.state = state
        self._server: _Server | None = _Server(state)
        self.port = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ApiServerProcess:
        if self._server is None:
            for _ in range(50):  # the port lingers briefly after a stop
                try:
                    self._server = _Server(self.state, self.port)
                    break
                except OSError:
                    time.sleep(0.1)
            assert self._server is not None, f"cannot listen on port {self.port} again"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
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
