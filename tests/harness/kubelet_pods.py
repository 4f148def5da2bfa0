"""Plays the kubelet's pod-resources API (v1 PodResourcesLister.List) over
real gRPC on a unix socket, with a pod list the test changes."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc

from cgpud.api.k8s.podresources.v1 import api_pb2 as pb
from cgpud.api.k8s.podresources.v1 import api_pb2_grpc as pb_grpc


class KubeletPods(pb_grpc.PodResourcesListerServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], dict[str, tuple[str, tuple[str, ...]]]] = {}

    def hold(self, namespace: str, pod: str, container: str, resource: str, device_ids: tuple[str, ...]) -> None:
        with self._lock:
            self._pods.setdefault((namespace, pod), {})[container] = (resource, device_ids)

    def forget(self, namespace: str, pod: str) -> None:
        with self._lock:
            self._pods.pop((namespace, pod), None)

    def List(self, request: pb.ListPodResourcesRequest, context: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
        with self._lock:
            return pb.ListPodResourcesResponse(
                pod_resources=[
                    pb.PodResources(
                        namespace=ns,
                        name=name,
                        containers=[
                            pb.ContainerResources(
                                name=c, devices=[pb.ContainerDevices(resource_name=r, device_ids=list(ids))]
                            )
                            for c, (r, ids) in containers.items()
                        ],
                    )
                    for (ns, name), containers in self._pods.items()
                ]
            )


@contextmanager
def kubelet_pods() -> Iterator[tuple[KubeletPods, Path]]:
    directory = Path(tempfile.mkdtemp(prefix="pr-", dir="/tmp"))  # short: a unix socket path has 108 bytes
    path = directory / "kubelet.sock"
    lister = KubeletPods()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    assert server.add_insecure_port(f"unix:{path}") != 0
    server.start()
    try:
        yield lister, path
    finally:
        server.stop(None).wait(5)
        shutil.rmtree(directory, ignore_errors=True)
