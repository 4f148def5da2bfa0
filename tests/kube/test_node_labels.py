"""The node describes itself (cgpud/kube/node_labels.py): labels drive mode
and placement at runtime by the rules of `policy_change_problem`, card-model
labels are written, and an API server outage keeps the node on what it has
until it answers again. The official client against tests/harness/api_server.py,
the real instance service."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.node.model import GIB, GpuCapacity, NodeMode, NodePolicy, Owner, OwnerKind, Placement, Request
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from cgpud.kube.apiserver import ApiServer
from cgpud.kube.node_labels import NodeLabels, card_label_patch, initial_policy, label_policy
from tests.harness.api_server import ApiServerProcess, api_server, node_json
from tests.harness.wait import until

GPUS = (GpuCapacity(0, "GPU-aaaa", 16 * GIB),)
CARD = {
    "aliyun.accelerator/nvidia_name": "NVIDIA-H100-80GB-HBM3",
    "aliyun.accelerator/nvidia_mem": "16384MiB",
    "aliyun.accelerator/nvidia_count": "1",
}
CONFIGURED = NodePolicy(mode=NodeMode.CGPU, placement=Placement.BINPACK)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ApiServerProcess, ApiServer, InstanceService]]:
    service = InstanceService(Store(tmp_path / "cgpud.db"), GPUS, CONFIGURED, tmp_path / "regions", "580", "boot")
    with api_server(tmp_path) as (server, kubeconfig):
        server.state.nodes["node-1"] = node_json("node-1", {"ack.node.gpu.schedule": "cgpu"})
        api = ApiServer.connect(kubeconfig, timeout=2.0)
        yield server, api, service
        api.close()


def labels(server: ApiServerProcess) -> dict[str, str]:
    return server.state.nodes["node-1"]["metadata"]["labels"]


def test_label_policy_and_card_patch_are_pure():
    got = label_policy({"ack.node.gpu.schedule": "share", "ack.node.gpu.placement": "spread"}, CONFIGURED)
    assert (got.mode, got.placement, got.problems) == (NodeMode.SHARE, Placement.SPREAD, ())
    absent = label_policy({}, CONFIGURED)
    assert (absent.mode, absent.placement) == (NodeMode.CGPU, Placement.BINPACK)
    bad = label_policy({"ack.node.gpu.schedule": "turbo", "ack.node.gpu.placement": "pack"}, CONFIGURED)
    assert (bad.mode, bad.placement) == (NodeMode.CGPU, Placement.BINPACK)
    assert bad.problems[0].startswith("label ack.node.gpu.schedule='turbo' is not a mode cgpud knows")
    assert bad.problems[1] == "label ack.node.gpu.placement='pack' is not binpack or spread: keeping binpack"
    assert card_label_patch({**CARD, "aliyun.accelerator/nvidia_count": "2"}, CARD) == {
        "aliyun.accelerator/nvidia_count": "1"
    }
    assert card_label_patch(CARD, CARD) == {}


def test_a_core_mem_label_is_refused_where_more_instances_per_gpu_are_allowed_than_it_schedules():
    from dataclasses import replace

    many = replace(CONFIGURED, max_instances_per_gpu=40)
    got = label_policy({"ack.node.gpu.schedule": "core_mem"}, many)
    assert got.mode is NodeMode.CGPU
    assert got.problems == (
        "label ack.node.gpu.schedule=core_mem needs max_instances_per_gpu of at most 32 (the "
        "instances the compute scheduler takes per GPU; it is 40): keeping cgpu",
    )
    assert label_policy({"ack.node.gpu.schedule": "core_mem"}, CONFIGURED).mode is NodeMode.CORE_MEM


def test_card_labels_are_written_once(served):
    server, api, service = served
    agent = NodeLabels(api, "node-1", service, CONFIGURED, CARD)
    assert agent.sync()
    assert labels(server) == {"ack.node.gpu.schedule": "cgpu", **CARD}
    patches = len(server.state.patches)
    assert agent.sync() and len(server.state.patches) == patches  # nothing to change: no PATCH


def test_a_placement_label_change_takes_effect_without_a_restart(served):
    server, api, service = served
    seen: list[NodePolicy] = []
    agent = NodeLabels(api, "node-1", service, CONFIGURED, CARD, on_policy=seen.append)
    service.create(Request(Owner(OwnerKind.CONTAINER, "c1"), 2 * GIB))  # placement may change under instances
    labels(server)["ack.node.gpu.placement"] = "spread"
    assert agent.sync()
    assert service.policy().placement is Placement.SPREAD and [p.placement for p in seen] == [Placement.SPREAD]


def test_a_mode_change_waits_until_no_instance_would_break(served):
    server, api, service = served
    agent = NodeLabels(api, "node-1", service, CONFIGURED, CARD)
    inst = service.create(Request(Owner(OwnerKind.CONTAINER, "c1"), 2 * GIB))
    labels(server)["ack.node.gpu.schedule"] = "share"
    assert agent.sync()
    assert service.policy().mode is NodeMode.CGPU  # refused, logged, kept
    service.release(inst.id)
    assert agent.sync()
    assert service.policy().mode is NodeMode.SHARE
    labels(server)["ack.node.gpu.schedule"] = "core_mem"
    assert agent.sync() and service.policy().mode is NodeMode.SHARE  # needs the compute scheduler: a restart


def test_an_unreadable_label_keeps_the_configured_value(served):
    server, api, service = served
    labels(server)["ack.node.gpu.placement"] = "diagonal"
    assert NodeLabels(api, "node-1", service, CONFIGURED, CARD).sync()
    assert service.policy().placement is Placement.BINPACK


def test_an_outage_keeps_the_policy_and_the_loop_catches_up(served):
    server, api, service = served
    server.stop()
    agent = NodeLabels(api, "node-1", service, CONFIGURED, CARD, interval=0.05, max_backoff=0.2)
    assert not agent.sync() and not agent.reachable
    assert initial_policy(api, "node-1", CONFIGURED) == CONFIGURED
    assert service.policy() == CONFIGURED
    labels(server)["ack.node.gpu.placement"] = "spread"
    stop = threading.Event()
    agent.start(stop)
    try:
        time.sleep(0.3)
        assert service.policy().placement is Placement.BINPACK
        server.start()
        until(
            lambda: service.policy().placement is Placement.SPREAD,
            timeout=5,
            interval=0.05,
            what="the spread placement label to apply once the API server returned",
            explain=lambda: f"the policy is {service.policy()}",
        )
        assert service.policy().placement is Placement.SPREAD and agent.reachable
        assert labels(server)["aliyun.accelerator/nvidia_count"] == "1"
    finally:
        stop.set()
        agent.join(2)


def test_no_credentials_runs_on_config_and_initial_policy_reads_labels(served):
    server, api, service = served
    agent = NodeLabels(None, "node-1", service, CONFIGURED, CARD, unavailable="no credentials")
    assert not agent.sync() and not agent.reachable
    labels(server).update({"ack.node.gpu.schedule": "share", "ack.node.gpu.placement": "spread"})
    started = initial_policy(api, "node-1", CONFIGURED)
    assert (started.mode, started.placement) == (NodeMode.SHARE, Placement.SPREAD)
    assert initial_policy(None, "node-1", CONFIGURED) == CONFIGURED
