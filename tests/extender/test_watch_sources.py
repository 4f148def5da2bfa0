"""watch.py's node sources: the node file and the Node annotation."""

from __future__ import annotations

import pytest

from cgpud.errors import UsageError
from cgpud.extender.watch import capacity_addresses, parse_node_file
from tests.harness.wait import until


def test_node_file() -> None:
    text = "# cluster\nnode-1 10.0.0.1:9455\n\nnode-2   [fd00::2]:9455  # v6\n  node-3 host.example:1\n"
    assert parse_node_file(text) == {"node-1": "10.0.0.1:9455", "node-2": "[fd00::2]:9455", "node-3": "host.example:1"}


@pytest.mark.parametrize(
    "line, words",
    [
        ("node-1", "line 1: 'node-1' is not `NAME HOST:PORT`"),
        ("node-1 10.0.0.1", "is not `NAME HOST:PORT`"),
        ("node-1 10.0.0.1:99999", "is not `NAME HOST:PORT`"),
        ("node-1 fd00::1:9455", "is not `NAME HOST:PORT`"),
        ("node-1 a:1 extra", "is not `NAME HOST:PORT`"),
        ("node-1 a:1\nnode-1 b:1", "line 2: node node-1 is listed twice"),
    ],
)
def test_bad_node_file_lines(line: str, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        parse_node_file(line, "nodes.txt")


def test_capacity_addresses_from_node_annotations() -> None:
    nodes = [
        {"metadata": {"name": "a", "annotations": {"cgpu.io/capacity-address": "10.0.0.1:9455"}}},
        {"metadata": {"name": "b", "annotations": {}}},
        {"metadata": {"name": "c", "annotations": {"cgpu.io/capacity-address": "nonsense"}}},
        {"metadata": {"name": "d"}},
    ]
    found, skipped = capacity_addresses(nodes)
    assert found == {"a": "10.0.0.1:9455"}
    assert set(skipped) == {"b", "c", "d"}
    assert "no cgpu.io/capacity-address annotation: not a cgpu node" in skipped["b"]
    assert "'nonsense' is not HOST:PORT" in skipped["c"]


def test_api_node_source_follows_nodes_and_survives_an_api_server_outage(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cgpud.extender.watch import ApiNodeSource
    from cgpud.kube.apiserver import client_from
    from tests.harness.api_server import api_server, node_json

    seen: list[dict[str, str]] = []
    skipped: list[dict[str, str]] = []

    with api_server(tmp_path) as (api, kubeconfig):
        a = node_json("a")
        a["metadata"]["annotations"] = {"cgpu.io/capacity-address": "10.0.0.1:9455"}
        api.state.nodes["a"] = a
        api.state.nodes["b"] = node_json("b")
        source = ApiNodeSource(client_from(kubeconfig), seen.append, skipped.append).start()
        try:
            until(lambda: bool(seen) and seen[-1] == {"a": "10.0.0.1:9455"})
            assert "b" in skipped[-1]
            # An annotation added by a watch event.
            with api.state.lock:
                api.state.nodes["b"]["metadata"]["annotations"] = {"cgpu.io/capacity-address": "10.0.0.2:9455"}
            until(lambda: seen[-1] == {"a": "10.0.0.1:9455", "b": "10.0.0.2:9455"})
            # The API server goes away and comes back with a node less: listed again.
            api.stop()
            with api.state.lock:
                del api.state.nodes["a"]
            api.start()
            until(lambda: seen[-1] == {"b": "10.0.0.2:9455"}, timeout=15)
        finally:
            source.stop()
