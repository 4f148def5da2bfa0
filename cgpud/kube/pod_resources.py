"""Client of the kubelet's pod-resources API (v1): which containers on this
node hold which devices of which extended resource. It names pods by
namespace and name (it has no UIDs) and lists only pods the kubelet still
runs, which is how releases learn that a pod is gone."""

from __future__ import annotations

import builtins
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from cgpud.api.k8s.podresources.v1 import api_pb2 as pb
from cgpud.api.k8s.podresources.v1 import api_pb2_grpc as pb_grpc
from cgpud.errors import CgpuError
from cgpud.kube.model import DEFAULT_POD_RESOURCES_SOCKET


class KubeletUnavailable(CgpuError):
    """The kubelet's pod-resources socket did not answer. Callers must
    treat what it would have said as unknown (release nothing), not as
    "no pods"."""


@dataclass(frozen=True)
class ContainerDevices:
    """The devices of one resource one container holds."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class PodResourcesClient:
    """Calls PodResourcesLister on the kubelet's socket; each call opens
    and closes its own channel, so a kubelet restart between calls needs
    nothing from the caller."""

    def __init__(self, socket_path: Path | str = DEFAULT_POD_RESOURCES_SOCKET, timeout: float = 5.0) -> None:
        self._path = Path(os.path.abspath(socket_path))
        self._timeout = timeout

    def list(self) -> list[ContainerDevices]:
        """Every container's devices, one entry per (container, resource);
        containers with no devices are left out."""
        response = self._call("List", pb.ListPodResourcesRequest())
        return [d for pod in response.pod_resources for d in _devices(pod)]

    def get(self, namespace: str, pod: str) -> builtins.list[ContainerDevices]:
        """One pod's container devices (kubelet feature KubeletPodResourcesGet,
        on by default from 1.34). A pod the kubelet does not run is an
        error from the kubelet (NOT_FOUND or INVALID_ARGUMENT by version)."""
        response = self._call("Get", pb.GetPodResourcesRequest(pod_name=pod, pod_namespace=namespace))
        return _devices(response.pod_resources)

    def _call(self, method: str, request: object) -> Any:
        if not self._path.exists():
            raise KubeletUnavailable(
                f"the kubelet's pod-resources socket {self._path} does not exist: "
                "is the kubelet running, and is the directory mounted into cgpud's pod?"
            )
        try:
            with grpc.insecure_channel(f"unix:{self._path}") as channel:
                stub = pb_grpc.PodResourcesListerStub(channel)
                return getattr(stub, method)(request, timeout=self._timeout)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            detail = e.details() if isinstance(e, grpc.Call) else str(e)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise KubeletUnavailable(
                    f"the kubelet's pod-resources API on {self._path} did not answer {method}: {detail}"
                ) from e
            name = code.name if code is not None else "error"
            raise CgpuError(
                f"the kubelet's pod-resources API on {self._path} refused {method} ({name}): {detail}"
            ) from e


def _devices(pod: pb.PodResources) -> list[ContainerDevices]:
    return [
        ContainerDevices(pod.namespace, pod.name, container.name, d.resource_name, tuple(d.device_ids))
        for container in pod.containers
        for d in container.devices
    ]
