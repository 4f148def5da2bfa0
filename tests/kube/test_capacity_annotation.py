"""The Capacity API's address on the Node (cgpu.io/capacity-address): the
label thread writes it, again when someone changed it, and after an API
server outage. The official client against tests/harness/api_server.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from cgpud.node.model import GIB, GpuCapacity, NodePolicy
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from cgpud.kube.apiserver import ApiServer
from cgpud.kube.model import ANNOTATION_CAPACITY_ADDRESS
from cgpud.kube.node_labels import NodeLabels
from tests.harness.api_server import api_server, node_json
from tests.harness.wait import until

ADDRESS = {ANNOTATION_CAPACITY_ADDRESS: "10.0.0.7:9455"}


def _annotations(state, node: str = "node-1") -> dict[str, str]:
    with state.lock:
        return dict(state.nodes[node]["metadata"].get("annotations", {}))


def test_the_address_is_written_kept_and_written_again_after_an_outage(tmp_path: Path):
    service = InstanceService(
        Store(tmp_path / "cgpud.db"),
        (GpuCapacity(0, "GPU-a", 16 * GIB),),
        NodePolicy(),
        tmp_path / "regions",
        "580",
        "boot",
    )
    with api_server(tmp_path) as (server, kubeconfig):
        server.state.nodes["node-1"] = node_json("node-1")
        server.state.nodes["node-1"]["metadata"]["annotations"] = {"other": "kept"}
        api = ApiServer.connect(kubeconfig, timeout=2.0)
        agent = NodeLabels(api, "node-1", service, NodePolicy(), {}, interval=0.05, max_backoff=0.2).annotate(ADDRESS)
        assert agent.sync()
        assert _annotations(server.state) == {"other": "kept", **ADDRESS}
        patches = len(server.state.patches)
        assert agent.sync() and len(server.state.patches) == patches  # nothing to change: no patch

        server.stop()
        with server.state.lock:  # someone removed it while the API server was away
            server.state.nodes["node-1"]["metadata"]["annotations"].pop(ANNOTATION_CAPACITY_ADDRESS)
        assert not agent.sync() and not agent.reachable
        stop = threading.Event()
        agent.start(stop)
        try:
            time.sleep(0.3)
            server.start()
            until(
                lambda: ANNOTATION_CAPACITY_ADDRESS in _annotations(server.state),
                timeout=5,
                interval=0.05,
                what="the annotation to be written back once the API server returned",
                explain=lambda: f"annotations: {_annotations(server.state)}",
            )
            assert _annotations(server.state) == {"other": "kept", **ADDRESS} and agent.reachable
        finally:
            stop.set()
            agent.join(2)
            api.close()
