"""Pod resizes carried out: each sweep, the resize annotations of the pods
that hold instances here (cgpud/kube/pod_resize.py) become resizes of
those instances, answered by an event on the pod: Normal `Resized`, or
Warning `ResizeRefused` with the reason. Each request is acted on once: a
refused one is not retried until the pod's annotations change (or cgpud
restarts)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from cgpud.errors import CgpuError
from cgpud.kube.apiserver import LazyApiServer, PodInfo
from cgpud.kube.pod_resize import pod_resizes
from cgpud.node.model import Instance, OwnerKind
from cgpud.node.service import InstanceService
from cgpud.units import format_memory


class PodResizer:
    def __init__(
        self,
        service: InstanceService,
        api: LazyApiServer,
        node: str,
        list_api_pods: Callable[[], Sequence[PodInfo]],
        min_pod_priority: int,
    ) -> None:
        self._service = service
        self._api = api
        self._node = node
        self._api_pods = list_api_pods
        self._min_pod_priority = min_pod_priority
        self._acted: dict[str, str] = {}  # instance id -> the request last acted on
        self._log = structlog.get_logger("cgpud.kube.resize")

    def sweep(self) -> int:
        """Carries out the resizes asked since the last sweep; how many were done."""
        held, _ = self._service.holdings()
        pods_held = [i for i in held if i.active and i.owner.kind is OwnerKind.POD]
        self._acted = {k: v for k, v in self._acted.items() if any(i.id == k for i in pods_held)}
        if not pods_held:
            return 0
        try:
            api_pods = self._api_pods()
        except (CgpuError, OSError):
            return 0  # the releaser says the API server is away
        resizes, refusals = pod_resizes(api_pods, pods_held, self._min_pod_priority)
        for r in refusals:
            key = r.asked_text or r.message
            if self._acted.get(r.instance.id) != key:
                self._acted[r.instance.id] = key
                self._tell(r.pod, "ResizeRefused", r.message, "Warning")
        done = 0
        for resize in resizes:
            if self._acted.get(resize.instance.id) == resize.asked.text:
                continue
            self._acted[resize.instance.id] = resize.asked.text
            try:
                after = self._service.resize(resize.instance.id, resize.asked.memory, resize.asked.core_percent)
            except CgpuError as e:
                self._log.warning("pod resize refused", pod=resize.pod.key, id=resize.instance.id, error=str(e))
                self._tell(resize.pod, "ResizeRefused", f"container {resize.container}: {e}", "Warning")
                continue
            done += 1
            self._tell(resize.pod, "Resized", f"container {resize.container}: {_share(after)}", "Normal")
        return done

    def _tell(self, pod: PodInfo, reason: str, message: str, kind: str) -> None:
        try:
            self._api.event_pod(pod, self._node, reason, message, kind)
        except (CgpuError, OSError) as e:
            self._log.warning("cannot record a resize event", pod=pod.key, error=str(e))


def _share(instance: Instance) -> str:
    g = instance.grants[0]
    core = f" and {g.core_percent}% compute" if g.core_percent else ""
    return f"{format_memory(g.memory)} per GPU{core} (instance {instance.id})"
