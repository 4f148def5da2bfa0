"""Versioned runtime files (cgpud/containers/runtime_files.py): each cgpud
version installs its own <state_dir>/runtime/<version>/, and an old version's
files go only once no active instance's edits name them. The decision is a
pure function; the rest runs over a real store, service and directory."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

import cgpud
from cgpud.containers import cdi, runtime_files
from cgpud.containers.edits import RuntimeFiles, apply_edits, instance_edits
from cgpud.containers.runtime_files import collect, install_runtime_files, installed_versions, unused_versions
from cgpud.containers.runtime_files import version_dir_name
from cgpud.node.model import GIB, GpuCapacity, NodeMode, NodePolicy, Owner, OwnerKind, Request
from cgpud.node.service import InstanceService
from cgpud.node.store import LEGACY_RUNTIME, Store

GPUS = (GpuCapacity(0, "GPU-aaaa", 16 * GIB),)


@pytest.mark.parametrize(
    ("version", "name"),
    [
        ("0.1.0", "0.1.0"),
        ("1.2.3+local.4", "1.2.3+local.4"),
        ("0.2.0.dev1-g1a2b3c", "0.2.0.dev1-g1a2b3c"),
        ("../../etc", "v.._.._etc"),
        ("..", "v.."),
        ("a/b c", "a_b_c"),
        ("", "v"),
    ],
)
def test_a_version_becomes_one_safe_path_component(version, name):
    assert version_dir_name(version) == name
    assert "/" not in name and name not in ("", ".", "..") and not name.startswith(".")


@pytest.mark.parametrize(
    ("installed", "in_use", "current", "doomed"),
    [
        ({"0.1.0"}, set(), "0.1.0", set()),  # the current version always stays
        ({"0.1.0", "0.2.0"}, set(), "0.2.0", {"0.1.0"}),
        ({"0.1.0", "0.2.0"}, {"0.1.0"}, "0.2.0", set()),  # an active instance names it
        ({"0.1.0", "0.2.0", "0.3.0"}, {"0.2.0"}, "0.3.0", {"0.1.0"}),
        ({LEGACY_RUNTIME, "0.2.0"}, {LEGACY_RUNTIME}, "0.2.0", set()),  # pre-versioning files in use
        ({LEGACY_RUNTIME, "0.2.0"}, {"0.2.0"}, "0.2.0", {LEGACY_RUNTIME}),
        ({"0.2.0"}, {"0.1.0"}, "0.2.0", set()),  # in use but already gone: nothing to do
        ({"0.1.0", "0.2.0"}, set(), "0.1.0", {"0.2.0"}),  # a downgrade removes the newer, unused one
    ],
)
def test_gc_decision(installed, in_use, current, doomed):
    assert unused_versions(installed, in_use, current) == doomed


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    return path


def service(state: Path) -> InstanceService:
    return InstanceService(
        Store(state / "cgpud.db"), GPUS, NodePolicy(mode=NodeMode.CGPU), state / "instances", "580.65.06", "boot-1"
    )


def test_each_version_installs_its_own_directory_and_leaves_the_other(state, monkeypatch):
    monkeypatch.setattr(cgpud, "__version__", "0.1.0")
    old = install_runtime_files(state, Path("/run/cgpud/relay.sock"))
    assert old.version == "0.1.0" and old.library == state / "runtime" / "0.1.0" / "libcgpu.so"
    before = {p.name: os.stat(p) for p in (old.library, old.hook, old.preload)}
    assert again_same(install_runtime_files(state, Path("/run/cgpud/relay.sock")), before)

    monkeypatch.setattr(cgpud, "__version__", "0.2.0")
    new = install_runtime_files(state, Path("/run/cgpud/relay.sock"))
    assert new.hook == state / "runtime" / "0.2.0" / "cgpu-hook" and new.hook.read_bytes() == old.hook.read_bytes()
    # The old version's files are the very same inodes: nothing a running
    # container mapped or names in its hooks was touched.
    assert again_same(old, before)
    assert installed_versions(state / "runtime") == {"0.1.0", "0.2.0"}


def again_same(files: RuntimeFiles, before: dict[str, os.stat_result]) -> bool:
    now = {p.name: os.stat(p) for p in (files.library, files.hook, files.preload)}
    return all((now[k].st_ino, now[k].st_mtime_ns) == (v.st_ino, v.st_mtime_ns) for k, v in before.items())


def test_old_version_stays_while_an_instance_uses_it_and_goes_after(state, monkeypatch):
    svc = service(state)
    monkeypatch.setattr(cgpud, "__version__", "0.1.0")
    old = install_runtime_files(state, Path("/r.sock"))
    inst = svc.create(Request(Owner(OwnerKind.DEVICE, "dev"), GIB))
    idle = svc.create(Request(Owner(OwnerKind.DEVICE, "idle"), GIB))
    cdi.render(svc, old)  # the edits handed out name 0.1.0: both instances recorded
    svc.release(idle.id)

    monkeypatch.setattr(cgpud, "__version__", "0.2.0")
    new = install_runtime_files(state, Path("/r.sock"))
    assert collect(svc, new, state / "runtime") == []
    assert old.hook.exists() and old.library.exists()
    assert svc.runtime_versions_in_use() == {"0.1.0"}

    # New edits for the same instance name the new files, but the container
    # started from the old spec may still run: 0.1.0 stays until release.
    edits = cdi.device_instance_edits(svc, new)
    assert {h.path for e in edits for h in e.hooks} == {str(new.hook)}
    assert collect(svc, new, state / "runtime") == []
    svc.release(inst.id)
    assert collect(svc, new, state / "runtime") == ["0.1.0"]
    assert not (state / "runtime" / "0.1.0").exists() and new.hook.exists()
    assert collect(svc, new, state / "runtime") == []


def test_files_from_before_versioning_are_kept_for_the_instances_of_then(state, monkeypatch):
    # The state of a cgpud from before versioning: flat files, a schema 3
    # store with an active instance whose container mapped them.
    svc = service(state)
    inst = svc.create(Request(Owner(OwnerKind.DEVICE, "dev"), GIB))
    svc._store.close()
    conn = sqlite3.connect(state / "cgpud.db")
    conn.executescript("DROP TABLE runtime_users; UPDATE meta SET value = '3' WHERE key = 'schema_version';")
    conn.close()
    runtime = state / "runtime"
    runtime.mkdir(mode=0o755)
    for name in runtime_files.FILE_NAMES:
        (runtime / name).write_text("old\n")

    svc = service(state)  # migrates to schema 4: its active instances use the flat files
    assert svc.runtime_versions_in_use() == {LEGACY_RUNTIME}
    monkeypatch.setattr(cgpud, "__version__", "0.2.0")
    new = install_runtime_files(state, Path("/r.sock"))
    assert installed_versions(runtime) == {LEGACY_RUNTIME, "0.2.0"}
    assert collect(svc, new, runtime) == [] and (runtime / "libcgpu.so").exists()
    svc.release(inst.id)
    assert collect(svc, new, runtime) == [LEGACY_RUNTIME]
    assert sorted(p.name for p in runtime.iterdir()) == ["0.2.0"]


def test_a_retried_prepare_across_versions_replaces_the_old_hooks(state):
    svc = service(state)
    inst = svc.create(Request(Owner(OwnerKind.CONTAINER, "c1@/b"), GIB))
    old = RuntimeFiles(
        state / "runtime/0.1.0/libcgpu.so",
        state / "runtime/0.1.0/ld.so.preload",
        state / "runtime/0.1.0/cgpu-hook",
        Path("/r.sock"),
        "0.1.0",
    )
    new = RuntimeFiles(
        state / "runtime/0.2.0/libcgpu.so",
        state / "runtime/0.2.0/ld.so.preload",
        state / "runtime/0.2.0/cgpu-hook",
        Path("/r.sock"),
        "0.2.0",
    )
    # An older version also wrote a poststop entry of its own hook: dropped.
    theirs = {"path": str(old.hook), "args": ["cgpu-hook", "--instance", inst.id, "poststop"]}
    spec = {
        "process": {"env": []},
        "mounts": [],
        "hooks": {"poststop": [{"path": "/usr/bin/mine", "args": ["mine"]}, theirs]},
    }
    first = apply_edits(spec, instance_edits(inst, state / "instances" / inst.id, {0: 16 * GIB}, old), old)
    second = apply_edits(first, instance_edits(inst, state / "instances" / inst.id, {0: 16 * GIB}, new), new)
    assert [h["path"] for h in second["hooks"]["poststop"]] == ["/usr/bin/mine"]
    assert [h["path"] for h in second["hooks"]["createRuntime"]] == [str(new.hook)]
    assert {m["source"] for m in second["mounts"]} >= {str(new.library), str(new.preload)}
    assert not any("0.1.0" in m["source"] for m in second["mounts"])


def test_with_only_the_current_version_installed_the_table_is_not_asked(state, monkeypatch):
    svc = service(state)
    files = install_runtime_files(state, Path("/r.sock"))

    def asked() -> set[str]:
        raise AssertionError("the instance table was read")

    monkeypatch.setattr(svc, "runtime_versions_in_use", asked)
    assert collect(svc, files, state / "runtime") == []
    (state / "runtime" / "0.0.1").mkdir()
    with pytest.raises(AssertionError, match="table was read"):
        collect(svc, files, state / "runtime")
