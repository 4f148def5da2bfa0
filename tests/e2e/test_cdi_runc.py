"""A CDI device from `cgpuctl cdi generate` under plain runc (no cgpu
shim): its containerEdits are applied to the bundle the way a CDI-aware
engine applies them (pkg/cdi ContainerEdits.Apply: env and mounts appended,
mounts ordered parents first, hooks appended to their stage), and the
container gets the instance's limit; the instance survives it, reserved."""

from __future__ import annotations

import json


from cgpud.node.model import GIB
from tests.harness.daemon import Daemon
from tests.harness.oci import Bundle, Host, run
from tests.harness.cdi import apply_cdi
from tests.harness.workload import BURN, burn_json


def test_a_cdi_device_gives_plain_runc_its_limit_and_outlives_the_container(
    tmp_path, host: Host, cgpud: Daemon
) -> None:
    created = cgpud.cgpuctl("create", "--mem", "2GiB", "--name", "e2e-cdi")
    assert created.returncode == 0, created.stderr
    iid = created.stdout.strip()
    spec_file = tmp_path / "cdi" / "cgpu.json"
    spec_file.parent.mkdir()
    out = cgpud.cgpuctl("cdi", "generate", "--output", str(spec_file))
    assert out.returncode == 0, out.stderr
    [device] = json.loads(spec_file.read_text())["devices"]
    assert device["name"] == iid

    for n in range(2):  # a second container gets the same instance back
        b = host.bundle(tmp_path / f"b{n}", ["sh", "-c", f"echo MEM=$ALIYUN_COM_GPU_MEM_CONTAINER; {BURN}"])
        b = Bundle(b.path, apply_cdi(b.spec, device)).write()
        ran = run(host, b, host.new_id(), shim=False)
        assert ran.returncode == 0, ran.stderr
        assert "MEM=2" in ran.stdout.splitlines()
        burn = burn_json(ran.stdout)
        assert burn["mem_total_reported"] == 2 * GIB and burn["alloc"]["until_fail_bytes"] == 2 * GIB
        listed = json.loads(cgpud.cgpuctl("list", "--output", "json").stdout)
        assert [(i["id"], i["state"], i["owner"]["kind"]) for i in listed] == [(iid, "reserved", "device")]

    assert cgpud.cgpuctl("release", iid).returncode == 0
    assert json.loads(cgpud.cgpuctl("list", "--output", "json").stdout) == []
