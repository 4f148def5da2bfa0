"""Kubernetes end to end on the simulated GPU: cgpud runs with
orchestrator=kubernetes; the test plays the kubelet (Registration on
kubelet.sock, then Allocate over the plugin's socket, the kubelet's
pod-resources API) and the API server (tests/harness/api_server.py). The
Allocate answer's CDI device is looked up in the spec cgpud wrote, its edits
are applied to a runc bundle the way a CDI-aware runtime applies them, and
plain runc (no cgpu shim) starts the container: it sees exactly its GiB in
the driver's view (cuMemGetInfo, allocations until failure) and in NVML's.
Deleting the pod releases the instance within a sweep."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.node.model import GIB
from tests.harness.daemon import Daemon, running_daemon
from tests.harness.oci import Bundle, Host, run
from tests.harness.cdi import apply_cdi
from tests.harness.workload import BURN, burn_json
from tests.harness.api_server import ApiServerProcess, api_server, assumed, node_json, pod_json
from tests.harness.kubelet_pods import kubelet_pods
from tests.harness.kubelet import Kubelet, allocate, cgpud_kube_args, first_device_ids
from tests.harness.wait import until


NODE = "node-e2e"
WAIT = 20.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ApiServerProcess, Path]]:
    with api_server(tmp_path) as (server, kubeconfig):
        server.state.nodes[NODE] = node_json(NODE, {"ack.node.gpu.schedule": "cgpu"})
        yield server, kubeconfig


def _list(cgpud: Daemon) -> list[dict]:
    out = cgpud.cgpuctl("list", "--output", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_allocate_cdi_runc_sees_its_gib_and_the_pod_delete_releases_it(
    tmp_path: Path, host: Host, gpu_env: dict, cluster, nvml_total: Path
) -> None:
    server, kubeconfig = cluster
    pod = server.state.add_pod(
        pod_json(
            "train",
            NODE,
            containers={"main": {"aliyun.com/gpu-mem": 2}},
            annotations=assumed(1, gpu_index=0),
        )
    )
    cdi_dir = tmp_path / "cdi"
    import tempfile

    plugins = Path(tempfile.mkdtemp(prefix="e2e-dp-", dir="/tmp"))
    kubelet = Kubelet(plugins).start()
    try:
        with (
            kubelet_pods() as (kubelet_api, pod_resources),
            running_daemon(
                tmp_path,
                gpu_env,
                *cgpud_kube_args(plugins, pod_resources, kubeconfig, NODE, cdi_dir),
            ) as cgpud,
        ):
            names = {r.resource_name: r.endpoint for r in kubelet.take_registrations(5)}
            mem_plugin = plugins / names["aliyun.com/gpu-mem"]
            devices = first_device_ids(mem_plugin, WAIT)
            assert len(devices) == 16  # one per GiB of the 16 GiB GPU
            answer = allocate(mem_plugin, devices[:2], WAIT)
            [cdi_name] = [d.name for d in answer.cdi_devices]
            iid = cdi_name.removeprefix("cgpu.io/gpu=")
            assert answer.envs["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2"
            assert (
                server.state.pod("default", "train")["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true"
            )
            assert [(i["id"], i["owner"]["kind"]) for i in _list(cgpud)] == [(iid, "pod")]

            spec = json.loads((cdi_dir / f"cgpu-pod-{iid}.json").read_text())
            [device] = [d for d in spec["devices"] if f"{spec['kind']}={d['name']}" == cdi_name]
            b = host.bundle(
                tmp_path / "b0", ["sh", "-c", f"echo MEM=$ALIYUN_COM_GPU_MEM_CONTAINER; /nvml_total; {BURN}"]
            )
            (b.rootfs / "nvml_total").write_bytes(nvml_total.read_bytes())
            (b.rootfs / "nvml_total").chmod(0o755)
            b = Bundle(b.path, apply_cdi(b.spec, device)).write()
            ran = run(host, b, host.new_id(), shim=False)
            assert ran.returncode == 0, ran.stderr
            assert "MEM=2" in ran.stdout.splitlines()
            assert f"NVML_TOTAL={2 * GIB}" in ran.stdout.splitlines()
            burn = burn_json(ran.stdout)
            assert burn["mem_total_reported"] == 2 * GIB and burn["alloc"]["until_fail_bytes"] == 2 * GIB

            # The pod goes: the API server and the kubelet both stop listing it.
            kubelet_api.hold("default", "train", "main", "aliyun.com/gpu-mem", tuple(devices[:2]))
            server.state.delete_pod("default", "train")
            kubelet_api.forget("default", "train")
            until(lambda: _list(cgpud) == [], WAIT, interval=0.2, what="the deleted pod's instance released")
            assert not (cdi_dir / f"cgpu-pod-{iid}.json").exists()
            assert pod["metadata"]["uid"]
    finally:
        kubelet.stop()
