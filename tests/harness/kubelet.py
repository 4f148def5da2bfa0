"""A fake kubelet's device-plugin side: it serves v1beta1.Registration on
<dir>/kubelet.sock, records Register calls and restarts the way a kubelet
does (its socket and every plugin socket go, a new kubelet.sock appears)."""

from __future__ import annotations

import queue
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
