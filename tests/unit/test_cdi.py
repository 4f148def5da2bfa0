"""The CDI spec of device instances: the pure spec builder checked against
the CDI spec's own field names and validation rules, the daemon side over a
real SQLite store and real regions, and the atomic spec file write.

Field names and rules are those of cncf-tags/container-device-interface:
specs-go/config.go (types and JSON names), schema/defs.json, SPEC.md
("at least one entry must be specified" in devices), pkg/cdi/spec.go
("invalid spec, no devices") and specs-go/version.go (minimum versions)."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from cgpud import atomicfile
from cgpud.node.model import GIB, GpuCapacity, Grant, Instance, InstanceState, NodeMode, NodePolicy, Owner, OwnerKind
from cgpud.node.model import Request
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from cgpud.errors import CgpuError, StateError, UsageError
from cgpud.containers import cdi
from cgpud.containers.edits import CONTAINER_LIBRARY, HOOK_ENV, HOOK_TIMEOUT, PRELOAD, ContainerEdits, Hook, Mount
from cgpud.containers.edits import RuntimeFiles, instance_edits
from cgpud.containers.request import CONTAINER_REGION
from tests.harness.lifecycle import INSTALLED_FILES as FILES, INSTALLED_REGIONS as REGIONS

GPU_MEMORY = {0: 16 * GIB, 1: 16 * GIB}
GPUS = (GpuCapacity(0, "GPU-aaaa", 16 * GIB), GpuCapacity(1, "GPU-bbbb", 16 * GIB))

# Every JSON name the CDI types define (specs-go/config.go); loaders refuse others.
SPEC_FIELDS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
DEVICE_FIELDS = {"name", "annotations", "containerEdits"}
EDITS_FIELDS = {"env", "deviceNodes", "hooks", "mounts", "intelRdt", "additionalGids", "netDevices"}
MOUNT_FIELDS = {"hostPath", "containerPath", "options", "type"}
HOOK_FIELDS = {"hookName", "path", "args", "env", "timeout"}
OCI_HOOKS = {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
# pkg/cdi parser: vendor is a DNS-like name, class and device names
# alphanumeric at both ends with - _ . (and : for names) between.
KIND_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?/[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


def instance(iid: str, *grants: Grant, enforced: bool = True, kind: OwnerKind = OwnerKind.DEVICE) -> Instance:
    return Instance(
        iid, Owner(kind, f"dev-{iid}"), grants or (Grant(0, "GPU-aaaa", 4 * GIB, 0),), InstanceState.RESERVED, enforced
    )


def edits_of(inst: Instance) -> ContainerEdits:
    return instance_edits(inst, REGIONS / inst.id, GPU_MEMORY, FILES)


def check_cdi_rules(spec: dict[str, Any]) -> None:
    """What a CDI loader checks, as far as our spec can touch it."""
    assert set(spec) <= SPEC_FIELDS and {"cdiVersion", "kind", "devices"} <= set(spec)
    assert KIND_RE.match(spec["kind"])
    assert spec["devices"], "a spec without devices is invalid"
    names = [d["name"] for d in spec["devices"]]
    assert len(set(names)) == len(names)
    for d in spec["devices"]:
        assert set(d) <= DEVICE_FIELDS and {"name", "containerEdits"} <= set(d)
        assert NAME_RE.match(d["name"]) and d["name"][0].isalpha()  # a digit first needs 0.5.0
        edits = d["containerEdits"]
        assert edits and set(edits) <= EDITS_FIELDS  # empty device edits are invalid too
        assert all("=" in e for e in edits.get("env", []))
        for m in edits.get("mounts", []):
            assert set(m) <= MOUNT_FIELDS and os.path.isabs(m["hostPath"]) and os.path.isabs(m["containerPath"])
            assert all(isinstance(o, str) for o in m["options"])
        for h in edits.get("hooks", []):
            assert set(h) <= HOOK_FIELDS and h["hookName"] in OCI_HOOKS and os.path.isabs(h["path"])
            assert isinstance(h["timeout"], int) and h["timeout"] > 0
            assert all("=" in e for e in h["env"])
    # Mount `type` needs 0.4.0; nothing we write needs more than that.
    assert tuple(int(x) for x in spec["cdiVersion"].split(".")) >= (0, 4, 0)


def test_one_device_per_instance_named_by_its_id():
    spec = cdi.cdi_spec([edits_of(instance("cgpu-aaaaaaaaaaaa")), edits_of(instance("cgpu-bbbbbbbbbbbb"))])
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == "cgpu.io/gpu"
    assert [d["name"] for d in spec["devices"]] == ["cgpu-aaaaaaaaaaaa", "cgpu-bbbbbbbbbbbb"]
    check_cdi_rules(spec)
    json.dumps(spec)  # plain JSON types only


def test_edits_are_carried_exactly():
    e = edits_of(instance("cgpu-aaaaaaaaaaaa", Grant(0, "GPU-aaaa", 4 * GIB, 30), Grant(1, "GPU-bbbb", 4 * GIB, 30)))
    [d] = cdi.cdi_spec([e])["devices"]
    ce = d["containerEdits"]
    assert ce["env"] == [f"{k}={v}" for k, v in e.env]
    assert "ALIYUN_COM_GPU_MEM_IDX=0,1" in ce["env"] and "NVIDIA_VISIBLE_DEVICES=GPU-aaaa,GPU-bbbb" in ce["env"]
    assert ce["mounts"] == [
        {"hostPath": m.source, "containerPath": m.destination, "type": "bind", "options": m.options} for m in e.mounts
    ]
    by_target = {m["containerPath"]: m for m in ce["mounts"]}
    assert by_target[CONTAINER_REGION]["hostPath"] == str(REGIONS / "cgpu-aaaaaaaaaaaa")
    assert "ro" in by_target[CONTAINER_REGION]["options"] and "rbind" in by_target[CONTAINER_REGION]["options"]
    assert by_target[f"{CONTAINER_REGION}/usage"]["options"][1] == "rw"
    assert by_target[CONTAINER_LIBRARY]["hostPath"] == str(FILES.library)
    assert "noexec" not in by_target[CONTAINER_LIBRARY]["options"]
    assert by_target[PRELOAD]["hostPath"] == str(FILES.preload)
    assert ce["hooks"] == [
        {
            "hookName": stage,
            "path": str(FILES.hook),
            "args": ["cgpu-hook", "--socket", str(FILES.relay_socket), "--instance", "cgpu-aaaaaaaaaaaa", stage],
            "env": list(HOOK_ENV),
            "timeout": HOOK_TIMEOUT,
        }
        for stage in ("createRuntime",)  # no poststop: cgpud sees the init exit itself
    ]


def test_hook_env_and_timeout_come_from_the_edits():
    e = ContainerEdits(
        (("A", "1"),),
        (Mount("/h/src", "/c/dst", read_only=True),),
        (Hook("createRuntime", "/h/hook", ("hook", "x"), env=("PATH=/x", "K=V"), timeout=3),),
        "cgpu-cccccccccccc",
    )
    [d] = cdi.cdi_spec([e])["devices"]
    assert d == {
        "name": "cgpu-cccccccccccc",
        "containerEdits": {
            "env": ["A=1"],
            "mounts": [
                {
                    "hostPath": "/h/src",
                    "containerPath": "/c/dst",
                    "type": "bind",
                    "options": ["rbind", "ro", "nosuid", "nodev", "noexec"],
                }
            ],
            "hooks": [
                {
                    "hookName": "createRuntime",
                    "path": "/h/hook",
                    "args": ["hook", "x"],
                    "env": ["PATH=/x", "K=V"],
                    "timeout": 3,
                }
            ],
        },
    }


def test_a_share_mode_instance_has_env_and_hooks_but_no_mounts():
    [d] = cdi.cdi_spec([edits_of(instance("cgpu-dddddddddddd", enforced=False))])["devices"]
    assert "mounts" not in d["containerEdits"]
    assert d["containerEdits"]["env"] and len(d["containerEdits"]["hooks"]) == 1


def test_no_devices_is_refused_not_written_invalid():
    with pytest.raises(StateError, match="cgpuctl create"):
        cdi.cdi_spec([])


# ---- the daemon side: real store, real regions ----------------------------------------------


def service(tmp_path: Path, mode: NodeMode = NodeMode.CGPU) -> InstanceService:
    return InstanceService(
        Store(tmp_path / "db" / "cgpud.db"), GPUS, NodePolicy(mode=mode), tmp_path / "regions", "580.65.06", "boot-1"
    )


def test_render_lists_only_active_device_instances(tmp_path):
    svc = service(tmp_path)
    files = RuntimeFiles(
        tmp_path / "rt" / "libcgpu.so",
        tmp_path / "rt" / "ld.so.preload",
        tmp_path / "rt" / "hook",
        tmp_path / "relay.sock",
    )
    with pytest.raises(StateError, match="no device instances"):
        cdi.render(svc, files)
    a = svc.create(Request(Owner(OwnerKind.DEVICE, "a"), 4 * GIB))
    svc.create(Request(Owner(OwnerKind.CONTAINER, "c1"), 2 * GIB))
    svc.create(Request(Owner(OwnerKind.PROCESS, "p1"), 2 * GIB))
    gone = svc.create(Request(Owner(OwnerKind.DEVICE, "gone"), GIB))
    svc.release(gone.id)
    spec = json.loads(cdi.render(svc, files))
    check_cdi_rules(spec)
    [d] = spec["devices"]
    assert d["name"] == a.id
    assert {m["containerPath"]: m["hostPath"] for m in d["containerEdits"]["mounts"]}[CONTAINER_REGION] == str(
        svc.region_dir(a.id)
    )
    assert "ALIYUN_COM_GPU_MEM_DEV=16" in d["containerEdits"]["env"]


def test_a_device_instance_is_never_swept_but_a_dead_container_hands_it_back(tmp_path):
    svc = service(tmp_path)
    inst = svc.create(Request(Owner(OwnerKind.DEVICE, "a"), GIB))
    svc.bind_container(inst.id, "ctr-1", 2**22 + 12345)  # a PID that does not run
    assert svc.sweep() == 0
    back = svc.get(inst.id)
    assert back.state is InstanceState.RESERVED and back.pids == ()
    # ...so the next container of the pod can bind it.
    assert svc.bind_container(inst.id, "ctr-2", os.getpid()).state is InstanceState.BOUND
    assert svc.sweep() == 0 and svc.get(inst.id).state is InstanceState.BOUND


def test_the_api_without_a_provider_says_so_and_with_one_serves_it(tmp_path):
    from cgpud.api.server import serve
    from cgpud.cli.client import LocalClient

    svc = service(tmp_path)
    for provider, sock in ((None, "a.sock"), (lambda: '{"kind": "x"}', "b.sock")):
        server = serve(svc, tmp_path / "run" / sock, cdi_spec=provider)
        try:
            with LocalClient(tmp_path / "run" / sock) as client:
                if provider is None:
                    with pytest.raises(StateError, match="without container support"):
                        client.cdi_spec()
                else:
                    assert client.cdi_spec() == '{"kind": "x"}'
        finally:
            server.stop(None)


# ---- the spec file ------------------------------------------------------------------------


def test_write_spec_is_atomic_0644_and_replaces(tmp_path):
    target = tmp_path / "cgpu.json"
    target.write_text("old")
    os.chmod(target, 0o600)
    cdi.write_spec('{"new": 1}\n', cdi.check_output(target))
    assert target.read_text() == '{"new": 1}\n'
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["cgpu.json"]  # no temp file left


def test_output_path_must_be_a_file_in_an_existing_directory(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        cdi.check_output(tmp_path / "nope" / "cgpu.json")
    with pytest.raises(UsageError, match="is a directory"):
        cdi.check_output(tmp_path)


def test_a_failed_write_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    def refuse(src: str, dst: str) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(atomicfile.os, "replace", refuse)
    with pytest.raises(CgpuError, match=f"cannot write {tmp_path}/cgpu.json: Read-only file system$"):
        cdi.write_spec("{}", tmp_path / "cgpu.json")
    assert list(tmp_path.iterdir()) == []
