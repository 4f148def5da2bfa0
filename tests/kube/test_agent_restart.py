"""A restart of cgpud (kill -9) or of the kubelet loses nothing and grants
nothing twice: cgpud as a real process with orchestrator=kubernetes on the
simulated GPUs, the test playing the kubelet (Registration, Allocate, the
pod-resources API) and the API server."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest

from tests.harness.daemon import Daemon, make_daemon
from tests.harness.api_server import api_server, assumed, node_json, pod_json
from tests.harness.kubelet_pods import kubelet_pods
from tests.harness.kubelet import Kubelet, allocate, cgpud_kube_args, first_device_ids
from tests.harness.wait import until

NODE = "node-r"
WAIT = 20.0


def _listed(cgpud: Daemon) -> list[tuple[str, str, str]]:
    out = cgpud.cgpuctl("list", "--output", "json")
    assert out.returncode == 0, out.stderr
    return [(i["id"], i["owner"]["kind"], i["state"]) for i in json.loads(out.stdout)]


def test_restarts_of_cgpud_and_the_kubelet_keep_the_pod_instance_and_grant_nothing_twice(tmp_path, sim_env):
    plugins = Path(tempfile.mkdtemp(prefix="rs-dp-", dir="/tmp"))
    kubelet = Kubelet(plugins).start()
    try:
        with api_server(tmp_path) as (server, kubeconfig), kubelet_pods() as (kubelet_api, pod_resources):
            server.state.nodes[NODE] = node_json(NODE, {"ack.node.gpu.schedule": "cgpu"})
            server.state.add_pod(
                pod_json(
                    "train",
                    NODE,
                    containers={"main": {"aliyun.com/gpu-mem": 3}},
                    annotations=assumed(1, gpu_index=1),
                )
            )
            cgpud = make_daemon(
                tmp_path,
                sim_env,
                *cgpud_kube_args(plugins, pod_resources, kubeconfig, NODE, tmp_path / "cdi"),
            )
            cgpud.start()
            try:
                names = {r.resource_name: r.endpoint for r in kubelet.take_registrations(5)}
                mem = plugins / names["aliyun.com/gpu-mem"]
                ids = first_device_ids(mem, WAIT)[:3]
                first = allocate(mem, ids, WAIT)
                [(iid, kind, _)] = _listed(cgpud)
                assert kind == "pod" and first.cdi_devices[0].name == f"cgpu.io/gpu={iid}"
                kubelet_api.hold("default", "train", "main", "aliyun.com/gpu-mem", tuple(ids))

                cgpud.kill()  # kill -9 mid-life
                cgpud.start()
                assert [i[0] for i in _listed(cgpud)] == [iid]  # nothing lost
                kubelet.take_registrations(5)  # it registers again with the running kubelet

                kubelet.restart()  # the kubelet's own restart: sockets deleted, a new kubelet.sock
                kubelet.take_registrations(5)
                assert [i[0] for i in _listed(cgpud)] == [iid]
                # The pod is assigned: another Allocate of that size finds no pod and makes nothing.
                with pytest.raises(grpc.RpcError, match="no pod on node node-r is assumed for 3 GiB"):
                    allocate(mem, ids, WAIT)
                assert [i[0] for i in _listed(cgpud)] == [iid]

                server.state.delete_pod("default", "train")
                kubelet_api.forget("default", "train")
                until(lambda: _listed(cgpud) == [], WAIT, interval=0.2, what="the deleted pod's instance released")
            finally:
                cgpud.stop()
    finally:
        kubelet.stop()
        shutil.rmtree(plugins, ignore_errors=True)
