"""cgpuctl create / release / cdi generate against a real cgpud process on
the simulated GPUs: a reserved device instance becomes a CDI device whose
edits name the daemon's own region and runtime files."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from cgpud.node.model import GIB
from cgpud import __version__
from cgpud.containers.edits import CONTAINER_LIBRARY, PRELOAD
from cgpud.containers.runtime_files import version_dir_name
from cgpud.containers.request import CONTAINER_REGION


def listed(daemon) -> str:
    out = daemon.cgpuctl("list", "--all", "--output", "json")
    assert out.returncode == 0, out.stderr
    return out.stdout


def create(daemon, *args: str) -> dict:
    out = daemon.cgpuctl("create", *args, "--output", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_create_generate_release(daemon, tmp_path):
    inst = create(daemon, "--mem", "2GiB")
    iid = inst["id"]
    assert inst["state"] == "reserved" and inst["owner"]["kind"] == "device"
    assert inst["owner"]["id"].startswith("cgpuctl-")
    assert [g["memory_bytes"] for g in inst["grants"]] == [2 * GIB]

    target = tmp_path / "cdi" / "cgpu.json"
    target.parent.mkdir()
    out = daemon.cgpuctl("cdi", "generate", "--output", str(target))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"wrote {target}"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    spec = json.loads(target.read_text())
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == "cgpu.io/gpu"
    [device] = spec["devices"]
    assert device["name"] == iid
    edits = device["containerEdits"]
    mounts = {m["containerPath"]: m for m in edits["mounts"]}
    runtime = daemon.state / "runtime" / version_dir_name(__version__)  # this cgpud's own copy
    assert mounts[CONTAINER_REGION]["hostPath"] == str(daemon.state / "instances" / iid)
    assert (daemon.state / "instances" / iid).is_dir()
    assert mounts[CONTAINER_LIBRARY]["hostPath"] == str(runtime / "libcgpu.so")
    assert mounts[PRELOAD]["hostPath"] == str(runtime / "ld.so.preload")
    assert all(Path(m["hostPath"]).exists() for m in edits["mounts"])
    assert [h["hookName"] for h in edits["hooks"]] == ["createRuntime"]
    for hook in edits["hooks"]:
        assert hook["path"] == str(runtime / "cgpu-hook") and Path(hook["path"]).exists()
        assert hook["args"][hook["args"].index("--instance") + 1] == iid
        assert hook["args"][hook["args"].index("--socket") + 1] == str(daemon.relay)
    assert "ALIYUN_COM_GPU_MEM_CONTAINER=2" in edits["env"]

    printed = daemon.cgpuctl("cdi", "generate")
    assert printed.returncode == 0 and json.loads(printed.stdout) == spec
    assert printed.stdout.startswith('{\n  "cdiVersion"')  # indent 2

    out = daemon.cgpuctl("release", iid)
    assert out.returncode == 0 and out.stdout.strip() == f"released {iid}"
    gone = daemon.cgpuctl("cdi", "generate")
    assert gone.returncode != 0 and iid not in gone.stdout
    assert gone.stderr.count("\n") == 1 and "cgpuctl create" in gone.stderr, gone.stderr


def test_create_is_idempotent_per_name_and_text_prints_the_id(daemon):
    first = daemon.cgpuctl("create", "--mem", "1GiB", "--name", "train-a")
    again = daemon.cgpuctl("create", "--mem", "1GiB", "--name", "train-a")
    assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
    assert first.stdout == again.stdout and first.stdout.strip().startswith("cgpu-")
    other = create(daemon, "--mem", "1", "--name", "train-b", "--weight", "3", "--high-priority")
    assert other["id"] != first.stdout.strip() and other["owner"] == {"kind": "device", "id": "train-b"}
    spec = json.loads(daemon.cgpuctl("cdi", "generate").stdout)
    assert [d["name"] for d in spec["devices"]] == [first.stdout.strip(), other["id"]]
    changed = daemon.cgpuctl("create", "--mem", "2GiB", "--name", "train-a")
    assert changed.returncode != 0 and "already holds instance" in changed.stderr


def test_only_device_instances_become_cdi_devices(daemon):
    inst = create(daemon, "--mem", "1GiB")
    run = daemon.cgpuctl("run", "--mem", "1GiB", "--", "cgpuctl", "--socket", str(daemon.socket), "cdi", "generate")
    assert run.returncode == 0, run.stderr
    assert [d["name"] for d in json.loads(run.stdout)["devices"]] == [inst["id"]]


BAD = [
    (["create", "--mem", "0"], "ask for a memory size per GPU"),
    (["create", "--mem", "lots"], "bad memory size 'lots'"),
    (["create", "--mem", "17GiB"], "17 GiB"),
    (["create", "--mem", "1GiB", "--gpus", "3"], "3 GPUs"),
    (["create", "--mem", "1GiB", "--weight", "0"], "weight 0"),
    (["release", "cgpu-000000000000"], "cgpu-000000000000"),
    (["cdi", "generate", "--output", "/nonexistent/dir/x.json"], "directory /nonexistent/dir does not exist"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(b[0][:3]) for b in BAD])
def test_bad_arguments_get_one_line_and_change_nothing(daemon, args, message):
    before = listed(daemon)
    out = daemon.cgpuctl(*args)
    assert out.returncode != 0
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert listed(daemon) == before
    assert not Path("/nonexistent").exists()


def test_generate_with_nothing_reserved_says_how_to_reserve(daemon, tmp_path):
    target = tmp_path / "cgpu.json"
    out = daemon.cgpuctl("cdi", "generate", "--output", str(target))
    assert out.returncode != 0 and out.stderr.count("\n") == 1
    assert "no device instances" in out.stderr and "cgpuctl create --mem" in out.stderr
    assert not target.exists()  # no invalid spec left for runtimes to trip on
