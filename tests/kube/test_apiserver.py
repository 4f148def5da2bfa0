"""cgpud/kube/apiserver.py through the official client library against
tests/harness/api_server.py, which serves the API server's REST paths and JSON."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.kube.apiserver import ApiServer, ApiServerError, ApiServerUnavailable, ContainerInfo, LazyApiServer
from cgpud.kube.apiserver import client_from
from tests.harness.api_server import ApiServerProcess, api_server, node_json, pod_json


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ApiServerProcess, ApiServer]]:
    with api_server(tmp_path) as (server, kubeconfig):
        api = ApiServer.connect(kubeconfig, timeout=2.0)
        yield server, api
        api.close()


def test_pods_of_this_node_only_with_our_limits(served):
    server, api = served
    server.state.add_pod(
        pod_json(
            "a",
            "node-1",
            containers={"main": {"aliyun.com/gpu-mem": 2, "cpu": "500m"}},
            init_containers={"setup": {"aliyun.com/gpu-core.percentage": 30}},
            annotations={"ALIYUN_COM_GPU_MEM_IDX": "1"},
            uid="uid-a",
        )
    )
    server.state.add_pod(pod_json("b", "node-2"))
    pods = api.pods_on_node("node-1")
    assert [p.key for p in pods] == ["default/a"]
    a = pods[0]
    assert (a.uid, a.node, a.phase, a.deleting) == ("uid-a", "node-1", "Pending", False)
    assert a.annotations == {"ALIYUN_COM_GPU_MEM_IDX": "1"}
    assert a.containers == (
        ContainerInfo("setup", {"aliyun.com/gpu-core.percentage": 30}, True),
        ContainerInfo("main", {"aliyun.com/gpu-mem": 2}),
    )
    assert ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-1") in server.state.requests


def test_get_patch_and_missing_pod(served):
    server, api = served
    server.state.add_pod(pod_json("a", "node-1", annotations={"keep": "1", "drop": "x"}))
    assert api.pod("default", "nope") is None
    patched = api.annotate_pod("default", "a", {"ALIYUN_COM_GPU_MEM_ASSIGNED": "true", "drop": None})
    assert patched.annotations == {"keep": "1", "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}
    assert api.pod("default", "a").annotations == patched.annotations
    assert server.state.patches[-1][1] == "application/merge-patch+json"


def test_node_labels_read_and_patched(served):
    server, api = served
    server.state.nodes["node-1"] = node_json("node-1", {"ack.node.gpu.schedule": "cgpu"})
    assert api.node("node-1").labels == {"ack.node.gpu.schedule": "cgpu"}
    got = api.label_node("node-1", {"aliyun.accelerator/nvidia_count": "2"})
    assert got.labels == {"ack.node.gpu.schedule": "cgpu", "aliyun.accelerator/nvidia_count": "2"}
    with pytest.raises(ApiServerError, match="cannot read node node-9: not found"):
        api.node("node-9")


def test_a_refusal_names_the_call_and_rbac(served):
    server, api = served
    server.state.add_pod(pod_json("a", "node-1"))
    server.state.fail_patch = 403
    with pytest.raises(
        ApiServerError,
        match=r"cannot annotate pod default/a: the API server refused it \(403 patch "
        r"refused by test\): check cgpud's RBAC",
    ) as info:
        api.annotate_pod("default", "a", {"x": "1"})
    assert not isinstance(info.value, ApiServerUnavailable)


def test_an_unreachable_server_is_its_own_kind_and_recovers(served):
    server, api = served
    server.stop()
    with pytest.raises(
        ApiServerUnavailable, match="cannot list the pods of node node-1: the API server cannot be reached"
    ):
        api.pods_on_node("node-1")
    server.start()
    assert api.pods_on_node("node-1") == []


def test_no_credentials_is_unavailable(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ApiServerUnavailable, match="no credentials for the API server"):
        client_from(None)
    with pytest.raises(ApiServerUnavailable, match="does not exist"):
        client_from(tmp_path / "missing")
    (tmp_path / "broken").write_text("{}")
    with pytest.raises(ApiServerUnavailable, match="cannot load the API server's credentials"):
        client_from(tmp_path / "broken")


def test_the_lazy_client_connects_when_credentials_appear(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    later = tmp_path / "later" / "kubeconfig"
    lazy = LazyApiServer(later, timeout=2.0)
    with pytest.raises(ApiServerUnavailable, match="does not exist"):
        lazy.pods_on_node("node-1")
    with api_server(tmp_path) as (server, kubeconfig):
        server.state.nodes["node-1"] = node_json("node-1", {"a": "b"})
        later.parent.mkdir()
        later.write_text(kubeconfig.read_text())
        assert lazy.node("node-1").labels == {"a": "b"}
        lazy.close()
