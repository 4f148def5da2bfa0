"""GPU containers under real runc through cgpu-runtime and cgpu-hook, with
a real cgpud: the limit is real inside, the instance lives exactly as long
as the container, and containers that ask for nothing are untouched."""

from __future__ import annotations

import json
import os

import pytest

from cgpud.cli.client import LocalClient
from cgpud.node.model import GIB, Owner, OwnerKind, Request
from tests.harness.daemon import Daemon, running_daemon
from tests.harness.oci import Host, run, runc, shim_container
from tests.harness.workload import BURN, assert_2gib_granted, burn_json, env_lines, instances


def test_2gib_container_sees_2gib_and_fails_past_it(tmp_path, host: Host, cgpud: Daemon) -> None:
    b = host.bundle(tmp_path / "b", ["sh", "-c", f"env; {BURN}"], ("ALIYUN_COM_GPU_MEM_CONTAINER=2",))
    out = run(host, b, host.new_id(), shim=True, relay=cgpud.relay)
    assert out.returncode == 0, out.stderr
    assert_2gib_granted(out.stdout)
    # Released at poststop: nothing active remains.
    assert instances(cgpud) == []
    [gone] = instances(cgpud, all_=True)
    assert gone["state"] == "released"


def test_inspect_shows_the_instance_while_the_container_runs(tmp_path, host: Host, cgpud: Daemon) -> None:
    b = host.bundle(tmp_path / "b", ["sleep", "60"], ("ALIYUN_COM_GPU_MEM_CONTAINER=3",))
    cid = host.new_id()
    with shim_container(host, b, cid, cgpud.relay):
        [inst] = instances(cgpud)
        assert inst["state"] == "bound"
        assert inst["owner"]["id"] == f"{cid}@{b.path}"  # (engine namespace: the bundle, id)
        state = json.loads(runc(host, "state", cid).stdout)
        assert inst["pids"] == [state["pid"]]
        shown = cgpud.cgpuctl("inspect", "-d")
        assert cid in shown.stdout and "3" in shown.stdout, shown.stdout
    assert instances(cgpud) == []
    assert cid not in cgpud.cgpuctl("inspect", "-d").stdout


def test_a_non_gpu_container_runs_exactly_as_without_the_shim(tmp_path, host: Host, cgpud: Daemon) -> None:
    results = []
    for shim in (False, True):
        b = host.bundle(
            tmp_path / f"b{int(shim)}", ["sh", "-c", "env; cat /proc/self/mountinfo | wc -l; echo hi"], gpu_device=False
        )
        before = b.read()
        out = run(host, b, host.new_id(), shim=shim, relay=cgpud.relay)
        assert out.returncode == 0, out.stderr
        assert b.read() == before  # the spec was not rewritten
        results.append((out.stdout, out.stderr))
    assert results[0] == results[1]
    assert instances(cgpud, all_=True) == []


def test_cgpud_stopped_fails_gpu_containers_with_a_clear_message(tmp_path, host: Host, cgpud: Daemon) -> None:
    cgpud.stop()
    gpu = host.bundle(tmp_path / "b-gpu", ["true"], ("ALIYUN_COM_GPU_MEM_CONTAINER=1",))
    out = run(host, gpu, host.new_id(), shim=True, relay=cgpud.relay)
    assert out.returncode != 0
    # after waiting CGPU_RELAY_WAIT_S for it to come back, saying so
    assert f"cgpud is not running ({cgpud.relay}: " in out.stderr and "did not come back within" in out.stderr
    plain = host.bundle(tmp_path / "plain", ["echo", "still fine"], gpu_device=False)
    out = run(host, plain, host.new_id(), shim=True, relay=cgpud.relay)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "still fine"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (("ALIYUN_COM_GPU_MEM_CONTAINER=0",), "ALIYUN_COM_GPU_MEM_CONTAINER=0 is out of range"),
        (("ALIYUN_COM_GPU_MEM_CONTAINER=17",), "asked for 17 GiB per GPU but the largest GPU on this node has 16 GiB"),
        (("ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_CORE_PERCENTAGE=33"), "core_mem or mps node"),
        (("ALIYUN_COM_GPU_MEM_CONTAINER=lots",), "ALIYUN_COM_GPU_MEM_CONTAINER='lots' is not a whole number of GiB"),
    ],
)
def test_bad_requests_fail_the_start_and_leave_nothing(tmp_path, host: Host, cgpud: Daemon, env, message) -> None:
    b = host.bundle(tmp_path / "b", ["true"], env)
    before = b.read()
    out = run(host, b, host.new_id(), shim=True, relay=cgpud.relay)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert out.stderr.count("cgpu-runtime:") == 1
    assert b.read() == before
    assert instances(cgpud, all_=True) == []


def test_the_21st_instance_on_a_gpu_is_refused(tmp_path, host: Host, cgpud: Daemon) -> None:
    with LocalClient(cgpud.socket) as client:
        for i in range(20):
            client.create(Request(Owner(OwnerKind.PROCESS, f"holder-{i}"), 512 << 20), pid=os.getpid())
    b = host.bundle(tmp_path / "b", ["true"], ("ALIYUN_COM_GPU_MEM_CONTAINER=1",))
    out = run(host, b, host.new_id(), shim=True, relay=cgpud.relay)
    assert out.returncode != 0
    assert "max_instances_per_gpu" in out.stderr and "20 instances" in out.stderr, out.stderr
    assert len(instances(cgpud)) == 20


def test_33_percent_is_refused_on_a_core_mem_node(tmp_path, host: Host) -> None:
    with running_daemon(tmp_path, host.sim_env, "--mode", "core_mem") as d:
        b = host.bundle(
            tmp_path / "b", ["true"], ("ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_CORE_PERCENTAGE=33")
        )
        out = run(host, b, host.new_id(), shim=True, relay=d.relay)
        assert out.returncode != 0
        assert "asked for 33% compute: ask for 0 (no share) or a multiple of 5" in out.stderr, out.stderr
        assert instances(d, all_=True) == []
        # 30 % is fine, and the share reaches the container's env.
        b = host.bundle(
            tmp_path / "ok", ["env"], ("ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_CORE_PERCENTAGE=30")
        )
        out = run(host, b, host.new_id(), shim=True, relay=d.relay)
        assert out.returncode == 0, out.stderr
        assert env_lines(out.stdout)["ALIYUN_COM_GPU_CORE_PERCENTAGE"] == "30"


def test_share_mode_gives_env_but_no_library(tmp_path, host: Host) -> None:
    with running_daemon(tmp_path, host.sim_env, "--mode", "share") as d:
        b = host.bundle(
            tmp_path / "b", ["sh", "-c", f"env; ls /run /usr/local; {BURN}"], ("ALIYUN_COM_GPU_MEM_CONTAINER=2",)
        )
        out = run(host, b, host.new_id(), shim=True, relay=d.relay)
        assert out.returncode == 0, out.stderr
        assert env_lines(out.stdout)["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2"
        assert not [m for m in b.read()["mounts"] if m["destination"].startswith(("/run/cgpu", "/usr/local/cgpu"))]
        # Not enforced: the application sees the whole GPU and divides by DEV itself.
        assert burn_json(out.stdout)["mem_total_reported"] == 16 * GIB
        assert instances(d) == []


def test_kubernetes_mode_ignores_env_and_honours_the_device_plugin_channel(tmp_path, host: Host) -> None:
    with running_daemon(tmp_path, host.sim_env, "--orchestrator", "kubernetes") as d:
        # A pod spec's env is the pod author's: it asks for nothing here.
        b = host.bundle(tmp_path / "env", ["sh", "-c", BURN], ("ALIYUN_COM_GPU_MEM_CONTAINER=2",))
        out = run(host, b, host.new_id(), shim=True, relay=d.relay)
        assert out.returncode == 0, out.stderr
        assert burn_json(out.stdout)["mem_total_reported"] == 16 * GIB
        assert instances(d, all_=True) == []
        # The device plugin's answer: an instance reserved for the pod and
        # its directory mounted at /run/cgpu, which a pod spec cannot name.
        with LocalClient(d.socket) as client:
            reserved = client.create(Request(Owner(OwnerKind.POD, "pod-uid-1"), 2 * GIB))
        b = host.bundle(tmp_path / "claim", ["sh", "-c", BURN])
        b.spec["mounts"].append(
            {
                "destination": "/run/cgpu",
                "type": "bind",
                "source": str(d.state / "instances" / reserved.id),
                "options": ["rbind", "ro"],
            }
        )
        b.write()
        for _ in range(2):  # a restarted container gets the same instance back
            out = run(host, b, host.new_id(), shim=True, relay=d.relay)
            assert out.returncode == 0, out.stderr
            assert burn_json(out.stdout)["alloc"]["until_fail_bytes"] == 2 * GIB
            [inst] = instances(d)
            assert inst["id"] == reserved.id and inst["state"] == "reserved"
