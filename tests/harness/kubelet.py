"""A fake kubelet's device-plugin side: it serves v1beta1.Registration on
<dir>/kubelet.sock, records Register calls and restarts the way a kubelet
does (its socket and every plugin socket go, a new kubelet.sock appears);
the calls a kubelet makes on a plugin's socket; and the cgpud command line
that points a node's cgpud at such a kubelet."""

from __future__ import annotations

import queue
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2 as pb
from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc

WAIT = 10.0  # seconds any one expected registration may take


class Kubelet(pb_grpc.RegistrationServicer):
    """The kubelet's side: Registration on <dir>/kubelet.sock."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.registered: queue.Queue[pb.RegisterRequest] = queue.Queue()
        self.refuse: str | None = None
        self._server: grpc.Server | None = None

    @property
    def socket(self) -> Path:
        return self.directory / "kubelet.sock"

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        if self.refuse is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refuse)
        self.registered.put(request)
        return pb.Empty()

    def start(self) -> Kubelet:
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(self, self._server)
        assert self._server.add_insecure_port(f"unix:{self.socket}") != 0
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None).wait(WAIT)
            self._server = None
        self.socket.unlink(missing_ok=True)

    def restart(self) -> None:
        """What a kubelet restart does to the directory: its socket goes,
        every plugin socket is deleted, a new kubelet.sock appears."""
        self.stop()
        for path in self.directory.glob("*.sock"):
            path.unlink()
        self.start()

    def take_registrations(self, count: int) -> list[pb.RegisterRequest]:
        return [self.registered.get(timeout=WAIT) for _ in range(count)]


def cgpud_kube_args(plugins: Path, pod_resources: Path, kubeconfig: Path, node: str, cdi_dir: Path) -> list[str]:
    """cgpud's arguments for a Kubernetes node whose kubelet (device-plugin
    directory, pod-resources socket) and API server the test plays."""
    return [
        "--orchestrator",
        "kubernetes",
        "--device-plugin-dir",
        str(plugins),
        "--pod-resources-socket",
        str(pod_resources),
        "--kubeconfig",
        str(kubeconfig),
        "--node-name",
        node,
        "--cdi-dir",
        str(cdi_dir),
    ]


def first_device_ids(plugin: Path, timeout: float = WAIT) -> list[str]:
    """The device ids of the first list ListAndWatch sends on a plugin's socket."""
    with grpc.insecure_channel(f"unix:{plugin}") as channel:
        stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=timeout)
        first = next(iter(stream))
        stream.cancel()
    return [d.ID for d in first.devices]


def allocate(plugin: Path, ids: Sequence[str], timeout: float = WAIT) -> pb.ContainerAllocateResponse:
    """The kubelet's Allocate for one container of the given device ids."""
    with grpc.insecure_channel(f"unix:{plugin}") as channel:
        answer = pb_grpc.DevicePluginStub(channel).Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))]),
            timeout=timeout,
        )
    [container] = answer.container_responses
    return container
