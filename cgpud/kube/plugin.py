"""cgpud's kubelet device plugin (API v1beta1): one gRPC server per
extended resource on `<device_plugin_dir>/cgpu-<name>.sock`, registered with
the kubelet's `kubelet.sock` in the same directory.

Every resource of every mode is served (cgpud/kube/resources.py says which
have devices), so a node whose mode changes shows the new capacity and none
of the old. The device lists change through `DevicePlugin.update()`, which
the parts that learn of a change call (node labels, GPU health, inventory);
every open ListAndWatch stream then sends the new list.

A kubelet restart deletes every plugin socket and recreates kubelet.sock. A
watcher thread notices either (it compares the sockets' inodes once per
`watch_interval`), serves again on fresh sockets and registers again.
Instances live in cgpud's store, not here: nothing about them changes.
"""

from __future__ import annotations

import functools
import os
import stat
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import structlog

from cgpud.node.topology import Links
from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2 as pb
from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from cgpud.api.status import abort_rpc
from cgpud.node.model import GpuCapacity, NodeMode, Placement
from cgpud.errors import CgpuError, UsageError
from cgpud.kube import resources
from cgpud.kube.mig import MigPlan
from cgpud.kube.model import DEVICE_PLUGIN_VERSION, Allocator, ContainerAllocation, Resource
from cgpud.kube.resources import PluginDevice, PluginGpu
from cgpud.sockets import remove_stale_socket

KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
_SUN_PATH_MAX = 107
# A ListAndWatch stream re-checks that it is still wanted this often even
# when nothing wakes it (a lost wake-up costs at most this much).
_STREAM_POLL = 1.0

R = TypeVar("R")


class _State:
    """The node facts the device lists are made of, and the lists, behind
    one condition so that open ListAndWatch streams wake on a change."""

    def __init__(
        self,
        mode: NodeMode | str,
        placement: Placement,
        gpus: Sequence[GpuCapacity],
        health: Mapping[int, bool],
        links: Links | None = None,
        mig: MigPlan | None = None,
    ) -> None:
        self.changed = threading.Condition()
        self.links = links  # how the GPUs are joined (inventory), for whole-GPU choices
        self._mode = mode
        self._placement = placement
        self._gpus = tuple(gpus)
        self._health = dict(health)
        self._mig = mig
        self.devices = self._compute()

    def _compute(self) -> dict[str, tuple[PluginDevice, ...]]:
        # A MIG device taken as a GPU (mig_share) is as healthy as the GPU it is on.
        gpus = [
            PluginGpu(g.index, g.uuid, g.memory, self._health.get(g.parent if g.parent >= 0 else g.index, True))
            for g in self._gpus
        ]
        return resources.advertised(self._mode, gpus, self._mig)

    def names(self) -> list[str]:
        """Every resource served: cgpu's own, then the MIG plan's."""
        with self.changed:
            return list(self.devices)

    def update(
        self,
        mode: NodeMode | str | None,
        placement: Placement | None,
        gpus: Sequence[GpuCapacity] | None,
        health: Mapping[int, bool] | None,
        mig: MigPlan | None = None,
    ) -> list[str]:
        """Apply what is given; return the resources whose lists changed."""
        with self.changed:
            if mode is not None:
                resources.resources_for(mode)  # an unknown mode is refused before anything changes
                self._mode = mode
            if placement is not None:
                self._placement = Placement(placement)
            if gpus is not None:
                self._gpus = tuple(gpus)
            if health is not None:
                self._health = dict(health)
            if mig is not None:
                self._mig = mig
            new = self._compute()
            moved = [r for r in dict.fromkeys([*self.devices, *new]) if new.get(r) != self.devices.get(r)]
            self.devices = new
            if moved:
                self.changed.notify_all()
            return moved

    def wake(self) -> None:
        with self.changed:
            self.changed.notify_all()

    @property
    def placement(self) -> Placement:
        return self._placement

    def gpu_order(self) -> dict[str, int]:
        return {g.uuid: g.index for g in self._gpus}


def _rpc(method: Callable[[Any, Any, grpc.ServicerContext], R]) -> Callable[[Any, Any, grpc.ServicerContext], R]:
    """Turn cgpud errors into a status the kubelet shows in the pod's
    events: AllocationError (a UsageError) is INVALID_ARGUMENT, a request
    that does not fit RESOURCE_EXHAUSTED, each with its one-line message."""

    @functools.wraps(method)
    def handler(self: DevicePluginServicer, request: Any, context: grpc.ServicerContext) -> R:
        try:
            return method(self, request, context)
        except Exception as e:  # CgpuError: its status; anything else is a bug, INTERNAL
            abort_rpc(context, self._log, method.__name__, e, "cgpud's device plugin")

    return handler


def allocation_to_pb(allocation: ContainerAllocation) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=dict(allocation.envs),
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in allocation.mounts
        ],
        annotations=dict(allocation.annotations),
        cdi_devices=[pb.CDIDevice(name=name) for name in allocation.cdi_devices],
        devices=[
            pb.DeviceSpec(container_path=d.path, host_path=d.on_host, permissions="rw") for d in allocation.devices
        ],
    )


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """v1beta1.DevicePlugin for one resource."""

    def __init__(self, resource: str, state: _State, allocator: Allocator, stopped: threading.Event) -> None:
        known = {r.value: r for r in Resource}
        self._resource: Resource | str = known.get(resource, resource)
        self._state = state
        self._allocator = allocator
        self._stopped = stopped  # set when this server is being replaced or stopped
        self._log = structlog.get_logger("cgpud.kube.plugin").bind(resource=resource)

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return _OPTIONS

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        context.add_callback(self._state.wake)  # the kubelet went away: end the stream now
        sent: tuple[PluginDevice, ...] | None = None
        while True:
            with self._state.changed:
                while True:
                    ended = self._stopped.is_set() or not context.is_active()
                    devices = self._state.devices.get(self._resource, ())
                    if ended or devices != sent:
                        break
                    self._state.changed.wait(_STREAM_POLL)
            if ended:
                return
            sent = devices
            self._log.info(
                "sending device list", devices=len(devices), unhealthy=sum(1 for d in devices if not d.healthy)
            )
            yield pb.ListAndWatchResponse(
                devices=[pb.Device(ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY) for d in devices]
            )

    @_rpc
    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        placement, order = self._state.placement, self._state.gpu_order()
        answers = []
        for req in request.container_requests:
            ids = resources.preferred(
                self._resource,
                list(req.available_deviceIDs),
                list(req.must_include_deviceIDs),
                req.allocation_size,
                placement,
                order,
                self._state.links,
            )
            answers.append(pb.ContainerPreferredAllocationResponse(deviceIDs=list(ids)))
        return pb.PreferredAllocationResponse(container_responses=answers)

    @_rpc
    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        devices = self._state.devices.get(self._resource, ())
        answers = []
        for req in request.container_requests:
            ids = tuple(req.devices_ids)
            if not ids:
                raise UsageError(f"Allocate for {resources.name_of(self._resource)} named no devices")
            resources.check_device_ids(self._resource, ids, devices)
            allocation = self._allocator.allocate(self._resource, ids)
            self._log.info("allocated", devices=len(ids), cdi_devices=list(allocation.cdi_devices))
            answers.append(allocation_to_pb(allocation))
        return pb.AllocateResponse(container_responses=answers)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


_OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


@dataclass(frozen=True)
class _Endpoint:
    """One resource's server and the socket file it made."""

    resource: str
    path: Path
    server: grpc.Server
    pool: ThreadPoolExecutor
    stopped: threading.Event
    inode: tuple[int, int]


def _socket_identity(path: Path) -> tuple[int, int, int] | None:
    """(device, inode, ctime) of a socket file, None when there is none:
    a recreated socket differs even when the inode number is reused."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


@dataclass(frozen=True)
class PluginSettings:
    directory: Path  # the kubelet's device-plugins directory
    watch_interval: float = 1.0  # seconds between looks at the sockets
    register_timeout: float = 5.0  # seconds one Register may take
    max_workers: int = 4  # per resource: one ListAndWatch stream holds one


class DevicePlugin:
    """All of cgpud's device plugin endpoints. start(), update() from any
    thread, stop()."""

    def __init__(
        self,
        settings: PluginSettings,
        allocator: Allocator,
        *,
        mode: NodeMode | str,
        placement: Placement,
        gpus: Sequence[GpuCapacity],
        health: Mapping[int, bool] | None = None,
        links: Links | None = None,
        mig: MigPlan | None = None,
    ) -> None:
        self._settings = replace(settings, directory=Path(os.path.abspath(settings.directory)))
        # The sockets it will serve: cgpu's, and the MIG profiles this node has.
        served_mig = mig.resources() if mig is not None else ()
        for name in [*resources.SOCKET_NAMES.values(), *(resources.socket_name(r) for r in served_mig)]:
            path = self._settings.directory / name
            if len(os.fsencode(path)) > _SUN_PATH_MAX:
                raise UsageError(
                    f"device plugin directory {self._settings.directory} is too long: the socket "
                    f"{path} exceeds the {_SUN_PATH_MAX} bytes a unix socket path may have"
                )
        self._allocator = allocator
        self._state = _State(mode, placement, gpus, health or {}, links, mig)
        self._log = structlog.get_logger("cgpud.kube.plugin")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._endpoints: dict[str, _Endpoint] = {}
        self._registered_with: tuple[int, int, int] | None = None
        self._last_problem = ""
        self.registrations = 0  # completed rounds of Register, for tests and metrics

    @property
    def kubelet_socket(self) -> Path:
        return self._settings.directory / KUBELET_SOCKET

    def socket_path(self, resource: Resource | str) -> Path:
        return self._settings.directory / resources.socket_name(resource)

    def devices(self, resource: Resource | str) -> tuple[PluginDevice, ...]:
        return self._state.devices.get(resources.name_of(resource), ())

    def start(self) -> DevicePlugin:
        self._thread = threading.Thread(target=self._watch, name="cgpud-device-plugin", daemon=True)
        self._thread.start()
        return self

    def update(
        self,
        *,
        mode: NodeMode | str | None = None,
        placement: Placement | None = None,
        gpus: Sequence[GpuCapacity] | None = None,
        health: Mapping[int, bool] | None = None,
        mig: MigPlan | None = None,
    ) -> None:
        """A node fact changed. `health` maps GPU index to healthy and
        replaces the previous map (a GPU it lacks is healthy). Open
        ListAndWatch streams send the lists that changed."""
        moved = self._state.update(mode, placement, gpus, health, mig)
        if moved:
            self._log.info("device lists changed", resources=moved)

    def stop(self, grace: float = 1.0) -> None:
        """Stop watching and serving; returns within about grace + the
        watcher's own bound (one Register timeout)."""
        self._stop.set()
        self._state.wake()
        if self._thread is not None:
            self._thread.join(self._settings.register_timeout + self._settings.watch_interval + 1.0)
        self._stop_endpoints(grace)

    # The watcher: serve while the kubelet is there, register with each
    # kubelet once.

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self._reconcile()
            except CgpuError as e:  # keep watching: the next look may succeed
                self._problem("device plugin cannot serve yet; retrying", error=str(e))
            except Exception as e:  # a bug: keep its traceback, and keep watching
                self._problem("device plugin round failed", error=f"{type(e).__name__}: {e}", exc_info=True)
            self._stop.wait(self._settings.watch_interval)

    def _reconcile(self) -> None:
        kubelet = _socket_identity(self.kubelet_socket)
        if kubelet is None:
            if self._registered_with is not None:
                self._log.warning("kubelet socket is gone: waiting for the kubelet", socket=str(self.kubelet_socket))
                self._registered_with = None
            else:
                self._problem("no kubelet socket yet: waiting for the kubelet", socket=str(self.kubelet_socket))
            return
        ours_intact = set(self._endpoints) == set(self._state.names()) and all(
            (ident := _socket_identity(e.path)) is not None and ident[:2] == e.inode for e in self._endpoints.values()
        )
        if ours_intact and kubelet == self._registered_with:
            return
        if self._registered_with is not None or not ours_intact:
            # A new kubelet (it deleted our sockets, or will not know our old
            # streams), or a first start: fresh servers on fresh sockets.
            self._restart_endpoints()
        self._register_all(kubelet)

    def _restart_endpoints(self) -> None:
        self._stop_endpoints(grace=0.5)
        names = self._state.names()
        for resource in names:
            if self._stop.is_set():
                return
            self._endpoints[resource] = self._serve(resource)
        self._log.info("device plugin serving", directory=str(self._settings.directory), resources=names)

    def _serve(self, resource: str) -> _Endpoint:
        path = self.socket_path(resource)
        remove_stale_socket(path, self._log)
        stopped = threading.Event()
        pool = ThreadPoolExecutor(max_workers=self._settings.max_workers, thread_name_prefix=f"cgpud-dp-{path.stem}")
        server = grpc.server(pool)
        pb_grpc.add_DevicePluginServicer_to_server(
            DevicePluginServicer(resource, self._state, self._allocator, stopped), server
        )
        try:
            if server.add_insecure_port(f"unix:{path}") == 0:
                raise RuntimeError("bind failed")
            # Only the kubelet (root) may Allocate: anyone else could make instances.
            os.chmod(path, 0o600)
            st = path.lstat()
        except (RuntimeError, OSError) as e:
            server.stop(None)
            pool.shutdown(wait=False)
            raise CgpuError(f"cannot serve the device plugin for {resource} on {path}: {e}") from e
        server.start()
        return _Endpoint(resource, path, server, pool, stopped, (st.st_dev, st.st_ino))

    def _stop_endpoints(self, grace: float) -> None:
        endpoints, self._endpoints = list(self._endpoints.values()), {}
        for e in endpoints:
            e.stopped.set()
        self._state.wake()
        done = [e.server.stop(grace) for e in endpoints]
        for e, event in zip(endpoints, done):
            event.wait(grace + 1.0)
            e.pool.shutdown(wait=False)  # grpc leaves its pool to its owner
            try:  # ours only: the inode tells it from a newer server's socket
                if e.path.lstat().st_ino == e.inode[1]:
                    e.path.unlink()
            except FileNotFoundError:
                pass

    def _register_all(self, kubelet: tuple[int, int, int]) -> None:
        target = f"unix:{self.kubelet_socket}"
        try:
            with grpc.insecure_channel(target) as channel:
                stub = pb_grpc.RegistrationStub(channel)
                for resource in self._endpoints:
                    stub.Register(
                        pb.RegisterRequest(
                            version=DEVICE_PLUGIN_VERSION,
                            endpoint=resources.socket_name(resource),
                            resource_name=resource,
                            options=_OPTIONS,
                        ),
                        timeout=self._settings.register_timeout,
                        wait_for_ready=True,
                    )
        except grpc.RpcError as e:
            detail = e.details() if isinstance(e, grpc.Call) else str(e)
            self._problem(
                "kubelet refused or missed registration; retrying", socket=str(self.kubelet_socket), error=detail
            )
            return
        self._registered_with = kubelet
        self._last_problem = ""
        self.registrations += 1
        self._log.info("registered with the kubelet", socket=str(self.kubelet_socket), resources=list(self._endpoints))

    def _problem(self, message: str, exc_info: bool = False, **fields: Any) -> None:
        """Log a waiting state once, not once per watch round."""
        key = message + repr(sorted(fields.items()))
        if key != self._last_problem:
            self._log.warning(message, exc_info=exc_info, **fields)
            self._last_problem = key
