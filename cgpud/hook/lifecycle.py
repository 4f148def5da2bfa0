"""A GPU container's life as cgpud sees it: prepared at create (the shim),
bound when its init process exists (createRuntime hook), released or handed
back at poststop. Decisions come from request.py, placement and edits.py;
this class only sequences them against the instance service and the
bundle on disk.

An instance the container's env asked for belongs to that container and is
released at poststop. An instance reserved beforehand and claimed by a
mount (device plugin, CDI) outlives the container: poststop hands it back
to `reserved`, since Kubernetes restarts a container with the same
allocation."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from cgpud.daemon.model import GIB, Instance, InstanceState, Owner, OwnerKind, Request
from cgpud.daemon.service import InstanceService
from cgpud.errors import NotFoundError, StateError, UsageError
from cgpud.hook.bundle import check_targets, read_spec, rootfs_path, write_spec
from cgpud.hook.edits import BIND_STAGE, RELEASE_STAGE, RuntimeFiles, apply_edits, instance_edits
from cgpud.hook.request import Claim, EnvRequest, read_request

_CONTAINER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,1023}$")
BIND_STAGES = (BIND_STAGE, "prestart")


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

    def prepare(self, container_id: str, bundle: Path) -> Prepared:
        """Read the bundle's request, admit it, write the edits. On any
        failure after admission the instance is released again, so a refused
        start leaves nothing behind."""
        if not _CONTAINER_ID.match(container_id):
            raise UsageError(f"container id {container_id!r} is not a valid OCI container id")
        spec = read_spec(bundle)
        ask = read_request(spec, trust_env=self._trust_env, regions=self._service.regions)
        if ask is None:
            return Prepared(None)
        created = isinstance(ask, EnvRequest)
        instance = self._admit(container_id, ask)
        try:
            gpu_memory = {g.index: g.memory for g in self._service.gpus()}
            edits = instance_edits(instance, self._service.region_dir(instance.id), gpu_memory, self._files)
            check_targets(rootfs_path(bundle, spec), [m.destination for m in edits.mounts])
            write_spec(bundle, apply_edits(spec, edits, self._files))
        except BaseException:
            if created:
                self._service.release(instance.id)
            raise
        self._log.info("prepared", container=container_id, id=instance.id, claimed=not created)
        return Prepared(instance)

    def hook(self, stage: str, instance_id: str, state_json: bytes) -> str:
        state = _parse_state(state_json)
        container_id = str(state.get("id", ""))
        if stage in BIND_STAGES:
            pid = state.get("pid")
            if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
                raise UsageError(f"the {stage} state of container {container_id} has no init pid")
            instance = self._service.bind_container(instance_id, container_id, pid)
            return f"bound {instance.id}"
        if stage == RELEASE_STAGE:
            return self._finish(instance_id, container_id)
        raise UsageError(f"cgpu-hook runs at {BIND_STAGE} and {RELEASE_STAGE}, not at {stage}")

    # ---- helpers ---------------------------------------------------------------------

    def _admit(self, container_id: str, ask: EnvRequest | Claim) -> Instance:
        if isinstance(ask, Claim):
            instance = self._service.get(ask.instance_id)
            if not instance.active:
                raise StateError(f"instance {instance.id} is released: reserve a new one")
            if instance.owner.kind is OwnerKind.CONTAINER and instance.owner.id != container_id:
                raise StateError(f"instance {instance.id} belongs to container {instance.owner.id}")
            return instance
        request = Request(
            Owner(OwnerKind.CONTAINER, container_id), ask.memory_gib * GIB, ask.gpu_count, ask.core_percent,
            ask.weight, ask.priority)
        return self._service.create(request)

    def _finish(self, instance_id: str, container_id: str) -> str:
        try:
            instance = self._service.get(instance_id)
        except NotFoundError:
            return "nothing to release"  # a retried poststop after a purge
        if instance.owner.kind is OwnerKind.CONTAINER:
            if instance.owner.id != container_id:
                raise StateError(f"instance {instance_id} belongs to container {instance.owner.id}, not {container_id}")
            self._service.release(instance_id)
            return f"released {instance_id}"
        if instance.state is InstanceState.BOUND:
            self._service.unbind(instance_id)
        return f"returned {instance_id}"


def _parse_state(data: bytes) -> dict[str, Any]:
    try:
        state = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"the OCI state is not valid JSON: {e}") from e
    if not isinstance(state, dict):
        raise UsageError("the OCI state is not a JSON object")
    return state

