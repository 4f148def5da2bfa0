"""Which container a request is about, and what its poststop may change:
the lifecycle over a real instance service (SQLite, region files) with
bundles in a temp dir, driven as the relays drive it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cgpud.node.model import GIB, InstanceState, Owner, OwnerKind, Request
from cgpud.errors import StateError, UsageError
from cgpud.containers.edits import RuntimeFiles
from cgpud.containers.identity import ContainerKey, container_key
from tests.harness.lifecycle import bundle, lifecycle, state


def test_the_key_is_the_canonical_bundle_and_the_id(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    assert container_key("job", tmp_path / "via") == ContainerKey(str(tmp_path / "real"), "job")
    assert str(container_key("job", "/run/x/default/job")) == "job@/run/x/default/job"
    # Opened or not, the name is realpath's: a link inside, a link to a
    # bundle that is gone, a bundle removed since.
    (tmp_path / "real" / "inner").mkdir()
    (tmp_path / "real" / "up").symlink_to("inner/..")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "removed").mkdir()
    for path in (tmp_path / "via" / "up", tmp_path / "dangling" / "x", tmp_path / "removed"):
        assert container_key("job", path).namespace == os.path.realpath(path)
    (tmp_path / "removed").rmdir()
    assert container_key("job", tmp_path / "removed").namespace == str(tmp_path / "removed")
    for bad_id, bad_bundle in (("", "/b"), ("a@b", "/b"), ("a/b", "/b"), ("job", "rel"), ("job", ""), ("job", 3)):
        with pytest.raises(UsageError):
            container_key(bad_id, bad_bundle)  # type: ignore[arg-type]


def test_one_id_in_two_namespaces_gets_two_instances_and_each_poststop_frees_only_its_own(tmp_path: Path) -> None:
    lc, svc = lifecycle(tmp_path)
    a = bundle(tmp_path / "ns-a" / "job", "ALIYUN_COM_GPU_MEM_CONTAINER=8")
    b = bundle(tmp_path / "ns-b" / "job", "ALIYUN_COM_GPU_MEM_CONTAINER=8")
    ia = lc.prepare("job", a).instance
    ib = lc.prepare("job", b).instance
    assert ia and ib and ia.id != ib.id
    lc.hook("createRuntime", ia.id, state("job", a, os.getpid()))
    lc.hook("createRuntime", ib.id, state("job", b, os.getpid()))
    with pytest.raises(StateError, match="belongs to container job@"):
        lc.hook("createRuntime", ia.id, state("job", b, os.getpid()))
    # b's poststop naming a's instance (a hook entry copied between bundles) changes nothing.
    assert "belongs to container" in lc.hook("poststop", ia.id, state("job", b))
    assert svc.get(ia.id).state is InstanceState.BOUND
    assert lc.hook("poststop", ib.id, state("job", b)) == f"released {ib.id}"
    assert svc.get(ia.id).state is InstanceState.BOUND
    with pytest.raises(Exception, match="memory"):  # a's 8 GiB are still held: 16 GiB GPU, 8 + 9 do not fit
        svc.create(Request(Owner(OwnerKind.CONTAINER, "third"), 9 * GIB))


def test_a_claimed_instance_goes_back_only_at_its_holders_poststop(tmp_path: Path) -> None:
    lc, svc = lifecycle(tmp_path)
    dev = svc.create(Request(Owner(OwnerKind.DEVICE, "d"), 2 * GIB))
    claim = [{"destination": "/run/cgpu", "type": "bind", "source": str(svc.region_dir(dev.id)), "options": ["ro"]}]
    holder = bundle(tmp_path / "holder", mounts=claim)
    assert lc.prepare("c1", holder).instance.id == dev.id
    lc.hook("createRuntime", dev.id, state("c1", holder, os.getpid()))
    other = bundle(tmp_path / "other")
    with pytest.raises(StateError, match="already used by container c1@"):
        lc.hook("createRuntime", dev.id, state("c2", other, os.getpid()))
    for cid, where in (("c2", other), ("c1", other), ("c2", holder)):
        assert "is held by c1@" in lc.hook("poststop", dev.id, state(cid, where))
        assert svc.get(dev.id).state is InstanceState.BOUND
    assert lc.hook("poststop", dev.id, state("c1", holder)) == f"returned {dev.id}"
    back = svc.get(dev.id)
    assert back.state is InstanceState.RESERVED and back.holder == "" and back.pids == ()
    # A second poststop of the same container is a harmless no-op.
    assert "is held by nobody" in lc.hook("poststop", dev.id, state("c1", holder))


def test_a_poststop_without_a_usable_identity_is_a_no_op(tmp_path: Path) -> None:
    lc, svc = lifecycle(tmp_path)
    a = bundle(tmp_path / "a", "ALIYUN_COM_GPU_MEM_CONTAINER=1")
    inst = lc.prepare("job", a).instance
    assert inst
    assert lc.hook("poststop", inst.id, b'{"id": "job"}').startswith("nothing done")
    assert svc.get(inst.id).state is InstanceState.RESERVED


def test_the_same_bundle_and_id_under_a_second_runtime_root_is_refused(tmp_path: Path) -> None:
    lc, svc = lifecycle(tmp_path)
    a = bundle(tmp_path / "a", "ALIYUN_COM_GPU_MEM_CONTAINER=1")
    inst = lc.prepare("job", a).instance
    assert inst and lc.prepare("job", a).instance == inst  # a retried create before it ran
    lc.hook("createRuntime", inst.id, state("job", a, os.getpid()))
    before = (a / "config.json").read_bytes()
    with pytest.raises(StateError, match="already runs with instance"):
        lc.prepare("job", a)
    assert (a / "config.json").read_bytes() == before
    assert [i.id for i in svc.list()] == [inst.id]


def test_a_linked_volume_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    lc, svc = lifecycle(tmp_path)
    src = tmp_path / "vol"
    src.mkdir()
    (src / "ld.so.preload").symlink_to("/proc/self/cwd/x")
    a = bundle(
        tmp_path / "a",
        "ALIYUN_COM_GPU_MEM_CONTAINER=1",
        mounts=[{"destination": "/etc", "type": "bind", "source": str(src), "options": ["rbind"]}],
    )
    before = (a / "config.json").read_bytes()
    with pytest.raises(UsageError, match=r"the volume at /etc .* makes /etc/ld.so.preload a symbolic link"):
        lc.prepare("job", a)
    assert (a / "config.json").read_bytes() == before
    assert svc.list() == [] and not list((tmp_path / "regions").glob("cgpu-*"))


def test_the_createruntime_check_looks_where_the_edits_mount(tmp_path: Path) -> None:
    from cgpud.containers.edits import instance_edits
    from cgpud.containers.lifecycle import ENFORCED_TARGETS

    _, svc = lifecycle(tmp_path)
    inst = svc.create(Request(Owner(OwnerKind.DEVICE, "d"), GIB))
    rt = tmp_path / "rt"
    files = RuntimeFiles(rt / "libcgpu.so", rt / "ld.so.preload", rt / "cgpu-hook", tmp_path / "relay.sock")
    edits = instance_edits(inst, svc.region_dir(inst.id), {0: 16 * GIB}, files)
    assert tuple(m.destination for m in edits.mounts) == ENFORCED_TARGETS


@pytest.mark.parametrize("cid", ["job\n", "", "-job", "a/b", "job@x", "x" * 1025])
def test_an_id_runc_would_refuse_is_refused(cid: str) -> None:
    with pytest.raises(UsageError, match="is not a valid OCI container id"):
        container_key(cid, "/run/bundle")
