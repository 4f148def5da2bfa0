"""The instance service: what the local API (and later the device plugin and
runtime hook) call. It serialises changes, asks placement.admit for the
decision, records it in the store, then writes the region.

Order of effects, so that a kill -9 at any point is repaired by reconcile():
commit the instance row first; then write its region; a row without a region
gets one at the next start, and a region without an active row is removed.
Create and release are idempotent for retries after a crash: the same owner
gets the same active instance back, and releasing twice is no error."""

from __future__ import annotations

import builtins
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import structlog

from cgpud.node.topology import Links
from cgpud.node import host, placement, procmap
from cgpud.node.changes import Changes
from cgpud.node.model import ComputePolicy, GpuCapacity, Instance, InstanceState, NodeInfo, NodeMode, NodePolicy
from cgpud.node.model import OwnerKind, Placement, Request, Reservation, Share, WHOLE_GPU_MODES
from cgpud.node.compute import ComputeError, ComputeScheduler, GpuSchedule, TenantMetrics
from cgpud.node.compute_policy import decode_compute_policies, encode_compute_policies, limits_compute
from cgpud.node.compute_policy import with_compute_policy
from cgpud.node.exits import ExitWatch
from cgpud.node.region import INSTANCES_MODE, REGION_FS_FILE, SPARE_REGION, USAGE_FILE, DeviceLimit, InstanceLimits
from cgpud.node.region import RegionError, UsageRegion, claim_spare_region, grants_problem, make_region_dir
from cgpud.node.region import make_spare_region, read_limits, remove_region_dir, repair_usage, usage_problem
from cgpud.node.region import resize_live_limits, write_region
from cgpud.node.store import Store, new_instance_id
from cgpud.errors import AdmissionError, CgpuError, NotFoundError, StateError, UsageError
from cgpud.units import format_memory

COMPUTE_POLICY_KEY = "compute_policy"
# Modes whose instances get a region (and so libcgpu enforcement).
ENFORCED_MODES = (NodeMode.CGPU, NodeMode.CORE_MEM, NodeMode.MPS)
# Seconds a container instance may wait between the shim's prepare and the
# bind hook; runc gets there in tens of milliseconds.
UNBOUND_CONTAINER_GRACE = 120.0
# How long a released instance stays listed (`cgpuctl list --all`,
# `inspect`) before the sweep deletes its row; every GPU container start
# adds one. The sweep looks at most once per RELEASED_PURGE_EVERY.
RELEASED_KEPT = 7 * 24 * 3600.0
RELEASED_PURGE_EVERY = 3600.0
# A reservation's time to live: long enough for a bind and the kubelet's
# Allocate, short enough that a scheduler that died holds nothing for long.
DEFAULT_RESERVATION_TTL = 120.0
RESERVATION_TTL_RANGE = (1.0, 3600.0)


def pid_alive(pid: int, since: float, clock: procmap.BootClock | None = None) -> bool:
    """procmap.pid_alive (kept here for its callers)."""
    return procmap.pid_alive(pid, since, clock)


class InstanceService:
    def __init__(
        self,
        store: Store,
        gpus: Sequence[GpuCapacity],
        policy: NodePolicy,
        regions: Path,
        driver_version: str,
        boot_id: str,
        clock: Callable[[], float] = time.time,
        compute: ComputeScheduler | None = None,
        tmpfs_regions: bool = False,
        start_compute: Callable[[], ComputeScheduler] | None = None,
        reservation_ttl: float = DEFAULT_RESERVATION_TTL,
        exits: ExitWatch | None = None,
        links: Links | None = None,
        mps_pipes: Mapping[int, Path] | None = None,
    ) -> None:
        self._store = store
        # GPU index -> its MPS pipe directory, while cgpud runs the MPS
        # control daemons (mps mode at start; node/mps.py); None: it does not.
        self._mps_pipes = dict(mps_pipes) if mps_pipes is not None else None
        self._links = links  # how the GPUs are joined (inventory): multi-GPU and topology choices
        # GPUs the kubelet gave pods whole (set_whole_held): no instance of
        # ours, but taken. GPU index -> "namespace/pod/container".
        self._whole: dict[int, str] = {}
        self._reservation_ttl = self._check_ttl(reservation_ttl)
        # Bumped on every change a node view shows (instances, policy,
        # reservations); the Capacity API's watchers wait on it.
        self.changes = Changes()
        self._tmpfs_regions = tmpfs_regions  # a size-capped tmpfs per instance directory (cgpud: yes)
        self._gpus = tuple(gpus)
        self._regions = regions
        self._driver_version = driver_version
        self._boot_id = boot_id
        self._clock = clock
        self._purged_at: float | None = None  # the sweep's last purge of released rows
        self._boot = procmap.BootClock()  # process start times, for the sweep's pid checks
        self._lock = threading.Lock()
        self._log = structlog.get_logger("cgpud.instances")
        stored = store.get_setting(COMPUTE_POLICY_KEY)
        self._policy = policy if stored is None else decode_compute_policies(policy, stored)
        self._compute = compute
        # Starts a compute scheduler when a drained node turns core_mem at
        # runtime (None: only a restart can, as `cgpuctl` hosts without one).
        self._start_compute = start_compute
        # Told at bind which init each container instance follows; tells
        # init_exited() when it is gone (None: only the sweep notices).
        self._exits = exits
        self._region_fs_noted = False  # the first region directory of this run says how they are held
        # The spare region's grants gated (for a scheduler) or not; None: no spare ready.
        self._spare: bool | None = None
        self._spare_mounted = False
        if compute is not None:
            compute.configure(self._policy)

    # ---- queries -----------------------------------------------------------------

    def policy(self) -> NodePolicy:
        return self._policy

    def get(self, instance_id: str) -> Instance:
        return self._store.get(instance_id)

    def list(self, include_released: bool = False) -> list[Instance]:
        return self._store.list(include_released=include_released)

    def region_dir(self, instance_id: str) -> Path:
        return self._regions / instance_id

    @property
    def regions(self) -> Path:
        return self._regions

    def gpus(self) -> tuple[GpuCapacity, ...]:
        return self._gpus

    def mps_pipes(self) -> dict[int, Path]:
        """GPU index -> its MPS pipe directory, for the containers' edits:
        empty unless the node is in mps mode and cgpud runs the daemons."""
        if self._mps_pipes is None or self._policy.mode is not NodeMode.MPS:
            return {}
        return dict(self._mps_pipes)

    def node_info(self) -> NodeInfo:
        return NodeInfo(
            hostname=host.hostname(),
            address=host.primary_address(),
            driver_version=self._driver_version,
            policy=self._policy,
            gpus=placement.gpu_usage(self._gpus, *self.holdings(), self._whole),
        )

    def whole_held(self) -> Mapping[int, str]:
        """GPU index -> the "namespace/pod/container" that holds it whole."""
        return dict(self._whole)

    def set_whole_held(self, holders: Mapping[int, str]) -> None:
        """The GPUs pods hold whole (nvidia.com/gpu, aliyun.com/gpu), as the
        kubelet's pod-resources lists them: admission and the Capacity view
        count them taken. A change is a change of the node's view."""
        known = {g.index for g in self._gpus}
        held = {i: who for i, who in holders.items() if i in known}
        with self._lock:
            if held == self._whole:
                return
            self._whole = held
        self.changes.bump()

    def holdings(self) -> tuple[builtins.list[Instance], builtins.list[Reservation]]:
        """The active instances and live reservations, read together (one
        store snapshot): what admission sees as taken. Read after
        `changes.revision`, it holds at least every change counted there
        (each bump follows its commit)."""
        now = self._clock()
        active, reserved = self._store.holdings()
        return active, [r for r in reserved if r.live(now)]

    def compute_metrics(self) -> dict[str, builtins.list[TenantMetrics]]:
        """The compute scheduler's accounting by instance id ({} without one)."""
        compute = self._compute
        return compute.tenant_metrics() if compute is not None else {}

    def compute_schedules(self) -> dict[int, GpuSchedule]:
        """What the compute scheduler's loop does on each GPU ({} without one)."""
        compute = self._compute
        return compute.schedules() if compute is not None else {}

    def use_runtime(self, instance_ids: Sequence[str], version: str) -> None:
        """Records that these instances' edits name runtime `version`'s files,
        before the edits are handed out (runtime_files.py removes a version's
        directory only when no active instance uses it)."""
        self._store.add_runtime_users(instance_ids, version)

    def runtime_versions_in_use(self) -> set[str]:
        return self._store.runtime_versions_in_use()

    def reservations(self) -> builtins.list[Reservation]:
        """The live reservations, by pod UID; expired ones hold nothing even
        before the sweep deletes them."""
        now = self._clock()
        return [r for r in self._store.reservations() if r.live(now)]

    # ---- changes -------------------------------------------------------------------

    def create(self, request: Request, pid: int | None = None, runtime_version: str | None = None) -> Instance:
        """`runtime_version`: recorded as use_runtime() would, in the same
        transaction (the container start path saves one)."""
        try:
            return self._create(request, pid, runtime_version)
        except AdmissionError:
            # The room may be held by a container that stopped a moment ago
            # and whose exit is not handled yet (`docker rm -f` then `docker
            # run`): handle the exits that are ready, then ask once more.
            if self._exits is None or not self._exits.settle():
                raise
            return self._create(request, pid, runtime_version)

    def _create(self, request: Request, pid: int | None, runtime_version: str | None) -> Instance:
        with self._lock:
            with self._store.transaction() as tx:
                active = tx.active()
                same_owner = [i for i in active if i.owner == request.owner]
                if same_owner:
                    existing = self._same_request(same_owner[0], request)
                    if runtime_version is not None:
                        tx.add_runtime_users([existing.id], runtime_version)
                    return existing
                now = self._clock()
                reserved = [r for r in tx.reservations() if r.live(now)]
                grants = placement.admit(request, self._gpus, active, self._policy, reserved, self._links, self._whole)
                instance = Instance(
                    id=new_instance_id(),
                    owner=request.owner,
                    grants=grants,
                    state=InstanceState.BOUND if pid else InstanceState.RESERVED,
                    enforced=self._policy.mode in ENFORCED_MODES,
                    weight=request.weight,
                    priority=request.priority,
                    pids=(pid,) if pid else (),
                    boot_id=self._boot_id,
                    created=now,
                    updated=now,
                )
                tx.insert(instance)
                if runtime_version is not None:
                    tx.add_runtime_users([instance.id], runtime_version)
                drawn = next((r for r in reserved if request.reservation and r.pod_uid == request.reservation), None)
                if drawn is not None:
                    # What the instance took is no longer held for the pod.
                    left = placement.consume(drawn, grants)
                    if left:
                        tx.put_reservation(replace(drawn, shares=left))
                    else:
                        tx.delete_reservation(drawn.pod_uid)
            self.changes.bump()
            self._write_region(instance)
            try:
                self._schedule(instance)
            except ComputeError:
                # No instance the scheduler does not know; the pod keeps what it had reserved.
                self._release_locked(instance.id, restore=drawn)
                raise
        self._log.info(
            "created",
            id=instance.id,
            owner=instance.owner.id,
            grants=[(g.gpu_index, g.memory, g.core_percent) for g in instance.grants],
        )
        return instance

    def bind(self, instance_id: str, pids: tuple[int, ...], owner_id: str | None = None) -> Instance:
        with self._lock:
            instance = self._store.set_state(instance_id, InstanceState.BOUND, pids=pids, owner_id=owner_id)
            self.changes.bump()
        self._log.info("bound", id=instance_id, pids=list(pids))
        return instance

    def bind_container(
        self,
        instance_id: str,
        container: str,
        pid: int,
        check: Callable[[Instance], None] = lambda instance: None,
        decided: Callable[[str], None] = lambda text: None,
    ) -> Instance:
        """Bind to a container's init process; `container` is its key
        (cgpud.containers.identity). A container's own instance only to that
        container; a reserved (claimed) one only while free, and it records
        who holds it. `check(instance)` runs once those pass, before the
        bind, and refuses it by raising (nothing is changed then).

        `decided(text)` is called once the bind is certain, before its
        write: the runtime goes on meanwhile, and the lock is held to the
        end, so any request after the answer sees the instance bound. Should
        the write fail after the answer, the init is killed (it has not run
        the container's process yet: that waits for `start`) and a
        container's own instance released, so nothing runs unaccounted."""
        pidfd = _pidfd(pid)
        try:
            with self._lock:
                answered = False
                try:
                    # One transaction for the read, the check and the write: this is on the container start path.
                    with self._store.transaction() as tx:
                        current = tx.get(instance_id)
                        owner = current.owner
                        if owner.kind is OwnerKind.CONTAINER and owner.id != container:
                            raise StateError(f"instance {instance_id} belongs to container {owner.id}, not {container}")
                        if (
                            owner.kind is not OwnerKind.CONTAINER
                            and current.state is InstanceState.BOUND
                            and current.holder != container
                        ):
                            raise StateError(
                                f"instance {instance_id} is already used by container {current.holder or '?'}"
                            )
                        check(current)
                        decided(f"bound {instance_id}")
                        answered = True
                        instance = tx.set_state(
                            instance_id, InstanceState.BOUND, pids=(pid,), holder=container, current=current
                        )
                    self.changes.bump()
                except BaseException:
                    if answered:
                        self._undo_answered_bind(instance_id, pid, pidfd)
                    raise
            if self._exits is not None:
                self._exits.watch(instance_id, pid, pidfd)  # the pidfd is the watch's now
                pidfd = None
        finally:
            if pidfd is not None:
                os.close(pidfd)
        self._log.info("bound", id=instance_id, container=container, pid=pid)
        return instance

    def _undo_answered_bind(self, instance_id: str, pid: int, pidfd: int | None) -> None:
        """The runtime was told `bound` but the bind was not written: the
        init goes (through its pidfd, never a reused pid), and a container's
        own instance with it."""
        self._log.error("bind failed after it was answered: killing the container's init", id=instance_id, pid=pid)
        if pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        try:
            current = self._store.get(instance_id)
            if current.owner.kind is OwnerKind.CONTAINER and current.active:
                self._release_locked(instance_id)
        except Exception:  # the store failing is why we are here: the sweep retries
            self._log.exception("instance left for the sweep", id=instance_id)

    def _unwatch(self, instance_id: str) -> None:
        if self._exits is not None:  # released or handed back: its init no longer matters
            self._exits.forget(instance_id)

    def init_exited(self, instance_id: str, pid: int) -> None:
        """The init process a container instance was bound to exited
        (ExitWatch): what its container's poststop would do, at once. Nothing
        if the instance was released, handed back or bound to another since."""
        try:
            current = self.get(instance_id)
        except NotFoundError:
            return
        if current.state is not InstanceState.BOUND or pid not in current.pids:
            return
        container = current.owner.id if current.owner.kind is OwnerKind.CONTAINER else current.holder
        if container:
            self.container_stopped(instance_id, container, pid=pid, why="its container's init exited")

    def container_stopped(
        self,
        instance_id: str,
        container: str,
        decided: Callable[[str], None] = lambda text: None,
        pid: int | None = None,
        why: str = "poststop",
    ) -> tuple[bool, str]:
        """poststop of `container`: release its own instance, hand a claimed
        one it holds back to `reserved`. Anything else is left as it is and
        said why (False): another container's poststop must not free what a
        running one holds.

        `decided(text)` is called once a release is certain, before its work
        (SQLite, the region's tmpfs): the caller can answer a waiting runtime
        then. The lock is held from the decision to the end of the work, so
        any request that comes after the answer sees the memory free.
        `pid`: only if the instance is still bound to that init process."""
        with self._lock:
            try:
                current = self._store.get(instance_id)
            except NotFoundError:
                return True, "nothing to release"  # a retried poststop after a purge
            if pid is not None and pid not in current.pids:
                return False, f"instance {instance_id} is no longer bound to process {pid}"
            if current.owner.kind is OwnerKind.CONTAINER:
                if current.owner.id != container:
                    return False, f"instance {instance_id} belongs to container {current.owner.id}, not {container}"
                text = f"released {instance_id}"
                if current.state is not InstanceState.RELEASED:
                    decided(text)
                    self._release_locked(instance_id)
                    self._log.info("released", id=instance_id, reason=why)
                return True, text
            if current.state is InstanceState.BOUND and current.holder == container:
                self._store.set_state(instance_id, InstanceState.RESERVED, pids=(), holder="")
                self.changes.bump()
                self._unwatch(instance_id)
                self._log.info("unbound", id=instance_id, container=container, reason=why)
                return True, f"returned {instance_id}"
            holder = current.holder if current.state is InstanceState.BOUND else "nobody"
            return False, f"instance {instance_id} is held by {holder or 'an unknown container'}, not {container}"

    def unbind(self, instance_id: str) -> Instance:
        """Hand a claimed instance back to `reserved` when its container stops."""
        with self._lock:
            instance = self._store.set_state(instance_id, InstanceState.RESERVED, pids=(), holder="")
            self.changes.bump()
        self._unwatch(instance_id)
        self._log.info("unbound", id=instance_id)
        return instance

    def release(self, instance_id: str, restore: Reservation | None = None) -> Instance:
        """`restore`: the reservation the instance drew on, as it was before
        (an Allocate undone): it is put back with the release when the stored
        one is still exactly what the instance left of it, so an undone
        Allocate costs its pod nothing; otherwise (replaced, given back) it
        is left alone."""
        with self._lock:
            current = self._store.get(instance_id)
            if current.state is InstanceState.RELEASED:
                return current  # a retry after a crash: already done
            instance = self._release_locked(instance_id, restore)
        self._log.info("released", id=instance_id)
        return instance

    def _release_locked(self, instance_id: str, restore: Reservation | None = None) -> Instance:
        with self._store.transaction() as tx:
            instance = tx.set_state(instance_id, InstanceState.RELEASED)
            if restore is not None:
                stored = next((r for r in tx.reservations() if r.pod_uid == restore.pod_uid), None)
                left = placement.consume(restore, instance.grants)
                untouched = not left if stored is None else (stored.shares, stored.expires) == (left, restore.expires)
                if untouched:
                    tx.put_reservation(restore)
                    self._log.info("reservation restored", pod_uid=restore.pod_uid, id=instance_id)
        self.changes.bump()
        self._unwatch(instance_id)
        if self._compute is not None:
            self._compute.detach(instance_id)
        try:
            remove_region_dir(self.region_dir(instance_id))
        except RegionError as e:  # released all the same; the orphan sweep retries
            self._log.error("region left behind", id=instance_id, error=str(e))
        return instance

    def resize(self, instance_id: str, memory: int | None = None, core_percent: int | None = None) -> Instance:
        """A running instance's memory per GPU and compute share, changed in
        place (None: as it is). Admitted as the instance on its own GPUs
        against everything else the node holds; a shrink below what its
        processes hold now is refused with the figure. Running processes see
        the new memory limit at their next allocation or query, the scheduler
        the new share at its next decision."""
        with self._lock:
            applied: tuple[Instance, Instance] | None = None
            try:
                with self._store.transaction() as tx:
                    instance = tx.get(instance_id)
                    now = self._clock()
                    reserved = [r for r in tx.reservations() if r.live(now)]
                    grants = placement.admit_resize(
                        instance, memory, core_percent, self._gpus, tx.active(), self._policy, reserved, self._whole
                    )
                    if grants == instance.grants:
                        return instance
                    resized = tx.set_grants(instance, grants)
                    # Inside the transaction: a refusal or failure here undoes the row too.
                    self._apply_resize(instance, resized)
                    applied = (instance, resized)
            except BaseException:
                if applied is not None:  # the commit failed: SQLite still has the old size
                    self._undo_resize(*applied)
                raise
            self.changes.bump()
            if resized.enforced:
                try:  # processes started from now on read the limits file
                    write_region(self.region_dir(resized.id), self._limits(resized), gated=self._gated())
                except RegionError as e:  # the live limits hold; reconcile rewrites it from the table
                    self._log.error("limits file not rewritten after a resize", id=resized.id, error=str(e))
        self._log.info(
            "resized",
            id=resized.id,
            grants=[(g.gpu_index, g.memory, g.core_percent) for g in resized.grants],
            was=[(g.gpu_index, g.memory, g.core_percent) for g in instance.grants],
        )
        return resized

    def _apply_resize(self, before: Instance, after: Instance) -> None:
        """The live memory limits, then the compute share; each undone if a
        later step fails."""
        if not after.enforced:
            return
        region = self.region_dir(after.id)
        new = {slot: g.memory for slot, g in enumerate(after.grants)}
        try:
            refused = resize_live_limits(region, new)
        except RegionError as e:
            raise RegionError(f"cannot resize instance {after.id}: {e}") from e
        if refused:
            parts = [f"{format_memory(r.used)} on GPU {after.grants[r.slot].gpu_index}" for r in refused]
            most = max(r.used for r in refused)
            raise AdmissionError(
                f"cannot shrink instance {after.id} to {format_memory(after.grants[0].memory)} per GPU: "
                f"its processes hold {' and '.join(parts)} now; free that memory first "
                f"or resize to {format_memory(most)} or more"
            )
        if self._compute is None or all(
            a.core_percent == b.core_percent for a, b in zip(before.grants, after.grants, strict=True)
        ):
            return
        try:
            self._compute.reshare(after)
        except ComputeError:
            self._undo_resize(before, after)
            raise

    def _undo_resize(self, before: Instance, after: Instance) -> None:
        """`before`'s live limits and share again, whatever is held now (it
        held that much under them a moment ago)."""
        try:
            resize_live_limits(
                self.region_dir(before.id), {s: g.memory for s, g in enumerate(before.grants)}, check=False
            )
            if self._compute is not None and before.grants != after.grants:
                self._compute.reshare(before)
        except CgpuError as e:  # reconcile rewrites the region from SQLite at the next start
            self._log.error("a failed resize was not undone", id=before.id, error=str(e))

    def set_compute_policy(self, policy: ComputePolicy, gpu: int | None = None) -> NodePolicy:
        """For the whole node, or for one GPU; survives restarts."""
        with self._lock:
            changed = with_compute_policy(self._policy, policy, gpu, len(self._gpus))
            self._store.set_setting(COMPUTE_POLICY_KEY, encode_compute_policies(changed))
            self._policy = changed
            if self._compute is not None:
                self._compute.configure(changed)
            self.changes.bump()
        self._log.info("policy", compute_policy=policy.name.lower(), gpu="all" if gpu is None else gpu)
        return self._policy

    def set_node_policy(self, mode: NodeMode, node_placement: Placement) -> NodePolicy:
        """Mode and placement at runtime (the Node's labels); a mode change
        only as placement.policy_change_problem allows. Not stored: the
        labels are read again at every start."""
        with self._lock:
            active = self._store.active()
            wants_compute = limits_compute(mode)
            # Drained, the scheduler can be started or stopped with the mode.
            switch = (
                self._start_compute is not None
                and wants_compute != (self._compute is not None)
                and not any(i.active for i in active)
            )
            problem = placement.policy_change_problem(
                self._policy,
                mode,
                active,
                wants_compute if switch else self._compute is not None,
                mps_running=self._mps_pipes is not None,
            )
            if problem is not None:
                raise StateError(problem)
            self._policy = replace(self._policy, mode=mode, placement=node_placement)
            if switch:
                self._switch_compute(wants_compute)
            self.changes.bump()
        self._log.info("policy", mode=mode.value, placement=node_placement.value)
        return self._policy

    def _switch_compute(self, wanted: bool) -> None:
        """Caller holds the lock and has checked that no instance is active."""
        if wanted and self._start_compute is not None:
            self._compute = self._start_compute()
            self._compute.configure(self._policy)
            self._log.info("compute scheduler started", mode=self._policy.mode.value)
        elif not wanted and self._compute is not None:
            stopped, self._compute = self._compute, None
            stopped.stop()
            self._log.info("compute scheduler stopped", mode=self._policy.mode.value)

    def reserve(
        self, pod_uid: str, namespace: str, name: str, shares: Sequence[Share], ttl: float | None = None
    ) -> Reservation:
        """Hold `shares` for a pod a cluster scheduler is binding here, until
        its Allocate draws on them (Request.reservation) or `ttl` seconds
        pass (None: the node's default). The same pod again replaces its
        reservation, checked as if the old one were gone. UsageError for a
        wrong request, StateError on a node that gives whole GPUs,
        AdmissionError when a share does not fit now; nothing changes then."""
        if not pod_uid:
            raise UsageError("a reservation needs a pod UID")
        seconds = self._reservation_ttl if ttl is None else self._check_ttl(ttl)
        ordered = tuple(sorted(shares, key=lambda s: s.gpu_index))
        with self._lock:
            # Check and write in one transaction: two reserves can never
            # both get the last of a GPU.
            with self._store.transaction() as tx:
                now = self._clock()
                others = [r for r in tx.reservations() if r.live(now) and r.pod_uid != pod_uid]
                placement.check_reservation(ordered, self._gpus, tx.active(), others, self._policy)
                reservation = tx.put_reservation(Reservation(pod_uid, namespace, name, ordered, now + seconds))
            self.changes.bump()
        self._log.info(
            "reserved",
            pod_uid=pod_uid,
            pod=f"{namespace}/{name}",
            ttl=seconds,
            shares=[(s.gpu_index, s.memory, s.core_percent, s.instances) for s in ordered],
        )
        return reservation

    def unreserve(self, pod_uid: str) -> bool:
        """Give a pod's reservation back; False when it had none."""
        with self._lock:
            deleted = self._store.delete_reservation(pod_uid)
            if deleted:
                self.changes.bump()
        if deleted:
            self._log.info("unreserved", pod_uid=pod_uid)
        return deleted

    @staticmethod
    def _check_ttl(ttl: float) -> float:
        low, high = RESERVATION_TTL_RANGE
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not low <= ttl <= high:
            raise UsageError(f"a reservation's time to live is {ttl!r} seconds: use {low:g} to {high:g}")
        return float(ttl)

    def stop_compute(self) -> None:
        """At shutdown: ends the compute scheduler this service drives, if any."""
        with self._lock:
            stopped, self._compute = self._compute, None
        if stopped is not None:
            stopped.stop()

    # ---- upkeep -----------------------------------------------------------------------

    def reconcile(self) -> dict[str, int]:
        """At start: release what outlived its owner, repair regions, reclaim
        the usage of dead processes, remove regions nobody owns."""
        released = repaired = reaped = 0
        if self._regions.is_dir():
            self._regions.chmod(INSTANCES_MODE)  # an older cgpud made it 0755
        for instance in self._store.active():
            if instance.boot_id != self._boot_id or self._owner_gone(instance):
                self.release(instance.id)
                released += 1
                continue
            if (
                self._exits is not None
                and instance.state is InstanceState.BOUND
                and len(instance.pids) == 1
                and (instance.owner.kind is OwnerKind.CONTAINER or instance.holder)
            ):
                self._exits.watch(instance.id, instance.pids[0])
            # Each instance's damage is its own: one a tenant broke beyond
            # repair never stops the start or the others.
            try:
                repaired += self._repair_region(instance)
                reaped += self._reap(instance)
            except (CgpuError, OSError, MemoryError) as e:
                self._log.error("instance region cannot be repaired", id=instance.id, error=str(e))
            try:
                with self._lock:
                    self._schedule(instance)
            except ComputeError as e:
                self._log.error("instance cannot be scheduled; releasing it", id=instance.id, error=str(e))
                self.release(instance.id)
                released += 1
        removed = self._remove_orphan_regions()
        summary = {
            "released": released,
            "regions_repaired": repaired,
            "ledgers_reaped": reaped,
            "orphan_regions_removed": removed,
        }
        self._log.info("reconciled", **summary)
        return summary

    def sweep(self) -> int:
        """Releases instances whose processes all exited (a container whose
        exit the watch missed included: cgpud was down, or no pidfd) and
        container instances never bound;
        deletes expired reservations. Returns how many instances it released."""
        active = self._store.active()
        gone = [i for i in active if self._owner_gone(i) or self._never_started(i)]
        for instance in gone:
            self.release(instance.id)
        # A claimed instance whose container's exit went unseen goes back
        # to reserved, or the next container of its pod could not bind it.
        for instance in active:
            if self._container_gone(instance):
                self.unbind(instance.id)
        self._check_usage([i for i in active if i not in gone])
        self._expire_reservations()
        self._purge_released()
        return len(gone)

    def _purge_released(self) -> int:
        """Deletes the rows of instances released more than RELEASED_KEPT
        ago, at most once per RELEASED_PURGE_EVERY: the table would
        otherwise grow by one row per container start, for good."""
        now = self._clock()
        if self._purged_at is not None and now - self._purged_at < RELEASED_PURGE_EVERY:
            return 0
        self._purged_at = now
        with self._lock:
            purged = self._store.purge_released(now - RELEASED_KEPT)
        if purged:
            self._log.info("released instances purged", count=purged, older_than_days=RELEASED_KEPT / 86400)
        return purged

    def _expire_reservations(self) -> int:
        """Deletes reservations whose time ran out (admission already
        ignored them); a scheduler that reserved and never bound. A write
        only when one has expired: a write every sweep would make every
        reader of the instance table read it afresh."""
        now = self._clock()
        if not any(r.expires <= now for r in self._store.holdings()[1]):
            return 0
        with self._lock:
            expired = self._store.delete_expired_reservations(now)
            if expired:
                self.changes.bump()
        for pod_uid in expired:
            self._log.info("reservation expired", pod_uid=pod_uid)
        return len(expired)

    def _check_usage(self, instances: Sequence[Instance]) -> int:
        """Puts right the usage files tenants resized or scribbled on, and
        maps afresh in the scheduler those it found truncated under its
        mapping. Reads each file's size and header only; one instance's
        damage never stops the others'. Returns how many were repaired."""
        repaired = 0
        enforced = [i for i in instances if i.enforced]
        if not enforced:
            return 0
        # One lock and one read of the table for the whole pass (a header
        # read per file): an instance released since the caller's snapshot
        # is left alone, as its region goes with it.
        with self._lock:
            try:
                current = {i.id for i in self._store.active()}
            except CgpuError as e:
                self._log.error("usage files not checked", error=str(e))
                return 0
            for instance in enforced:
                if instance.id not in current:
                    continue
                region = self.region_dir(instance.id)
                try:
                    problem = usage_problem(region)
                    damaged = self._compute is not None and self._compute.damaged(instance.id)
                    if problem is None and not damaged:
                        continue
                    if problem is not None:
                        repair_usage(region / USAGE_FILE)
                    if self._compute is not None and damaged:
                        self._compute.reattach(instance, region)
                except (CgpuError, OSError, MemoryError) as e:
                    self._log.error("usage file cannot be repaired", id=instance.id, error=str(e))
                    continue
                self._log.warning(
                    "usage file repaired",
                    id=instance.id,
                    remapped=damaged,
                    problem=problem or "truncated under the scheduler's mapping",
                )
                repaired += 1
        return repaired

    # ---- helpers ------------------------------------------------------------------------

    def _same_request(self, existing: Instance, request: Request) -> Instance:
        # Default mode grants whole GPUs whatever memory was asked.
        whole = self._policy.mode in WHOLE_GPU_MODES
        wanted = (0 if whole else request.memory, request.gpu_count, request.core_percent)
        held = (
            0 if whole else existing.grants[0].memory,
            len(existing.grants),
            0 if whole else existing.grants[0].core_percent,
        )
        if wanted != held:
            raise StateError(
                f"{existing.owner.kind.value} {existing.owner.id} already holds instance "
                f"{existing.id} with a different request; release it first"
            )
        return existing

    def _owner_gone(self, instance: Instance) -> bool:
        # Pod instances live until their pod goes (device plugin), device
        # instances until released; host processes and containers while one
        # of their bound PIDs runs.
        if instance.owner.kind in (OwnerKind.POD, OwnerKind.DEVICE) or not instance.pids:
            return False
        return not any(pid_alive(pid, instance.updated, self._boot) for pid in instance.pids)

    def _container_gone(self, instance: Instance) -> bool:
        return (
            instance.owner.kind in (OwnerKind.POD, OwnerKind.DEVICE)
            and instance.state is InstanceState.BOUND
            and bool(instance.pids)
            and not any(pid_alive(pid, instance.updated, self._boot) for pid in instance.pids)
        )

    def _never_started(self, instance: Instance) -> bool:
        # Prepared at create, but the runtime failed before the bind and
        # nobody released it.
        return (
            instance.owner.kind is OwnerKind.CONTAINER
            and instance.state is InstanceState.RESERVED
            and self._clock() - instance.created > UNBOUND_CONTAINER_GRACE
        )

    def _limits(self, instance: Instance) -> InstanceLimits:
        devices = tuple(
            DeviceLimit(g.gpu_uuid, g.memory, g.gpu_index, g.core_percent, instance.weight, instance.priority)
            for g in instance.grants
        )
        return InstanceLimits(instance.id, devices, compute_policy=int(self._policy.compute_policy))

    def refill_region_spare(self) -> None:
        """Makes the region of the next instance ahead of it, off the start
        path: the relay calls this once it has answered, main once the
        regions are reconciled. A no-op when a spare is ready for the
        scheduler as it is now, or when the node enforces nothing. One
        caller at a time (the relay's after-answer thread, or main before
        the relay starts). The region is made outside the instance lock: no
        create takes the spare while `_spare` says none is ready, and none
        waits for the mount."""
        with self._lock:
            gated = self._gated()
            if self._spare == gated or self._policy.mode not in ENFORCED_MODES:
                return
            self._spare = None
        spare = self._regions / SPARE_REGION
        try:
            remove_region_dir(spare)  # what a claim left, or one for another scheduler
            plain = make_spare_region(spare, gated, self._tmpfs_regions)
        except (RegionError, OSError) as e:
            self._log.warning("no spare region: the next instance makes its own", error=str(e))
            return
        with self._lock:
            self._note_region_fs(plain)
            if self._gated() == gated:  # else the next refill makes one for the scheduler as it is now
                self._spare, self._spare_mounted = gated, plain is None

    def drop_region_spare(self) -> None:
        """At stop: no tmpfs of cgpud's outlives it unless an instance holds it."""
        with self._lock:
            self._spare = None
            try:
                remove_region_dir(self._regions / SPARE_REGION)
            except RegionError as e:
                self._log.warning("spare region left behind", error=str(e))

    def _write_region(self, instance: Instance) -> None:
        if instance.enforced:
            region = self.region_dir(instance.id)
            if self._spare is not None and self._spare == self._gated():
                self._spare = None  # taken or spoilt: the next refill makes another
                if claim_spare_region(
                    self._regions / SPARE_REGION, region, self._limits(instance), self._spare_mounted
                ):
                    return
            fresh = not region.is_dir()
            if fresh:
                self._note_region_fs(make_region_dir(region, self._tmpfs_regions))
            write_region(region, self._limits(instance), gated=self._gated(), fresh=fresh)

    def _gated(self) -> bool:
        # A region's gates start closed only where a scheduler will open them.
        return self._compute is not None

    def _note_region_fs(self, plain: str | None) -> None:
        """Says once per run how regions are held; loudly if a tenant can
        fill cgpud's state filesystem through its usage file."""
        if self._region_fs_noted:
            return
        self._region_fs_noted = True
        if plain is not None:
            self._log.warning(
                "instance regions are plain directories on the state filesystem: a tenant can fill "
                "it through its usage file (cgpud needs CAP_SYS_ADMIN to mount a tmpfs per instance)",
                reason=plain,
            )
        try:
            (self._regions / REGION_FS_FILE).write_text("tmpfs\n" if plain is None else f"plain: {plain}\n")
        except OSError as e:
            self._log.error("cannot record how regions are held", error=str(e))

    def _schedule(self, instance: Instance) -> None:
        if self._compute is not None and instance.enforced:
            self._compute.attach(instance, self.region_dir(instance.id))

    def _repair_region(self, instance: Instance) -> int:
        if not instance.enforced:
            return 0
        region = self.region_dir(instance.id)
        try:
            problem = usage_problem(region) or grants_problem(region)
            if problem is None and read_limits(region) == self._limits(instance):
                return 0
        except RegionError as e:
            problem = str(e)
        # Damaged, or a crash came between committing and writing it.
        self._log.warning("region repaired", id=instance.id, error=problem or "other limits")
        self._write_region(instance)  # repairs the usage file in place
        return 1

    def _reap(self, instance: Instance) -> int:
        if not instance.enforced:
            return 0
        try:
            with UsageRegion(self.region_dir(instance.id)) as usage:
                return usage.reap()
        except RegionError as e:  # repaired just before; never fatal for the daemon
            self._log.error("cannot reap ledgers", id=instance.id, error=str(e))
            return 0

    def _remove_orphan_regions(self) -> int:
        if not self._regions.is_dir():
            return 0
        active = {i.id for i in self._store.active()}
        orphans = [d for d in self._regions.iterdir() if d.is_dir() and d.name not in active]
        removed = 0
        for d in orphans:
            try:
                remove_region_dir(d)
                removed += 1
            except RegionError as e:  # counted as left, tried again at the next sweep
                self._log.error("cannot remove orphan region", dir=str(d), error=str(e))
        return removed


def _pidfd(pid: int) -> int | None:
    """A pidfd on the init a bind names (for an undo, then for the exit
    watch), or None if it cannot be opened: the watch then tries itself and
    says why, or releases at once if the init is gone."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None
