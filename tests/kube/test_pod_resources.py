"""The pod-resources client against the kubelet's API served by the test
over real gRPC on a unix socket."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cgpud.api.k8s.podresources.v1 import api_pb2 as pb
from cgpud.api.k8s.podresources.v1 import api_pb2_grpc as pb_grpc
from cgpud.errors import CgpuError
from cgpud.kube.pod_resources import ContainerDevices, KubeletUnavailable, PodResourcesClient

UUID0 = "GPU-6a1e0c55-0000-4c3e-8f00-000000000000"


def _pod(namespace: str, name: str, *containers: pb.ContainerResources) -> pb.PodResources:
    return pb.PodResources(namespace=namespace, name=name, containers=list(containers))


PODS = [
    _pod(
        "ml",
        "train-0",
        pb.ContainerResources(
            name="main",
            devices=[
                pb.ContainerDevices(resource_name="aliyun.com/gpu-mem", device_ids=[f"{UUID0}-_-0", f"{UUID0}-_-1"]),
                pb.ContainerDevices(resource_name="aliyun.com/gpu-core.percentage", device_ids=[f"{UUID0}-_-c0"]),
            ],
            cpu_ids=[2, 3],
        ),
        pb.ContainerResources(name="sidecar"),
    ),  # holds nothing
    _pod("kube-system", "coredns-1", pb.ContainerResources(name="coredns")),
]


class Lister(pb_grpc.PodResourcesListerServicer):
    def List(self, request: pb.ListPodResourcesRequest, context: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
        return pb.ListPodResourcesResponse(pod_resources=PODS)

    def Get(self, request: pb.GetPodResourcesRequest, context: grpc.ServicerContext) -> pb.GetPodResourcesResponse:
        for pod in PODS:
            if (pod.namespace, pod.name) == (request.pod_namespace, request.pod_name):
                return pb.GetPodResourcesResponse(pod_resources=pod)
        context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found")
        raise AssertionError


@pytest.fixture
def kubelet_socket() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="pr-", dir="/tmp"))
    path = directory / "kubelet.sock"
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PodResourcesListerServicer_to_server(Lister(), server)
    assert server.add_insecure_port(f"unix:{path}") != 0
    server.start()
    yield path
    server.stop(None).wait(5)
    shutil.rmtree(directory, ignore_errors=True)


def test_list_gives_each_containers_devices_per_resource(kubelet_socket: Path) -> None:
    got = PodResourcesClient(kubelet_socket).list()
    assert got == [
        ContainerDevices("ml", "train-0", "main", "aliyun.com/gpu-mem", (f"{UUID0}-_-0", f"{UUID0}-_-1")),
        ContainerDevices("ml", "train-0", "main", "aliyun.com/gpu-core.percentage", (f"{UUID0}-_-c0",)),
    ]


def test_get_reads_one_pod(kubelet_socket: Path) -> None:
    client = PodResourcesClient(kubelet_socket)
    assert [d.resource for d in client.get("ml", "train-0")] == ["aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage"]
    assert client.get("kube-system", "coredns-1") == []
    with pytest.raises(CgpuError, match="refused Get \\(NOT_FOUND\\): pod ml/gone not found") as caught:
        client.get("ml", "gone")
    assert not isinstance(caught.value, KubeletUnavailable)  # an answer, not an outage


def test_no_kubelet_is_unavailable_not_an_empty_node(tmp_path: Path) -> None:
    with pytest.raises(KubeletUnavailable, match="does not exist"):
        PodResourcesClient(tmp_path / "kubelet.sock").list()


def test_a_dead_kubelet_socket_is_unavailable(kubelet_socket: Path) -> None:
    import socket

    dead = kubelet_socket.parent / "dead.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(dead))
    s.close()  # the file stays, nothing listens: what a killed kubelet leaves
    with pytest.raises(KubeletUnavailable, match="did not answer List"):
        PodResourcesClient(dead, timeout=2.0).list()
