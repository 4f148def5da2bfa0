"""The region made ahead of the next instance (InstanceService's spare):
what a create takes from it is exactly what a region made at the create
holds, as a tmpfs of its own or as a plain directory, gated as the
scheduler of the moment needs; a spare is never half taken, and none
outlives cgpud. Real SQLite, real files, real tmpfs mounts (as root)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from cgpud.node.compute import ComputeScheduler
from cgpud.node.model import GIB, ComputePolicy, GpuCapacity, NodeMode, NodePolicy, Owner, OwnerKind, Placement, Request
from cgpud.node.region import SPARE_REGION, LiveLimits, grants_problem, read_limits, usage_problem
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from tests.harness.grants import is_gated
from tests.harness.wait import until

GPUS = (GpuCapacity(0, "GPU-aaaa", 16 * GIB), GpuCapacity(1, "GPU-bbbb", 16 * GIB))


def service(tmp_path: Path, tmpfs: bool, **kw: object) -> InstanceService:
    return InstanceService(
        Store(tmp_path / "cgpud.db"),
        GPUS,
        kw.pop("policy", NodePolicy(mode=NodeMode.CGPU)),
        tmp_path / "regions",
        "580.65.06",
        "boot-1",
        tmpfs_regions=tmpfs,
        **kw,
    )  # type: ignore[arg-type]


def request(name: str, gib: int = 4, core: int = 0) -> Request:
    return Request(Owner(OwnerKind.CONTAINER, name), gib * GIB, core_percent=core)


def assert_region_sound(svc: InstanceService, instance_id: str, gib: int) -> None:
    region = svc.region_dir(instance_id)
    assert usage_problem(region) is None and grants_problem(region) is None
    assert [(d.uuid, d.mem_limit) for d in read_limits(region).devices] == [("GPU-aaaa", gib * GIB)]
    assert sorted(p.name for p in region.iterdir()) == ["grants", "limits", "usage"]
    assert oct(region.stat().st_mode & 0o777) == oct(0o755)
    with LiveLimits(region, with_usage=False) as live:  # what running processes enforce
        assert live.current(0) == gib * GIB


def test_the_next_instance_takes_the_spare_tmpfs_and_another_is_made(tmp_path):
    svc = service(tmp_path, tmpfs=True)
    spare = tmp_path / "regions" / SPARE_REGION
    svc.refill_region_spare()
    assert os.path.ismount(spare) and sorted(p.name for p in spare.iterdir()) == ["grants", "usage"]
    first = svc.create(request("c1"))
    region = svc.region_dir(first.id)
    assert os.path.ismount(region) and not os.path.ismount(spare)  # the spare's own tmpfs, moved
    assert_region_sound(svc, first.id, 4)
    svc.refill_region_spare()
    assert os.path.ismount(spare)
    second = svc.create(request("c2", gib=2))  # the second spare: two tmpfs, nothing shared
    assert_region_sound(svc, second.id, 2)
    assert os.stat(svc.region_dir(first.id)).st_dev != os.stat(svc.region_dir(second.id)).st_dev
    svc.release(first.id)
    svc.release(second.id)
    assert not region.exists()
    svc.drop_region_spare()
    assert not spare.exists() and not any(tmp_path.glob("regions/cgpu-*"))


def test_without_a_spare_or_a_tmpfs_a_create_makes_the_same_region(tmp_path):
    svc = service(tmp_path, tmpfs=False)
    made = svc.create(request("c1"))  # no refill yet: made at the create
    svc.refill_region_spare()
    taken = svc.create(request("c2"))
    for inst in (made, taken):
        assert_region_sound(svc, inst.id, 4)
        assert not os.path.ismount(svc.region_dir(inst.id))
    assert not (tmp_path / "regions" / SPARE_REGION).exists()  # renamed into the instance's place


def test_a_spare_made_for_no_scheduler_is_not_taken_once_one_runs(tmp_path):
    started: list[ComputeScheduler] = []

    def start() -> ComputeScheduler:
        started.append(ComputeScheduler(len(GPUS)).start())
        return started[-1]

    svc = service(
        tmp_path,
        tmpfs=False,
        start_compute=start,
        policy=NodePolicy(mode=NodeMode.CGPU, compute_policy=ComputePolicy.FIXED),
    )
    try:
        svc.refill_region_spare()
        assert not is_gated(tmp_path / "regions" / SPARE_REGION)
        svc.set_node_policy(NodeMode.CORE_MEM, Placement.BINPACK)
        inst = svc.create(request("c1", core=30))
        # The engine thread takes the tenant, and on a GPU it had left ungated closes its gate, on its next
        # turn, not within create() (engine.c: cgpu_engine_attach).
        until(
            lambda: is_gated(svc.region_dir(inst.id)) and started[0].schedule(0).tenants == 1,
            what="the scheduler to take the tenant",
        )
        svc.refill_region_spare()  # remade for the scheduler
        assert is_gated(tmp_path / "regions" / SPARE_REGION)
        taken = svc.create(request("c2", core=30))
        assert is_gated(svc.region_dir(taken.id)) and not (tmp_path / "regions" / SPARE_REGION).exists()
    finally:
        svc.stop_compute()


def test_share_mode_makes_no_spare_and_a_restart_removes_one_left_behind(tmp_path):
    share = service(tmp_path / "share", tmpfs=False, policy=NodePolicy(mode=NodeMode.SHARE))
    share.refill_region_spare()
    assert not (tmp_path / "share" / "regions").exists()

    svc = service(tmp_path, tmpfs=True)
    svc.refill_region_spare()
    spare = tmp_path / "regions" / SPARE_REGION
    assert os.path.ismount(spare)
    # cgpud killed: the next one's reconcile finds the spare, which no instance owns.
    again = service(tmp_path, tmpfs=True)
    assert again.reconcile()["orphan_regions_removed"] == 1 and not spare.exists()


def test_a_spare_that_cannot_be_moved_leaves_the_create_to_make_its_own(tmp_path):
    svc = service(tmp_path, tmpfs=True)
    svc.refill_region_spare()
    spare = tmp_path / "regions" / SPARE_REGION
    subprocess.run(["umount", str(spare)], check=True)  # gone from under cgpud
    inst = svc.create(request("c1"))  # the move fails: made at the create instead
    assert_region_sound(svc, inst.id, 4)
    assert os.path.ismount(svc.region_dir(inst.id))
    svc.refill_region_spare()
    assert os.path.ismount(spare)
    svc.drop_region_spare()


def test_a_refill_holds_the_instance_lock_only_for_moments(tmp_path, monkeypatch):
    """The relay makes the spare on its after-answer thread: a create
    meanwhile must not wait on the making (it makes its own region), and
    the spare made then is not handed out half made."""
    import threading

    from cgpud.node import service as service_module

    svc = service(tmp_path, tmpfs=False)
    making, go_on = threading.Event(), threading.Event()
    real = service_module.make_spare_region

    def slow(*args: object, **kw: object) -> object:
        making.set()
        assert go_on.wait(10)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(service_module, "make_spare_region", slow)
    refill = threading.Thread(target=svc.refill_region_spare)
    refill.start()
    assert making.wait(10)
    done: list = []
    creator = threading.Thread(target=lambda: done.append(svc.create(request("c1"))))
    creator.start()
    creator.join(5)
    assert done, "the create waited for the refill's region"
    assert_region_sound(svc, done[0].id, 4)
    go_on.set()
    refill.join(10)
    second = svc.create(request("c2", gib=2))  # now the spare, whole
    assert_region_sound(svc, second.id, 2)
    assert not (tmp_path / "regions" / SPARE_REGION).exists()
