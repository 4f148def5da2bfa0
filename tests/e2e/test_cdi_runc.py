"""A CDI device from `cgpuctl cdi generate` under plain runc (no cgpu
shim): its containerEdits are applied to the bundle the way a CDI-aware
engine applies them (pkg/cdi ContainerEdits.Apply: env and mounts appended,
mounts ordered parents first, hooks appended to their stage), and the
container gets the instance's limit; the instance survives it, reserved."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cgpud.node.model import GIB
from tests.harness.daemon import Daemon
from tests.harness.oci import Bundle, Host, run

BURN = "cgpu-burn --alloc-until-fail 512MiB"


def apply_cdi(spec: dict[str, Any], device: dict[str, Any]) -> dict[str, Any]:
    edits = device["containerEdits"]
    spec["process"]["env"] = spec["process"].get("env", []) + edits.get("env", [])
    mounts = spec.get("mounts", []) + [
        {"destination": m["containerPath"], "source": m["hostPath"], "type": m.get("type", ""),
         "options": m.get("options", [])} for m in edits.get("mounts", [])]
    # CDI keeps the order of equals and puts shallower targets first.
    spec["mounts"] = sorted(mounts, key=lambda m: len(Path(m["destination"]).parts))
    hooks = spec.setdefault("hooks", {})
    for h in edits.get("hooks", []):
        hooks.setdefault(h["hookName"], []).append({k: h[k] for k in ("path", "args", "env", "timeout") if k in h})
    return spec


def burn_json(stdout: str) -> dict:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith('{"device"')))


def test_a_cdi_device_gives_plain_runc_its_limit_and_outlives_the_container(tmp_path, host: Host,
                                                                           cgpud: Daemon) -> None:
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
