"""cgpud as a real process on a simulated machine with a GPU in MIG mode,
orchestrator kubernetes: with mig_strategy mixed, what it registers with the
kubelet, what each resource lists, the Node's labels and an Allocate of a
MIG device; with mig_share, a pod's share on a MIG device. The test plays
the kubelet and the API server."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from tests.harness.api_server import api_server, assumed, node_json, pod_json
from tests.harness.daemon import make_daemon
from tests.harness.kubelet import Kubelet, allocate, cgpud_kube_args, first_device_ids
from tests.harness.kubelet_pods import kubelet_pods
from tests.harness.sim import sim_env_in
from tests.harness.wait import until

NODE = "node-m"
WAIT = 20.0


def test_a_cgpu_node_serves_its_mig_devices_by_profile_and_labels_them(tmp_path, native):
    env = sim_env_in(tmp_path / "sim", native, mem="80GiB", placements=["mig=3g.40gb,1g.10gb,1g.10gb"])
    plugins = Path(tempfile.mkdtemp(prefix="mig-dp-", dir="/tmp"))
    kubelet = Kubelet(plugins).start()
    try:
        with api_server(tmp_path) as (server, kubeconfig), kubelet_pods() as (_pods, pod_resources):
            server.state.nodes[NODE] = node_json(NODE, {"ack.node.gpu.schedule": "cgpu"})
            cgpud = make_daemon(
                tmp_path,
                env,
                *cgpud_kube_args(plugins, pod_resources, kubeconfig, NODE, tmp_path / "cdi"),
                "--mig-strategy",
                "mixed",
            )
            cgpud.start()
            try:
                names = {r.resource_name: r.endpoint for r in kubelet.take_registrations(5 + 2)}
                assert {"nvidia.com/mig-3g.40gb", "nvidia.com/mig-1g.10gb"} <= set(names)
                small = first_device_ids(plugins / names["nvidia.com/mig-1g.10gb"], WAIT)
                assert len(small) == 2 and all(d.startswith("MIG-") for d in small)
                # GPU 0 is in MIG mode: only GPU 1's 80 GiB are shared.
                mem = first_device_ids(plugins / names["aliyun.com/gpu-mem"], WAIT)
                assert len(mem) == 80 and {d.rpartition("-_-")[0] for d in mem} == {
                    "GPU-5c1a0000-0000-4000-8000-000000c90001"
                }
                got = allocate(plugins / names["nvidia.com/mig-1g.10gb"], small[1:], WAIT)
                assert got.envs["NVIDIA_VISIBLE_DEVICES"] == small[1]

                def labels() -> dict[str, str]:
                    with server.state.lock:
                        return dict(server.state.nodes[NODE]["metadata"].get("labels", {}))

                until(lambda: "nvidia.com/mig.strategy" in labels(), WAIT, interval=0.1, what="the MIG labels")
                got_labels = labels()
                assert got_labels["nvidia.com/mig.strategy"] == "mixed"
                assert got_labels["nvidia.com/mig.capable"] == "true"
                assert got_labels["nvidia.com/mig-1g.10gb.count"] == "2"
                assert got_labels["nvidia.com/mig-3g.40gb.memory"] == "40448"
            finally:
                cgpud.stop()
    finally:
        kubelet.stop()
        shutil.rmtree(plugins, ignore_errors=True)


def test_with_mig_share_a_pods_share_lands_on_a_mig_device(tmp_path, native):
    """mig_share on a cgpu node: each MIG device gives aliyun.com/gpu-mem
    devices of its own whole GiB, no MIG resource is registered, and a pod
    the scheduler put on a MIG device (its index) gets an instance there,
    named by its MIG UUID."""
    env = sim_env_in(tmp_path / "sim", native, mem="80GiB", placements=["mig=3g.40gb,1g.10gb"])
    plugins = Path(tempfile.mkdtemp(prefix="mig-dp-", dir="/tmp"))
    kubelet = Kubelet(plugins).start()
    try:
        with api_server(tmp_path) as (server, kubeconfig), kubelet_pods() as (_pods, pod_resources):
            server.state.nodes[NODE] = node_json(NODE, {"ack.node.gpu.schedule": "cgpu"})
            server.state.add_pod(
                pod_json(
                    "small", NODE, containers={"main": {"aliyun.com/gpu-mem": 3}}, annotations=assumed(1, gpu_index=3)
                )
            )
            cgpud = make_daemon(
                tmp_path,
                env,
                *cgpud_kube_args(plugins, pod_resources, kubeconfig, NODE, tmp_path / "cdi"),
                "--mig-strategy",
                "mixed",
                "--mig-share",
                "true",
            )
            cgpud.start()
            try:
                names = {r.resource_name: r.endpoint for r in kubelet.take_registrations(5)}
                assert not any(n.startswith("nvidia.com/mig-") for n in names)
                mem = first_device_ids(plugins / names["aliyun.com/gpu-mem"], WAIT)
                by_device: dict[str, int] = {}
                for d in mem:
                    by_device[d.rpartition("-_-")[0]] = by_device.get(d.rpartition("-_-")[0], 0) + 1
                # GPU 1 whole (80), the 3g.40gb (39 whole GiB of 40448 MiB), the 1g.10gb (9).
                assert sorted(by_device.values()) == [9, 39, 80] and len(by_device) == 3
                small = [u for u, n in by_device.items() if n == 9]
                got = allocate(plugins / names["aliyun.com/gpu-mem"], [f"{small[0]}-_-{j}" for j in range(3)], WAIT)
                assert got.envs["NVIDIA_VISIBLE_DEVICES"] == small[0]
                listed = json.loads(cgpud.cgpuctl("list", "--output", "json").stdout)
                [grant] = listed[0]["grants"]
                assert (grant["gpu"], grant["uuid"], grant["memory_bytes"]) == (3, small[0], 3 << 30)
            finally:
                cgpud.stop()
    finally:
        kubelet.stop()
        shutil.rmtree(plugins, ignore_errors=True)
