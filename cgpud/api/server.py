"""The local gRPC server of cgpud: cgpu.v1.Local and grpc.health.v1 on a
root-only unix socket.

Only root may talk to cgpud here (no TLS, no tokens). The public socket is
0600 root in a 0700 directory, and cgpud binds it itself: every connection's
SO_PEERCRED is checked before a byte reaches gRPC, which listens on a private
socket behind it (cgpud/api/gate.py). The modes keep ordinary users out;
the check also refuses a non-root process that can pass them (one with
CAP_DAC_OVERRIDE, or a directory an operator opened up).
"""

from __future__ import annotations

import builtins
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cgpud.api import convert
from cgpud.api.gate import PeerGate, prepare_private_directory, private_socket_path
from cgpud.api.cgpu.v1 import local_pb2 as pb
from cgpud.api.cgpu.v1 import local_pb2_grpc as pb_grpc
from cgpud.api.status import abort_rpc
from cgpud.node import model
from cgpud.node.bypass_model import BypassEvents
from cgpud.node.mps import mps_pipe
from cgpud.errors import CgpuError, StateError, UsageError
from cgpud.sockets import prepare_socket_directory, remove_stale_socket

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Local"].full_name  # "cgpu.v1.Local"

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
_SUN_PATH_MAX = 107


class LocalService(Protocol):
    """What the server needs of the daemon (cgpud.node.service implements
    it). Methods raise cgpud.errors; anything else is a bug and is reported
    to the client as INTERNAL."""

    def create(self, request: model.Request, pid: int | None = None) -> model.Instance: ...

    def bind(self, instance_id: str, pids: tuple[int, ...], owner_id: str | None = None) -> model.Instance: ...

    def release(self, instance_id: str) -> model.Instance: ...

    def resize(
        self, instance_id: str, memory: int | None = None, core_percent: int | None = None
    ) -> model.Instance: ...

    def list(self, include_released: bool = False) -> builtins.list[model.Instance]: ...

    def get(self, instance_id: str) -> model.Instance: ...

    def region_dir(self, instance_id: str) -> Path: ...

    def mps_pipes(self) -> dict[int, Path]: ...

    def policy(self) -> model.NodePolicy: ...

    def set_compute_policy(self, policy: model.ComputePolicy, gpu: int | None = None) -> model.NodePolicy: ...

    def node_info(self) -> model.NodeInfo: ...


R = TypeVar("R")
Handler = Callable[["LocalServicer", Any], R]


def _rpc(method: Handler[R]) -> Callable[[LocalServicer, Any, grpc.ServicerContext], R]:
    """Run one RPC body and turn cgpud errors into status codes carrying the
    error's message. Request decoding happens inside the body, so a malformed
    request is INVALID_ARGUMENT like any other UsageError."""

    @functools.wraps(method)
    def handler(self: LocalServicer, request: Any, context: grpc.ServicerContext) -> R:
        try:
            return method(self, request)
        except Exception as e:  # CgpuError: its status; anything else is a bug, INTERNAL
            abort_rpc(context, self._log, method.__name__, e, "cgpud")

    return handler


# Renders the CDI spec of the daemon's device instances as JSON text.
CdiSpecProvider = Callable[[], str]
# Whether the bypass watchdog looks at the GPUs now, and why not.
WatchState = Callable[[], tuple[bool, str]]

NOT_WATCHING = "the bypass watchdog is not running"
# ListBypassEvents' answer when the request sets no limit.
DEFAULT_EVENT_LIMIT = 100


class LocalServicer(pb_grpc.LocalServicer):
    """cgpu.v1.Local over a LocalService: decode, call, encode."""

    def __init__(
        self,
        service: LocalService,
        cdi_spec: CdiSpecProvider | None = None,
        events: BypassEvents | None = None,
        watching: WatchState | None = None,
    ) -> None:
        self._service = service
        # A provider, not the service: the spec needs the runtime files the
        # daemon installs for containers, which the API knows nothing of.
        self._cdi_spec = cdi_spec
        self._events = events
        self._watching = watching
        self._log = structlog.get_logger("cgpud.api")

    def _instance(self, instance: model.Instance) -> pb.Instance:
        # A released instance's region files are removed with it: no path.
        region = self._service.region_dir(instance.id) if instance.active else None
        violations = self._events.count(instance.id) if self._events is not None else 0
        pipe = mps_pipe(instance, self._service.mps_pipes()) if instance.active else None
        return convert.instance_to_pb(instance, region, violations, pipe)

    @_rpc
    def CreateInstance(self, request: pb.CreateInstanceRequest) -> pb.Instance:
        req, pid = convert.request_from_pb(request)
        return self._instance(self._service.create(req, pid))

    @_rpc
    def BindInstance(self, request: pb.BindInstanceRequest) -> pb.Instance:
        instance_id, pids, owner_id = convert.bind_from_pb(request)
        return self._instance(self._service.bind(instance_id, pids, owner_id))

    @_rpc
    def ReleaseInstance(self, request: pb.ReleaseInstanceRequest) -> pb.Instance:
        return self._instance(self._service.release(request.id))

    @_rpc
    def ResizeInstance(self, request: pb.ResizeInstanceRequest) -> pb.Instance:
        memory = request.memory_bytes if request.HasField("memory_bytes") else None
        core = request.core_percent if request.HasField("core_percent") else None
        return self._instance(self._service.resize(request.id, memory, core))

    @_rpc
    def ListInstances(self, request: pb.ListInstancesRequest) -> pb.ListInstancesResponse:
        found = self._service.list(include_released=request.include_released)
        return pb.ListInstancesResponse(instances=[self._instance(i) for i in found])

    @_rpc
    def InspectInstance(self, request: pb.InspectInstanceRequest) -> pb.Instance:
        return self._instance(self._service.get(request.id))

    @_rpc
    def GetPolicy(self, request: pb.GetPolicyRequest) -> pb.Policy:
        return convert.policy_to_pb(self._service.policy())

    @_rpc
    def SetPolicy(self, request: pb.SetPolicyRequest) -> pb.Policy:
        policy = convert.compute_policy_from_int(request.compute_policy)
        gpu = request.gpu if request.HasField("gpu") else None
        return convert.policy_to_pb(self._service.set_compute_policy(policy, gpu))

    @_rpc
    def GetNodeInfo(self, request: pb.GetNodeInfoRequest) -> pb.NodeInfo:
        return convert.node_info_to_pb(self._service.node_info())

    @_rpc
    def GetCdiSpec(self, request: pb.GetCdiSpecRequest) -> pb.CdiSpec:
        if self._cdi_spec is None:
            raise StateError("this cgpud was started without container support: it has no CDI spec to give")
        return pb.CdiSpec(json=self._cdi_spec())

    @_rpc
    def ListBypassEvents(self, request: pb.ListBypassEventsRequest) -> pb.ListBypassEventsResponse:
        instance_id = request.instance_id or None
        if instance_id is not None:
            self._service.get(instance_id)  # NOT_FOUND for an id the daemon never had
        if self._events is None:
            return convert.bypass_listing_to_pb(convert.BypassListing((), False, NOT_WATCHING))
        watching, why = self._watching() if self._watching is not None else (True, "")
        events = self._events.recent(instance_id, request.limit or DEFAULT_EVENT_LIMIT)
        return convert.bypass_listing_to_pb(convert.BypassListing(tuple(events), watching, "" if watching else why))


class _Counting(grpc.ServerInterceptor):
    """Reports each unary call's method and status code (metrics)."""

    def __init__(self, on_request: Callable[[str, str], None]) -> None:
        self._on_request = on_request

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = details.method.rsplit("/", 1)[-1]
        inner, on_request = handler.unary_unary, self._on_request

        # ServicerContext.code() is grpc's (since 1.38); types-grpcio does not declare it.
        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                response = inner(request, context)
            except BaseException:
                on_request(method, (context.code() or grpc.StatusCode.UNKNOWN).name)  # type: ignore[attr-defined]
                raise
            on_request(method, (context.code() or grpc.StatusCode.OK).name)  # type: ignore[attr-defined]
            return response

        return grpc.unary_unary_rpc_method_handler(counted, handler.request_deserializer, handler.response_serializer)


class LocalServer:
    """The gRPC server and the gate in front of it."""

    def __init__(self, server: grpc.Server, gate: PeerGate) -> None:
        self.grpc_server = server
        self._gate = gate

    def stop(self, grace: float | None) -> threading.Event:
        """As grpc.Server.stop: the returned event is set once both are down."""
        self._gate.stop_accepting()
        stopped = self.grpc_server.stop(grace)
        finished = threading.Event()

        def finish() -> None:
            stopped.wait()
            self._gate.stop()
            finished.set()

        threading.Thread(target=finish, name="cgpud-api-stop", daemon=True).start()
        return finished


def serve(
    service: LocalService,
    socket_path: Path,
    *,
    max_workers: int = 8,
    health_servicer: health.HealthServicer | None = None,
    cdi_spec: CdiSpecProvider | None = None,
    on_request: Callable[[str, str], None] | None = None,
    events: BypassEvents | None = None,
    watching: WatchState | None = None,
) -> LocalServer:
    """Start serving on `unix:<socket_path>` and return the started server
    (stop it with `server.stop(grace)`). Pass `health_servicer` to keep a
    handle for flipping health to NOT_SERVING on shutdown
    (`health_servicer.enter_graceful_shutdown()`). `cdi_spec` answers
    GetCdiSpec; without it that RPC is FAILED_PRECONDITION. `on_request`
    hears every call's method and status code name ("OK", "NOT_FOUND").
    `events` is the bypass watchdog's ring (ListBypassEvents, each
    instance's violations) and `watching` says whether the watchdog looks
    now; without events ListBypassEvents is empty and says the watchdog is
    not running.

    Raises CgpuError when the path cannot be used: too long for a unix
    socket, a directory others can write to, a non-socket file in the way,
    or another live server already on it."""
    log = structlog.get_logger("cgpud.api")
    path = Path(os.path.abspath(socket_path))
    private = private_socket_path(path)
    if len(os.fsencode(private)) > _SUN_PATH_MAX:
        raise UsageError(
            f"socket path {path} is too long: cgpud also serves at {private}, and a unix socket "
            f"path allows {_SUN_PATH_MAX} bytes"
        )
    prepare_socket_directory(path.parent, log)
    remove_stale_socket(path, log)
    prepare_private_directory(private.parent)
    remove_stale_socket(private, log)

    interceptors: list[grpc.ServerInterceptor] = [_Counting(on_request)] if on_request is not None else []
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="cgpud-api"), interceptors=interceptors
    )
    pb_grpc.add_LocalServicer_to_server(LocalServicer(service, cdi_spec, events, watching), server)
    health_servicer = health_servicer or health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    try:
        # gRPC binds and listens here; start() only begins accepting.
        if server.add_insecure_port(f"unix:{private}") == 0:  # older grpcio reports failure as 0
            raise RuntimeError("bind failed")
        os.chmod(private, 0o600)
    except (RuntimeError, OSError) as e:
        server.stop(None)
        raise CgpuError(f"cannot listen on {private}: {e}") from e
    server.start()
    try:
        gate = PeerGate(path, private, log).start()
    except BaseException:
        server.stop(None)
        raise
    log.info("serving", socket=str(path), services=[SERVICE_NAME, health.SERVICE_NAME])
    return LocalServer(server, gate)
