"""The instance service over a real SQLite file and real region files:
idempotent create/release, regions written and removed, and what
reconcile() repairs after a crash."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cgpud.node.model import GIB, GpuCapacity, InstanceState, NodeMode, NodePolicy, Owner, OwnerKind, Request
from cgpud.node.region import read_limits
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from cgpud.errors import AdmissionError, StateError
from tests.harness.wait import until
from tests.harness.grants import is_gated

GPUS = (GpuCapacity(0, "GPU-aaaa", 16 * GIB), GpuCapacity(1, "GPU-bbbb", 16 * GIB))


def service(tmp_path: Path, mode: NodeMode = NodeMode.CGPU, boot: str = "boot-1") -> InstanceService:
    return InstanceService(
        Store(tmp_path / "db" / "cgpud.db"), GPUS, NodePolicy(mode=mode), tmp_path / "regions", "580.65.06", boot
    )


def owner(name: str, kind: OwnerKind = OwnerKind.CONTAINER) -> Owner:
    return Owner(kind, name)


def test_create_writes_the_region_and_release_removes_it(tmp_path):
    svc = service(tmp_path)
    inst = svc.create(Request(owner("c1"), 4 * GIB, core_percent=0))
    limits = read_limits(svc.region_dir(inst.id))
    assert [(d.uuid, d.mem_limit) for d in limits.devices] == [("GPU-aaaa", 4 * GIB)]
    svc.release(inst.id)
    assert not svc.region_dir(inst.id).exists()
    assert svc.get(inst.id).state is InstanceState.RELEASED


def test_share_mode_keeps_books_without_a_region(tmp_path):
    svc = service(tmp_path, NodeMode.SHARE)
    inst = svc.create(Request(owner("c1"), 4 * GIB))
    assert not inst.enforced and not svc.region_dir(inst.id).exists()


def test_a_retried_create_gets_the_same_instance_and_release_twice_is_fine(tmp_path):
    svc = service(tmp_path)
    first = svc.create(Request(owner("c1"), 4 * GIB))
    assert svc.create(Request(owner("c1"), 4 * GIB)) == first
    with pytest.raises(StateError, match="already holds instance"):
        svc.create(Request(owner("c1"), 8 * GIB))
    svc.release(first.id)
    assert svc.release(first.id).state is InstanceState.RELEASED


def test_admission_refusal_changes_nothing(tmp_path):
    svc = service(tmp_path)
    svc.create(Request(owner("c1"), 16 * GIB, gpu_count=2))
    with pytest.raises(AdmissionError):
        svc.create(Request(owner("c2"), GIB))
    assert [i.owner.id for i in svc.list()] == ["c1"]


def test_reconcile_repairs_releases_and_cleans(tmp_path):
    svc = service(tmp_path)
    kept = svc.create(Request(owner("keep"), 2 * GIB))
    (svc.region_dir(kept.id) / "limits").write_bytes(b"garbage")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = svc.create(Request(owner("gone", OwnerKind.PROCESS), GIB), pid=dead.pid)
    orphan = tmp_path / "regions" / "cgpu-orphan"
    orphan.mkdir(parents=True)
    summary = service(tmp_path).reconcile()  # as after a restart
    assert summary == {"released": 1, "regions_repaired": 1, "ledgers_reaped": 0, "orphan_regions_removed": 1}
    assert read_limits(svc.region_dir(kept.id)).devices[0].mem_limit == 2 * GIB
    assert svc.get(gone.id).state is InstanceState.RELEASED and not orphan.exists()


def test_an_orphan_region_that_cannot_be_removed_is_not_counted_removed(tmp_path, monkeypatch):
    import shutil

    from cgpud.node import region

    svc = service(tmp_path)
    stuck = tmp_path / "regions" / "cgpu-stuck"
    stuck.mkdir(parents=True)
    (stuck / "limits").write_bytes(b"x")  # not empty: an rmdir alone cannot remove it
    real = shutil.rmtree

    def refuse(path, *args, **kwargs):
        if str(path) == str(stuck):
            raise PermissionError(13, "Permission denied", str(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(region.shutil, "rmtree", refuse)
    assert svc.reconcile()["orphan_regions_removed"] == 0
    assert stuck.exists()


def test_a_reboot_releases_everything_from_before(tmp_path):
    svc = service(tmp_path)
    inst = svc.create(Request(owner("c1"), GIB))
    assert service(tmp_path, boot="boot-2").reconcile()["released"] == 1
    assert svc.get(inst.id).state is InstanceState.RELEASED


def test_a_retry_in_default_mode_gets_the_same_whole_gpu(tmp_path):
    svc = service(tmp_path, NodeMode.DEFAULT)
    first = svc.create(Request(owner("c1"), 4 * GIB))
    assert first.grants[0].memory == 16 * GIB
    assert svc.create(Request(owner("c1"), 4 * GIB)) == first


def test_a_drained_node_starts_and_stops_its_compute_scheduler_with_the_mode(tmp_path):
    """The Node's label turns a drained node core_mem and back at runtime:
    the real compute scheduler is started with the mode and stopped with
    it; while an instance is active the switch is refused, as before."""
    from cgpud.node.compute import ComputeScheduler
    from cgpud.node.model import ComputePolicy, Placement

    started: list[ComputeScheduler] = []

    def start() -> ComputeScheduler:
        started.append(ComputeScheduler(len(GPUS)).start())
        return started[-1]

    fixed = NodePolicy(mode=NodeMode.CGPU, compute_policy=ComputePolicy.FIXED)  # native would leave gates open
    svc = InstanceService(
        Store(tmp_path / "cgpud.db"), GPUS, fixed, tmp_path / "regions", "580.65.06", "boot-1", start_compute=start
    )
    try:
        before = svc.create(Request(owner("c0"), 4 * GIB))
        assert not is_gated(svc.region_dir(before.id))
        with pytest.raises(StateError, match="would break the 1 instance"):
            svc.set_node_policy(NodeMode.CORE_MEM, Placement.BINPACK)
        assert not started
        svc.release(before.id)
        svc.set_node_policy(NodeMode.CORE_MEM, Placement.BINPACK)
        assert svc.policy().mode is NodeMode.CORE_MEM and len(started) == 1
        inst = svc.create(Request(owner("c1"), 4 * GIB, core_percent=30))
        # The engine thread takes the tenant, and on a GPU it had left ungated closes its gate, on its next
        # turn, not within create() (engine.c: cgpu_engine_attach).
        until(
            lambda: is_gated(svc.region_dir(inst.id)) and started[0].schedule(0).tenants == 1,
            what="the scheduler to take the tenant",
        )
        with pytest.raises(StateError, match="would break the 1 instance"):
            svc.set_node_policy(NodeMode.CGPU, Placement.BINPACK)
        svc.release(inst.id)
        svc.set_node_policy(NodeMode.CGPU, Placement.BINPACK)
        plain = svc.create(Request(owner("c2"), 4 * GIB))
        assert svc.policy().mode is NodeMode.CGPU and not is_gated(svc.region_dir(plain.id))
        assert len(started) == 1
    finally:
        svc.stop_compute()


def test_released_instances_are_purged_after_a_week_and_looked_for_once_an_hour(tmp_path):
    from cgpud.node.service import RELEASED_KEPT, RELEASED_PURGE_EVERY
    from cgpud.errors import NotFoundError

    now = [1_000_000.0]
    clock = lambda: now[0]  # noqa: E731
    svc = InstanceService(
        Store(tmp_path / "db" / "cgpud.db", clock=clock),
        GPUS,
        NodePolicy(mode=NodeMode.CGPU),
        tmp_path / "regions",
        "580",
        "boot-1",
        clock=clock,
    )
    old = svc.create(Request(owner("old"), GIB))
    svc.release(old.id)
    now[0] += RELEASED_KEPT - 60
    recent = svc.create(Request(owner("recent"), GIB))
    svc.release(recent.id)
    active = svc.create(Request(owner("active", OwnerKind.DEVICE), GIB))  # held until released
    svc.sweep()  # the first sweep looks: nothing is a week old yet
    assert {i.id for i in svc.list(include_released=True)} == {old.id, recent.id, active.id}
    now[0] += 120  # `old` is now past a week, but the last look was a minute ago
    svc.sweep()
    assert svc.get(old.id).state is InstanceState.RELEASED
    now[0] += RELEASED_PURGE_EVERY
    svc.sweep()
    with pytest.raises(NotFoundError):
        svc.get(old.id)
    assert {i.id for i in svc.list(include_released=True)} == {recent.id, active.id}
    assert svc.get(active.id).state is InstanceState.RESERVED  # an active instance is never purged, however old


def test_a_resize_that_fails_half_way_leaves_the_instance_as_it_was(tmp_path):
    """The compute scheduler refuses the new share after the live limit was
    stored: the limit is put back, SQLite keeps the old row, the limits
    file and the Capacity revision do not move."""
    from cgpud.node.compute import ComputeError, ComputeScheduler
    from cgpud.node.model import ComputePolicy
    from cgpud.node.region import LiveLimits

    compute = ComputeScheduler(len(GPUS))
    policy = NodePolicy(mode=NodeMode.CORE_MEM, compute_policy=ComputePolicy.FIXED)
    svc = InstanceService(
        Store(tmp_path / "cgpud.db"), GPUS, policy, tmp_path / "regions", "580.65.06", "boot-1", compute=compute
    )
    inst = svc.create(Request(owner("c1"), 4 * GIB, core_percent=30))
    compute.detach(inst.id)  # the scheduler has lost it: the reshare fails
    revision = svc.changes.revision
    with pytest.raises(ComputeError, match=f"instance {inst.id} is not scheduled"):
        svc.resize(inst.id, 2 * GIB, 50)
    assert svc.get(inst.id).grants == inst.grants
    with LiveLimits(svc.region_dir(inst.id), with_usage=False) as live:
        assert live.current(0) == 4 * GIB
    assert read_limits(svc.region_dir(inst.id)).devices[0].mem_limit == 4 * GIB
    assert svc.changes.revision == revision
    resized = svc.resize(inst.id, 2 * GIB, None)  # memory alone needs no scheduler
    assert [(g.memory, g.core_percent) for g in resized.grants] == [(2 * GIB, 30)]
    assert read_limits(svc.region_dir(inst.id)).devices[0].mem_limit == 2 * GIB
    assert svc.changes.revision > revision
