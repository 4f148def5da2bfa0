"""cgpu-scheduler with an API server (tests/harness/api_server.py) and real
cgpud nodes: nodes found through their cgpu.io/capacity-address annotation
(list + watch), bind writes the gpushare annotations and the Binding, and a
Binding the API server refuses gives the node's reservation back."""

from __future__ import annotations

import http.client
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cgpud.extender.client import get_node
from cgpud.kube import assignment
from cgpud.kube.apiserver import ApiServer
from tests.harness.cgpud_nodes import cgpud_nodes
from tests.harness.extender_process import extender_process
from tests.harness.wait import until
from tests.harness.api_server import ApiState, api_server, node_json, pod_json


class Scheduler:
    def __init__(self, port: int, kubeconfig: Path) -> None:
        self.port = port
        self.kubeconfig = kubeconfig

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            c.request(
                method,
                path,
                body=None if body is None else json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            r = c.getresponse()
            return r.status, json.loads(r.read())
        finally:
            c.close()

    def filter(self, state: ApiState, name: str, nodes: list[str]) -> dict[str, Any]:
        code, out = self.call("POST", "/filter", {"Pod": state.pod("default", name), "NodeNames": nodes, "Nodes": None})
        assert code == 200
        return out

    def bind(self, state: ApiState, name: str, node: str) -> str:
        uid = state.pod("default", name)["metadata"]["uid"]
        code, out = self.call(
            "POST", "/bind", {"PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": node}
        )
        assert code == 200
        return str(out["Error"])


@pytest.fixture
def setup(tmp_path: Path, native: Path) -> Iterator[tuple[list[Any], ApiState, Scheduler]]:
    with cgpud_nodes(tmp_path, native, 2) as nodes, api_server(tmp_path) as (api, kubeconfig):
        for n in nodes:
            obj = node_json(n.name)
            obj["metadata"]["annotations"] = {"cgpu.io/capacity-address": n.address}
            api.state.nodes[n.name] = obj
        api.state.nodes["plain"] = node_json("plain")
        with extender_process(tmp_path / "scheduler.log", "--kubeconfig", str(kubeconfig)) as (proc, port):
            sched = Scheduler(port, kubeconfig)
            try:

                def ready() -> bool:
                    try:
                        _, view = sched.call("GET", "/inspect")
                    except OSError:
                        return False
                    return sorted(n["name"] for n in view["nodes"] if n["connected"]) == ["node-0", "node-1"]

                until(ready, timeout=15, what="both nodes found through the API server")
                yield nodes, api.state, sched
            finally:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=10) == 0


def gpu_pod(state: ApiState, name: str, gib: int, count: int = 1) -> dict[str, Any]:
    limits = {"aliyun.com/gpu-mem": gib, **({"aliyun.com/gpu-count": count} if count > 1 else {})}
    return state.add_pod(pod_json(name, "", containers={"main": limits}))


def test_nodes_from_annotations_bind_annotates_and_binds(setup: tuple[list[Any], ApiState, Scheduler]) -> None:
    nodes, state, sched = setup
    names = ["node-0", "node-1", "plain"]
    gpu_pod(state, "a", 6)
    out = sched.filter(state, "a", names)
    assert out["NodeNames"] == ["node-0", "node-1"]
    assert "no cgpu.io/capacity-address annotation: not a cgpu node" in out["FailedAndUnresolvableNodes"]["plain"]
    assert sched.bind(state, "a", "node-0") == ""
    pod = state.pod("default", "a")
    assert pod["spec"]["nodeName"] == "node-0" and state.bindings == [("default", "a", "node-0")]
    notes = pod["metadata"]["annotations"]
    assert notes["ALIYUN_COM_GPU_MEM_IDX"] == "0" and notes["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "false"
    assert notes["ALIYUN_COM_GPU_MEM_POD"] == "6" and int(notes["ALIYUN_COM_GPU_MEM_ASSUME_TIME"]) > 0
    view = get_node(nodes[0].address, None)
    assert [(p.pod_uid, p.gpus) for p in view.pods if p.reserved] == [(pod["metadata"]["uid"], ((0, 6 << 30, 0),))]
    # The device plugin's reading of the annotations names the same GPU.
    api = ApiServer.connect(sched.kubeconfig)
    try:
        info = api.pod("default", "a")
    finally:
        api.close()
    assert info is not None and assignment.resolve_memory([info], 6, "node-0", set()).assignment.gpu_indexes == (0,)

    # A pod the extender never saw at filter is read from the API server.
    gpu_pod(state, "b", 8, count=2)
    assert sched.bind(state, "b", "node-1") == ""
    notes = state.pod("default", "b")["metadata"]["annotations"]
    assert json.loads(notes["scheduler.framework.gpushare.allocation"]) == {"0": {"0": 4, "1": 4}}


def test_a_refused_binding_gives_the_reservation_back(setup: tuple[list[Any], ApiState, Scheduler]) -> None:
    nodes, state, sched = setup
    gpu_pod(state, "c", 4)
    sched.filter(state, "c", ["node-0"])
    state.fail_binding = 500
    error = sched.bind(state, "c", "node-0")
    assert "cannot bind pod default/c to node node-0: 500" in error
    uid = state.pod("default", "c")["metadata"]["uid"]
    assert not any(p.pod_uid == uid for p in get_node(nodes[0].address, None).pods)
    state.fail_binding = None
    assert sched.bind(state, "c", "node-0") == ""
    assert any(p.pod_uid == uid for p in get_node(nodes[0].address, None).pods)


def test_a_pod_recreated_under_the_same_name_is_not_bound(setup: tuple[list[Any], ApiState, Scheduler]) -> None:
    nodes, state, sched = setup
    gpu_pod(state, "d", 4)
    code, out = sched.call(
        "POST", "/bind", {"PodName": "d", "PodNamespace": "default", "PodUID": "stale-uid", "Node": "node-0"}
    )
    assert code == 200 and "recreated" in out["Error"] and state.bindings == []
    assert not any(p.reserved for p in get_node(nodes[0].address, None).pods)


def test_a_node_losing_its_annotation_is_dropped(setup: tuple[list[Any], ApiState, Scheduler]) -> None:
    _, state, sched = setup
    gpu_pod(state, "e", 4)
    with state.lock:
        del state.nodes["node-1"]["metadata"]["annotations"]["cgpu.io/capacity-address"]

    def dropped() -> str | None:
        out = sched.filter(state, "e", ["node-0", "node-1"])
        return out["FailedAndUnresolvableNodes"].get("node-1")

    reason = until(dropped, timeout=10, what="node-1 dropped")
    assert "no cgpu.io/capacity-address annotation" in reason
    _, view = sched.call("GET", "/inspect")
    assert [n["name"] for n in view["nodes"]] == ["node-0"]
