"""The device plugin's Allocator: an Allocate becomes a pod-owned instance
and the container's answer (a CDI device, env, mounts).

For aliyun.com/gpu-mem: resolve the container (assignment.py, over the pods
the API server lists on this node), create its instance on the scheduler's
GPUs, write the instance's CDI spec to the dynamic spec directory, mark the
pod ALIYUN_COM_GPU_MEM_ASSIGNED=true once each of its GPU containers has an
instance. Any failure after the instance is created undoes it: an Allocate
that fails leaves nothing behind.

A retried Allocate (the kubelet lost our answer) names the same devices for
the same live pod and gets the same instance back; the instance's owner
(pod UID and container) makes a second instance impossible anyway.
aliyun.com/gpu-core.percentage and aliyun.com/gpu-count create nothing (see
assignment.py); whole-GPU resources (nvidia.com/gpu, aliyun.com/gpu) name
their GPUs in their device IDs and get env only. So do MIG devices
(nvidia.com/mig-<profile>, or nvidia.com/gpu under the single strategy):
their device IDs are MIG UUIDs, and the answer names them as NVIDIA's device
plugin does (NVIDIA_VISIBLE_DEVICES=MIG-...) with their GPU's device nodes
and the MIG capability nodes the driver lists (mig_devices.py)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import structlog

from cgpud.node.model import GIB, Instance, Owner, OwnerKind, PodContainer, Request, Reservation
from cgpud.node.service import InstanceService
from cgpud.errors import CgpuError
from cgpud.containers import cdi
from cgpud.containers.edits import RuntimeFiles, instance_edits
from cgpud.containers.request import ENV_CORE
from cgpud.kube import assignment, mig_devices, share_priority
from cgpud.kube.apiserver import ApiServerError, ApiServerUnavailable, PodInfo
from cgpud.kube.model import ANNOTATION_ASSIGNED, ANNOTATION_GPU_INDEX, DEFAULT_CDI_DIR, DEFAULT_MIN_POD_PRIORITY
from cgpud.kube.model import TOOLKIT_DEVICE_LIST_DIR
from cgpud.kube.mig import ServedMig
from cgpud.kube.model import AllocationError, ContainerAllocation, MountSpec, Resource

DYNAMIC_CDI_DIR = Path(DEFAULT_CDI_DIR)
SPEC_PREFIX = "cgpu-pod-"  # one spec file per pod instance: cgpu-pod-<instance id>.json


class PodSource(Protocol):
    """What the allocator asks of the API server (apiserver.ApiServer)."""

    def pods_on_node(self, node: str) -> list[PodInfo]: ...

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> PodInfo: ...

    def warn_pod(self, pod: PodInfo, node: str, reason: str, message: str) -> None: ...


def spec_path(cdi_dir: Path, instance_id: str) -> Path:
    return cdi_dir / f"{SPEC_PREFIX}{instance_id}.json"


def remove_spec(cdi_dir: Path, instance_id: str) -> None:
    spec_path(cdi_dir, instance_id).unlink(missing_ok=True)


def device_list(uuids: Iterable[str]) -> tuple[MountSpec, ...]:
    """The NVIDIA toolkit's volume-mount device list: the GPUs a container
    gets when the toolkit is set to ignore env (cgpuctl runtime configure
    --nvidia-toolkit), which a pod spec cannot name. Besides env, which the
    toolkit honours when it is not so set."""
    return tuple(MountSpec("/dev/null", f"{TOOLKIT_DEVICE_LIST_DIR}/{u}", True) for u in uuids)


def _minor(device_node: str) -> bool:
    """Whether a GPU's node reads /dev/nvidia<minor>."""
    return device_node.startswith("/dev/nvidia") and device_node[len("/dev/nvidia") :].isdigit()


def pod_memory_gib(pod: PodInfo) -> int:
    """ALIYUN_COM_GPU_MEM_POD: what the pod's containers ask in all. Init
    containers run before the others, so the pod holds at most the larger."""
    init = max((c.limit(Resource.GPU_MEM) for c in pod.containers if c.init), default=0)
    return max(init, sum(c.limit(Resource.GPU_MEM) for c in pod.containers if not c.init))


@dataclass(eq=False)
class PodAllocator:
    """cgpud's Allocator (cgpud.kube.model.Allocator)."""

    service: InstanceService
    api: PodSource
    node: str
    files: RuntimeFiles
    cdi_dir: Path
    dev_root: Path
    # Pods below this priority may not ask for a compute weight or high priority (share_priority.py).
    min_pod_priority: int = DEFAULT_MIN_POD_PRIORITY
    # The MIG devices served (MIG UUID -> device), from the MIG strategy's plan.
    migs: dict[str, ServedMig] = field(default_factory=dict)
    # One Allocate at a time: resolution reads what the last one made.
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    # (resource, device IDs) -> instance id of answered memory Allocates, for retries.
    _answered: dict[tuple[Resource, frozenset[str]], str] = field(default_factory=dict, init=False, repr=False)
    _log: Any = field(default_factory=lambda: structlog.get_logger("cgpud.kube.allocator"), init=False, repr=False)

    def allocate(self, resource: Resource | str, device_ids: Sequence[str]) -> ContainerAllocation:
        count = assignment.check_count(device_ids, resource)
        with self._lock:
            if not isinstance(resource, Resource) or (
                resource is Resource.NVIDIA_GPU and any(d in self.migs for d in device_ids)
            ):
                return self._mig(str(resource.value if isinstance(resource, Resource) else resource), device_ids)
            if resource in (Resource.NVIDIA_GPU, Resource.GPU_TOPOLOGY):
                return self._whole_gpus(resource, device_ids)
            pods = self._pods()
            if resource is Resource.GPU_MEM:
                return self._memory(pods, count, frozenset(device_ids))
            pod, container = assignment.find_asker(pods, resource, count, self.node)
            self._log.info("allocated", resource=resource.value, count=count, pod=pod.key, container=container.name)
            return ContainerAllocation(envs={ENV_CORE: str(count)} if resource is Resource.GPU_CORE else {})

    # ---- memory: the instance ----------------------------------------------------------

    def _memory(self, pods: list[PodInfo], gib: int, ids: frozenset[str]) -> ContainerAllocation:
        retried = self._retried(pods, ids)
        if retried is not None:
            self._write_spec(retried)  # the spec may be what failed the first time
            return self._answer(retried, pods)
        pod_instances = [i for i in self.service.list() if i.owner.kind is OwnerKind.POD]
        held = {i.owner.id for i in pod_instances}
        live_ids = {i.id for i in pod_instances}  # answers of released instances are no retry's any more
        self._answered = {k: v for k, v in self._answered.items() if v in live_ids}
        try:
            resolution = assignment.resolve_memory(pods, gib, self.node, held)
        except assignment.Unresolved as e:
            self._warn_skipped(e.skipped)
            raise
        self._warn_skipped(resolution.skipped)
        chosen = resolution.assignment
        where = f"pod {chosen.pod.key} container {chosen.container}"
        try:
            share = share_priority.granted(chosen.pod, chosen.container, self.min_pod_priority)
        except CgpuError as e:
            raise AllocationError(str(e)) from e
        request = Request(
            Owner(OwnerKind.POD, chosen.owner.owner_id),
            chosen.memory_gib * GIB,
            chosen.gpu_count,
            chosen.core_percent,
            share.weight,
            share.priority,
            gpu_indexes=chosen.gpu_indexes,
            reservation=chosen.pod.uid,
        )
        # As it is before the instance draws on it: an undone Allocate puts it back.
        reserved = next((r for r in self.service.reservations() if r.pod_uid == chosen.pod.uid), None)
        try:
            instance = self.service.create(request)
        except CgpuError as e:  # does not fit, or a request the node refuses: the kubelet shows why
            raise AllocationError(f"{where}: {e}") from e
        complete = assignment.complete(chosen.pod, held | {chosen.owner.owner_id})
        try:
            self._write_spec(instance)
            if complete:
                self.api.annotate_pod(chosen.pod.namespace, chosen.pod.name, {ANNOTATION_ASSIGNED: "true"})
        except (CgpuError, OSError) as e:
            self._undo(instance, reserved)
            raise AllocationError(f"{where}: instance not kept: {e}") from e
        except BaseException:
            self._undo(instance, reserved)
            raise
        self._answered[(Resource.GPU_MEM, ids)] = instance.id
        if complete:
            self._drop_reservation(chosen.pod)
        self._log.info(
            "allocated",
            resource=Resource.GPU_MEM.value,
            id=instance.id,
            pod=chosen.pod.key,
            container=chosen.container,
            gpus=[g.gpu_index for g in instance.grants],
        )
        return self._answer(instance, pods)

    def _drop_reservation(self, pod: PodInfo) -> None:
        """Every container of the pod has its instance: what is left of the
        scheduler's reservation for it holds capacity nobody will use."""
        try:
            self.service.unreserve(pod.uid)
        except CgpuError as e:  # it expires on its own
            self._log.error("cannot drop the pod's reservation", pod=pod.key, error=str(e))

    def _retried(self, pods: list[PodInfo], ids: frozenset[str]) -> Instance | None:
        """The instance an earlier Allocate of these very devices made, while
        its pod lives: the kubelet frees devices only from finished pods."""
        instance_id = self._answered.get((Resource.GPU_MEM, ids))
        if instance_id is None:
            return None
        try:
            instance = self.service.get(instance_id)
        except CgpuError:
            instance = None
        owner = PodContainer.parse(instance.owner.id) if instance is not None else None
        if (
            instance is None
            or not instance.active
            or owner is None
            or not any(p.uid == owner.uid and assignment.live(p) for p in pods)
        ):
            del self._answered[(Resource.GPU_MEM, ids)]
            return None
        return instance

    def _answer(self, instance: Instance, pods: list[PodInfo]) -> ContainerAllocation:
        gpu_memory = {g.index: g.memory for g in self.service.gpus()}
        self.service.use_runtime([instance.id], self.files.version)  # before the edits leave (runtime_files.py)
        edits = instance_edits(
            instance, self.service.region_dir(instance.id), gpu_memory, self.files, mps_pipes=self.service.mps_pipes()
        )
        envs = dict(edits.env)
        owner = PodContainer.parse(instance.owner.id)
        pod = next((p for p in pods if owner is not None and p.uid == owner.uid), None)
        if pod is not None:
            envs["ALIYUN_COM_GPU_MEM_POD"] = str(pod_memory_gib(pod))
        mounts = tuple(MountSpec(m.source, m.destination, m.read_only) for m in edits.mounts)
        mounts += device_list(g.gpu_uuid for g in instance.grants)
        return ContainerAllocation(
            cdi_devices=(f"{cdi.KIND}={instance.id}",),
            envs=envs,
            mounts=mounts,
            annotations={"cgpu.io/instance": instance.id},
        )

    def _write_spec(self, instance: Instance) -> None:
        gpu_memory = {g.index: g.memory for g in self.service.gpus()}
        self.service.use_runtime([instance.id], self.files.version)  # before the edits leave (runtime_files.py)
        edits = instance_edits(
            instance,
            self.service.region_dir(instance.id),
            gpu_memory,
            self.files,
            device_nodes=cdi.instance_device_nodes(
                self.service.gpus(), [g.gpu_index for g in instance.grants], self.dev_root
            ),
            mps_pipes=self.service.mps_pipes(),
        )
        text = json.dumps(cdi.cdi_spec([edits]), indent=2) + "\n"
        cdi.write_spec(text, spec_path(self.cdi_dir, instance.id))

    def _undo(self, instance: Instance, reserved: Reservation | None = None) -> None:
        try:
            remove_spec(self.cdi_dir, instance.id)
        except OSError as e:
            self._log.error("cannot remove CDI spec", id=instance.id, error=str(e))
        self.service.release(instance.id, restore=reserved)

    # ---- helpers ---------------------------------------------------------------------

    def _warn_skipped(self, skipped: Sequence[assignment.Skipped]) -> None:
        """Each pod passed over gets a Warning event saying why; its owner
        fixes the annotation (the pod itself waits, as it would have)."""
        for s in skipped:
            self._log.warning("pod passed over", pod=s.pod.key, reason=s.reason)
            try:
                self.api.warn_pod(
                    s.pod,
                    self.node,
                    "CgpuAnnotationInvalid",
                    f"cgpud on {self.node} passed this pod over for a GPU share: {s.reason}",
                )
            except ApiServerError as e:  # the log line stays
                self._log.error("cannot record an event on the pod", pod=s.pod.key, error=str(e))

    def _pods(self) -> list[PodInfo]:
        try:
            return self.api.pods_on_node(self.node)
        except ApiServerUnavailable as e:
            raise AllocationError(
                f"cannot tell which pod this Allocate is for: {e}; the kubelet retries when the pod is created again"
            ) from e
        except ApiServerError as e:
            raise AllocationError(f"cannot tell which pod this Allocate is for: {e}") from e

    def _mig(self, resource: str, device_ids: Sequence[str]) -> ContainerAllocation:
        """MIG devices, each given whole to one container by the kubelet."""
        served = [self.migs.get(d) for d in device_ids]
        wrong = [d for d, s in zip(device_ids, served) if s is None or s.resource != resource]
        if wrong:
            raise AllocationError(f"{resource}: no MIG device {wrong[0]!r} of that resource on node {self.node}")
        devices = [s.device for s in served if s is not None]
        by_index = {g.index: g for g in self.service.gpus()}
        parents = sorted({m.parent_index for m in devices})
        nodes = cdi.instance_device_nodes(self.service.gpus(), [i for i in parents if i in by_index], self.dev_root)
        minors = {g.index: int(g.device_node[len("/dev/nvidia") :]) for g in by_index.values() if _minor(g.device_node)}
        caps = mig_devices.capability_nodes(devices, minors, self.dev_root)
        uuids = [m.uuid for m in devices]
        self._log.info("allocated", resource=resource, mig_devices=uuids)
        return ContainerAllocation(
            envs={"NVIDIA_VISIBLE_DEVICES": ",".join(uuids), ANNOTATION_GPU_INDEX: ",".join(map(str, parents))},
            mounts=device_list(uuids),
            devices=nodes + caps,
        )

    def _whole_gpus(self, resource: Resource, device_ids: Sequence[str]) -> ContainerAllocation:
        """Whole GPUs: the device IDs are GPU UUIDs and the kubelet alone
        keeps each GPU to one container."""
        by_uuid = {g.uuid: g.index for g in self.service.gpus()}
        unknown = [d for d in device_ids if d not in by_uuid]
        if unknown:
            raise AllocationError(f"{resource.value}: no GPU with UUID {unknown[0]!r} on node {self.node}")
        indexes = sorted(by_uuid[d] for d in device_ids)
        uuids = [u for i in indexes for u, j in by_uuid.items() if i == j]
        nodes = cdi.instance_device_nodes(self.service.gpus(), indexes, self.dev_root)
        return ContainerAllocation(
            envs={"NVIDIA_VISIBLE_DEVICES": ",".join(uuids), ANNOTATION_GPU_INDEX: ",".join(map(str, indexes))},
            mounts=device_list(uuids),
            devices=nodes,
        )
