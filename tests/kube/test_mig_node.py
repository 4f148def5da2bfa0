"""cgpud as a real process on a simulated machine with a GPU in MIG mode,
orchestrator kubernetes and mig_strategy mixed: what it registers with the
kubelet, what each resource lists, the Node's labels, and an Allocate of a
MIG device; the test plays the kubelet and the API server."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tests.harness.api_server import api_server, node_json
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
