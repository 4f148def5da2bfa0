"""Releases follow pods: a pod-owned instance goes once its pod is gone.

"Gone" needs two witnesses that agree, so an outage of either can only
delay a release, never cause a wrong one:
- the API server: no pod with the instance's UID on this node, or the pod
  finished (Succeeded/Failed: the kubelet has freed its devices);
- the kubelet (pod-resources List): it lists no pod of that namespace and
  name, or the name now belongs to another pod (another UID on the API
  server: a StatefulSet's next pod), or the API server says it finished
  (a kubelet may still list a finished pod it has not cleaned up).
When either cannot be asked, nothing is released in that sweep.

An instance a running container holds (bound) is not released even then:
the daemon's own sweep hands it back once the container's processes are
gone, and the next sweep releases it.

A reservation (cgpu-scheduler's Reserve) goes with its pod too, from the
same one list of this node's pods: a pod there that finished or is being
deleted gives it back at once; a pod not there (deleted, bound elsewhere,
or never bound because the scheduler died between its Reserve and its
Binding) gives it back once it has been missing for RESERVATION_GRACE,
long after any bind completes. Either is sooner than its expiry, and costs
no API call per reservation."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from cgpud.node.model import Instance, InstanceState, OwnerKind, Reservation
from cgpud.node.service import InstanceService
from cgpud.errors import CgpuError
from cgpud.kube.allocator import SPEC_PREFIX
from cgpud.kube.apiserver import PodInfo
from cgpud.node.model import PodContainer


@dataclass(frozen=True)
class KubeletPod:
    namespace: str
    name: str


class _Listed(Protocol):
    @property
    def namespace(self) -> str: ...

    @property
    def pod(self) -> str: ...


def kubelet_pods(entries: Iterable[_Listed]) -> list[KubeletPod]:
    """The pods in the kubelet's pod-resources List (pod_resources.py entries)."""
    return sorted({KubeletPod(e.namespace, e.pod) for e in entries}, key=lambda p: (p.namespace, p.name))


def stale_specs(cdi_dir: Path, active_ids: Iterable[str]) -> list[Path]:
    """The pod instances' CDI spec files whose instance is no longer active
    (released here, by cgpuctl, or at a reboot's reconcile)."""
    keep = set(active_ids)
    try:
        names = sorted(p for p in cdi_dir.glob(f"{SPEC_PREFIX}*.json"))
    except OSError:
        return []
    return [p for p in names if p.name[len(SPEC_PREFIX) : -len(".json")] not in keep]


def gone_instances(
    instances: Iterable[Instance], api_pods: Sequence[PodInfo], kubelet_pods: Iterable[KubeletPod]
) -> list[Instance]:
    """The active pod-owned instances whose pods both witnesses say are gone."""
    by_uid = {p.uid: p for p in api_pods}
    by_name = {p.key: p for p in api_pods}
    listed = {f"{p.namespace}/{p.name}" for p in kubelet_pods}
    out = []
    for instance in instances:
        if instance.owner.kind is not OwnerKind.POD or not instance.active:
            continue
        if instance.state is InstanceState.BOUND:
            continue  # a running container holds it
        owner = PodContainer.parse(instance.owner.id)
        if owner is None:
            continue  # not one the allocator made: leave it to the operator
        pod = by_uid.get(owner.uid)
        api_gone = pod is None or pod.terminal
        if not api_gone:
            continue
        same_name = by_name.get(owner.pod_key)
        kubelet_gone = (
            owner.pod_key not in listed
            or (pod is not None and pod.terminal)
            or (same_name is not None and same_name.uid != owner.uid)
        )
        if kubelet_gone:
            out.append(instance)
    return out


# Seconds a reserved pod may be missing from this node's pods before its
# reservation goes: the scheduler binds within milliseconds of its Reserve.
RESERVATION_GRACE = 5.0


def gone_reservations(
    reservations: Iterable[Reservation],
    api_pods: Sequence[PodInfo],
    missing_since: Mapping[str, float],
    now: float,
    grace: float = RESERVATION_GRACE,
) -> tuple[list[Reservation], dict[str, float]]:
    """The reservations whose pods are gone, and when each reservation still
    kept was first seen without its pod (pod UID -> time), for the next round.
    `api_pods`: the API server's pods bound to this node."""
    by_uid = {p.uid: p for p in api_pods}
    gone: list[Reservation] = []
    missing: dict[str, float] = {}
    for reservation in reservations:
        pod = by_uid.get(reservation.pod_uid)
        if pod is not None:
            if pod.terminal or pod.deleting:
                gone.append(reservation)
            continue
        since = missing_since.get(reservation.pod_uid, now)
        if now - since >= grace:
            gone.append(reservation)
        else:
            missing[reservation.pod_uid] = since
    return gone, missing


class PodReleaser:
    """One release round per daemon sweep; `sweep()` is safe to call from
    the sweeper thread."""

    def __init__(
        self,
        service: InstanceService,
        list_api_pods: Callable[[], Sequence[PodInfo]],
        list_kubelet_pods: Callable[[], Iterable[KubeletPod]],
        cdi_dir: Path | None = None,
        *,
        reservation_grace: float = RESERVATION_GRACE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._service = service
        self._grace = reservation_grace
        self._clock = clock
        self._missing: dict[str, float] = {}  # reserved pods not yet seen on this node, since when
        self._api_pods = list_api_pods
        self._kubelet_pods = list_kubelet_pods
        self._cdi_dir = cdi_dir
        self._log = structlog.get_logger("cgpud.kube.releases")
        self._blind = ""  # the last reason a witness could not be asked, logged once

    def sweep(self) -> int:
        """Releases the instances of gone pods; returns how many."""
        try:
            return self._release_gone()
        finally:
            self._remove_stale_specs()

    def _release_gone(self) -> int:
        held, reservations = self._service.holdings()  # one store read for both
        active = [i for i in held if i.owner.kind is OwnerKind.POD]
        if not active and not reservations:
            self._missing = {}
            return 0
        try:
            api_pods = self._api_pods()
            kubelet_pods = list(self._kubelet_pods()) if active else []
        except (CgpuError, OSError) as e:
            reason = str(e)
            if reason != self._blind:
                self._log.warning(
                    "cannot tell which pods are gone: releasing nothing until both the API server "
                    "and the kubelet answer",
                    error=reason,
                )
            self._blind = reason
            return 0
        if self._blind:
            self._log.info("pod releases resume")
            self._blind = ""
        self._drop_gone_reservations(reservations, api_pods)
        gone = gone_instances(active, api_pods, kubelet_pods)
        for instance in gone:
            self._service.release(instance.id)
            self._log.info("released: pod gone", id=instance.id, owner=instance.owner.id)
        return len(gone)

    def _drop_gone_reservations(self, reservations: Sequence[Reservation], api_pods: Sequence[PodInfo]) -> None:
        gone, self._missing = gone_reservations(reservations, api_pods, self._missing, self._clock(), self._grace)
        for reservation in gone:
            if self._service.unreserve(reservation.pod_uid):
                self._log.info(
                    "reservation given back: pod gone",
                    pod=f"{reservation.pod_namespace}/{reservation.pod_name}",
                    uid=reservation.pod_uid,
                )

    def _remove_stale_specs(self) -> None:
        if self._cdi_dir is None:
            return
        for path in stale_specs(self._cdi_dir, (i.id for i in self._service.list())):
            try:
                path.unlink(missing_ok=True)
                self._log.info("CDI spec removed", path=str(path))
            except OSError as e:  # tried again at the next sweep
                self._log.error("cannot remove CDI spec", path=str(path), error=str(e))
