"""A GPU container's life as cgpud sees it: prepared at create (the shim),
bound when its init process exists (the shim's bind, or the createRuntime
hook), released or handed back when that init exits (the instance service
watches it: node/exits.py). Decisions come from request.py, placement and
edits.py; this class only sequences them against the instance service and
the bundle on disk.

An instance the container's env asked for belongs to that container and is
released at its exit. An instance reserved beforehand and claimed by a
mount (device plugin, CDI) outlives the container: its exit hands it back
to `reserved`, since Kubernetes restarts a container with the same
allocation.

Containers are told apart by (engine namespace, id) (identity.py). A
poststop hook (written by an older version) changes only what its own
container holds: any other is a logged no-op that still answers ok, so runc
does not fail that container's delete."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from cgpud.node.model import GIB, Instance, InstanceState, Owner, OwnerKind, Request, isolates
from cgpud.node.service import InstanceService
from cgpud.errors import StateError, UsageError
from cgpud.containers.bundle import check_targets, check_volumes, read_spec, rootfs_path, write_spec
from cgpud.containers.edits import BIND_STAGE, CONTAINER_LIBRARY, PRELOAD, RELEASE_STAGE, RuntimeFiles, apply_edits
from cgpud.containers.edits import instance_edits
from cgpud.containers.placed import check_placed, read_mountinfo
from cgpud.containers.identity import ContainerKey, container_key
from cgpud.containers.request import CONTAINER_REGION, TOOLKIT_ENV, TOOLKIT_NONE, Claim, EnvRequest, read_request
from cgpud.containers.request import without_toolkit_devices

BIND_STAGES = (BIND_STAGE, "prestart")
# Where instance_edits mounts for an enforced instance.
ENFORCED_TARGETS = (CONTAINER_REGION, f"{CONTAINER_REGION}/usage", CONTAINER_LIBRARY, PRELOAD)


@dataclass(frozen=True)
class Prepared:
    instance: Instance | None  # None: no GPU request, bundle untouched

    def summary(self) -> str:
        return f"instance {self.instance.id}" if self.instance else "no GPU request"


class ContainerLifecycle:
    def __init__(self, service: InstanceService, files: RuntimeFiles, trust_env: bool) -> None:
        self._service = service
        self._files = files
        self._trust_env = trust_env
        self._log = structlog.get_logger("cgpud.containers")

    def prepare(self, container_id: str, bundle: Path, *, hooks: bool = True, spec_fd: int | None = None) -> Prepared:
        """Read the bundle's request, admit it, write the edits. On any
        failure after admission the instance is released again, so a refused
        start leaves nothing behind. hooks=False: the runtime shim binds and
        releases itself (bind/release requests), so no hook entry is written.
        spec_fd: the bundle's config.json as the shim opened it, before it
        put a FIFO at its path (the edits are still written to the path)."""
        key = container_key(container_id, bundle)
        if spec_fd is not None and not os.path.isdir(bundle):  # the spec came open: the path was not walked
            raise UsageError(f"bundle {bundle} is not a directory")
        spec = read_spec(bundle, spec_fd)
        ask = read_request(spec, trust_env=self._trust_env, regions=self._service.regions)
        if ask is None:
            neutral = without_toolkit_devices(spec) if isolates(self._service.policy().mode) else None
            if neutral is not None:
                write_spec(bundle, neutral)
                self._log.info(
                    "toolkit devices refused",
                    container=str(key),
                    reason=f"{TOOLKIT_ENV} without an instance; set to {TOOLKIT_NONE}",
                )
            return Prepared(None)
        created = isinstance(ask, EnvRequest)
        instance = self._admit(key, ask)
        try:
            # Recorded before the bundle names these files: their version's
            # directory then outlives an upgrade while the instance lives
            # (a created instance had it recorded with its row).
            if not created:
                self._service.use_runtime([instance.id], self._files.version)
            gpu_memory = {g.index: g.memory for g in self._service.gpus()}
            edits = instance_edits(
                instance,
                self._service.region_dir(instance.id),
                gpu_memory,
                self._files,
                hooks=hooks,
                mps_pipes=self._service.mps_pipes(),
            )
            targets = [m.destination for m in edits.mounts]
            rootfs = rootfs_path(bundle, spec)
            check_targets(rootfs, targets)
            check_volumes(rootfs, spec.get("mounts", []), targets, ours={m.destination for m in edits.mounts})
            write_spec(bundle, apply_edits(spec, edits, self._files, copy=False))
        except BaseException:
            if created:
                self._service.release(instance.id)
            raise
        self._log.info(
            "prepared",
            container=str(key),
            id=instance.id,
            claimed=not created,
            hooks=hooks,
            spec_fd=spec_fd is not None,
        )
        return Prepared(instance)

    def idle(self) -> None:
        """What waits until the runtime has its answer: the next instance's
        region, made ahead (InstanceService.refill_region_spare)."""
        self._service.refill_region_spare()

    def hook(
        self,
        stage: str,
        instance_id: str,
        state_json: bytes,
        decided: Callable[[str], None] = lambda text: None,
        *,
        created: bool = False,
    ) -> str:
        """`decided`: called with the answer once it is certain, before the
        work that cannot change it (InstanceService.bind_container, after the
        bind's checks; container_stopped).
        `created`: a bind after the runtime's create returned (the shim's),
        when the init has already moved into its root."""
        state = _parse_state(state_json)
        if stage in BIND_STAGES:
            key = container_key(state.get("id", ""), state.get("bundle", ""))
            pid = state.get("pid")
            if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
                raise UsageError(f"the {stage} state of container {key.id} has no init pid")
            try:
                instance = self._service.bind_container(
                    instance_id,
                    str(key),
                    pid,
                    check=lambda current: self._check_placed(current, key, pid, created),
                    decided=decided,
                )
            except UsageError:
                # Refused by the placement check: the container does not start, so its own instance goes.
                current = self._service.get(instance_id)
                if current.owner.kind is OwnerKind.CONTAINER and current.owner.id == str(key) and current.active:
                    self._service.release(instance_id)
                raise
            return f"bound {instance.id}"
        if stage == RELEASE_STAGE:
            try:
                key = container_key(state.get("id", ""), state.get("bundle", ""))
            except UsageError as e:
                # Failing would fail runc delete; the sweep frees the
                # instance once its processes are gone.
                self._log.warning("poststop ignored", id=instance_id, error=str(e))
                return f"nothing done: {e}"
            done, text = self._service.container_stopped(instance_id, str(key), decided)
            if not done:
                self._log.warning("poststop ignored", id=instance_id, container=str(key), reason=text)
            return text
        raise UsageError(f"cgpu-hook runs at {BIND_STAGE} and {RELEASE_STAGE}, not at {stage}")

    # ---- helpers ---------------------------------------------------------------------

    def _check_placed(self, instance: Instance, key: ContainerKey, pid: int, created: bool) -> None:
        """The mounts landed where the checks at prepare expected them
        (UsageError if not). The init's mount table names them under the
        rootfs while the runtime prepares it (createRuntime, prestart), and
        from its own root once `create` returned (pivot_root: the table then
        holds the container's mounts only)."""
        if not instance.enforced:
            return
        if created:
            rootfs = ""
            mounts = read_mountinfo(pid)
        else:
            rootfs = os.path.realpath(rootfs_path(Path(key.namespace), read_spec(Path(key.namespace))))
            mounts = read_mountinfo(pid, under=rootfs)
        if not check_placed(mounts, rootfs, ENFORCED_TARGETS):
            self._log.warning("mounts not in place yet at this hook: not checked", id=instance.id, container=str(key))

    def _admit(self, key: ContainerKey, ask: EnvRequest | Claim) -> Instance:
        if isinstance(ask, Claim):
            instance = self._service.get(ask.instance_id)
            if not instance.active:
                raise StateError(f"instance {instance.id} is released: reserve a new one")
            if instance.owner.kind is OwnerKind.CONTAINER and instance.owner.id != str(key):
                raise StateError(f"instance {instance.id} belongs to container {instance.owner.id}")
            _refuse_running(instance, key)
            return instance
        request = Request(
            Owner(OwnerKind.CONTAINER, str(key)),
            ask.memory_gib * GIB,
            ask.gpu_count,
            ask.core_percent,
            ask.weight,
            ask.priority,
        )
        instance = self._service.create(request, runtime_version=self._files.version)
        _refuse_running(instance, key)  # create handed back an existing one: nothing to undo
        return instance


def _refuse_running(instance: Instance, key: ContainerKey) -> None:
    """Its own instance comes back to a container only on a retried create,
    before it ran: a bound one means the same bundle and id are running
    under another runtime root, which would otherwise share it."""
    if instance.owner.kind is OwnerKind.CONTAINER and instance.state is InstanceState.BOUND:
        raise StateError(
            f"container {key.id} of bundle {key.namespace} already runs with instance {instance.id} "
            f"(under another runtime root?): give this container its own bundle"
        )


def _parse_state(data: bytes) -> dict[str, Any]:
    try:
        state = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # deep nesting recurses
        raise UsageError(f"the OCI state is not valid JSON: {e}") from e
    if not isinstance(state, dict):
        raise UsageError("the OCI state is not a JSON object")
    return state
