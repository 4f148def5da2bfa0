"""Client of cgpud's local API (cgpu.v1.Local on a unix socket).

Methods mirror the daemon's service (cgpud.api.server.LocalService) and
return model objects, so code written against one runs against the other.
Every failure is a cgpud.errors exception: the daemon's refusals come back as
the class it raised with its message; an unreachable daemon is a
DaemonUnreachable (a CgpuError) that says what to check.

A client made with `wait` rides out a cgpud restart: while the socket is
missing or refuses, it says so once through `notice` and tries again with
backoff for up to `wait` seconds, as the relays do (CGPU_RELAY_WAIT_S)."""

from __future__ import annotations

import builtins
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc

from cgpud.api import DEFAULT_SOCKET, REFUSAL_PREFIX, convert
from cgpud.api.cgpu.v1 import local_pb2 as pb
from cgpud.api.cgpu.v1 import local_pb2_grpc as pb_grpc
from cgpud.api.status import error_for
from cgpud.node import model
from cgpud.errors import CgpuError, DaemonUnreachable, UsageError

T = TypeVar("T")

_FIRST_RETRY = 0.05  # seconds, doubling up to _MAX_RETRY: no busy loop
_MAX_RETRY = 0.5

_CHANNEL_OPTIONS = (
    # Connections of this client are its own: gRPC otherwise shares them
    # process-wide, and one client's failed attempt (say, made while the
    # daemon restarted) would put another client into its reconnect backoff.
    ("grpc.use_local_subchannel_pool", 1),
    # A local socket is either there or not: retry connecting within a
    # second, not after gRPC's default backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # gRPC's name for how long one connection attempt may take, the
    # server's HTTP/2 SETTINGS included. Once 100 ms here: a cgpud that
    # had accepted the connection but was busy for a moment (just started
    # on a loaded machine, or stopped for a second) failed the call at
    # once with "timed out before receiving SETTINGS frame". A socket
    # nobody listens on still fails at once (refused).
    ("grpc.min_reconnect_backoff_ms", 20_000),
)


class LocalClient(AbstractContextManager["LocalClient"]):
    """`with LocalClient() as c: c.list()`. Calls give up after `timeout`
    seconds. Without `wait` they fail fast when the daemon is down; with it,
    each call waits up to `wait` seconds for the daemon to come back, and
    the first wait is announced once through `notice`."""

    def __init__(
        self,
        socket_path: Path = DEFAULT_SOCKET,
        *,
        timeout: float = 30.0,
        wait: float = 0.0,
        notice: Callable[[str], None] | None = None,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self.wait = wait
        self._notice = notice
        self._told = False
        # Channels connect lazily: constructing one never fails, the first
        # call reports an unreachable daemon.
        self._channel = grpc.insecure_channel(f"unix:{self.socket_path}", options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.LocalStub(self._channel)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    # ---- the API ------------------------------------------------------------------

    def create(self, request: model.Request, pid: int | None = None) -> model.Instance:
        msg = self._encode(lambda: convert.request_to_pb(request, pid))
        return convert.instance_from_pb(self._call(self._stub.CreateInstance, msg))

    def bind(self, instance_id: str, pids: tuple[int, ...], owner_id: str | None = None) -> model.Instance:
        msg = self._encode(lambda: convert.bind_to_pb(instance_id, tuple(pids), owner_id))
        return convert.instance_from_pb(self._call(self._stub.BindInstance, msg))

    def release(self, instance_id: str) -> model.Instance:
        msg = pb.ReleaseInstanceRequest(id=instance_id)
        return convert.instance_from_pb(self._call(self._stub.ReleaseInstance, msg))

    def resize(self, instance_id: str, memory: int | None, core_percent: int | None) -> model.Instance:
        msg = pb.ResizeInstanceRequest(id=instance_id, memory_bytes=memory, core_percent=core_percent)
        return convert.instance_from_pb(self._call(self._stub.ResizeInstance, msg))

    def list(self, include_released: bool = False) -> builtins.list[model.Instance]:
        msg = pb.ListInstancesRequest(include_released=include_released)
        return [convert.instance_from_pb(i) for i in self._call(self._stub.ListInstances, msg).instances]

    def list_with_violations(self, include_released: bool = False) -> builtins.list[tuple[model.Instance, int]]:
        """As list(), each instance with its bypass events since cgpud started."""
        msg = pb.ListInstancesRequest(include_released=include_released)
        return [
            (convert.instance_from_pb(i), i.violations) for i in self._call(self._stub.ListInstances, msg).instances
        ]

    def get(self, instance_id: str) -> model.Instance:
        return convert.instance_from_pb(self._inspect(instance_id))

    def get_with_violations(self, instance_id: str) -> tuple[model.Instance, int]:
        msg = self._inspect(instance_id)
        return convert.instance_from_pb(msg), msg.violations

    def region_dir(self, instance_id: str) -> Path | None:
        """Host directory of the instance's region files; None once released."""
        return convert.region_dir_from_pb(self._inspect(instance_id))

    def mps_pipe_dir(self, instance_id: str) -> Path | None:
        """Host MPS pipe directory of the instance's GPU on an mps node; None elsewhere."""
        return convert.mps_pipe_dir_from_pb(self._inspect(instance_id))

    def policy(self) -> model.NodePolicy:
        return convert.policy_from_pb(self._call(self._stub.GetPolicy, pb.GetPolicyRequest()))

    def set_compute_policy(self, policy: model.ComputePolicy, gpu: int | None = None) -> model.NodePolicy:
        msg = pb.SetPolicyRequest(compute_policy=int(policy), gpu=gpu)
        return convert.policy_from_pb(self._call(self._stub.SetPolicy, msg))

    def node_info(self) -> model.NodeInfo:
        return convert.node_info_from_pb(self._call(self._stub.GetNodeInfo, pb.GetNodeInfoRequest()))

    def cdi_spec(self) -> str:
        """The CDI spec of the node's device instances, as JSON text."""
        return self._call(self._stub.GetCdiSpec, pb.GetCdiSpecRequest()).json

    def bypass_events(self, instance_id: str | None = None, limit: int = 0) -> convert.BypassListing:
        """The bypass watchdog's recent events, newest last (one instance's
        when given; the daemon's default number when limit is 0)."""
        msg = self._encode(lambda: pb.ListBypassEventsRequest(instance_id=instance_id or "", limit=limit))
        return convert.bypass_listing_from_pb(self._call(self._stub.ListBypassEvents, msg))

    # ---- plumbing -----------------------------------------------------------------

    def _inspect(self, instance_id: str) -> pb.Instance:
        return self._call(self._stub.InspectInstance, pb.InspectInstanceRequest(id=instance_id))

    @staticmethod
    def _encode(build: Callable[[], T]) -> T:
        # protobuf refuses values out of a field's range (a pid past int32)
        # with ValueError/TypeError: that is a bad argument, said as such.
        try:
            return build()
        except (ValueError, TypeError) as e:
            raise UsageError(f"invalid request: {e}") from None

    def _call(self, rpc: Callable[..., T], request: Any) -> T:
        try:
            return rpc(request, timeout=self.timeout)
        except grpc.RpcError as e:
            why = self._waitable(e)
            if not why:
                raise self._error(e) from None
        return self._call_when_back(rpc, request, why)

    def _waitable(self, e: grpc.RpcError) -> str | None:
        """_down's answer for a failed call worth waiting on; else None."""
        if self.wait <= 0 or e.code() is not grpc.StatusCode.UNAVAILABLE:
            return None
        return _down(self.socket_path)

    def _call_when_back(self, rpc: Callable[..., T], request: Any, why: str) -> T:
        """Sends the request again once the socket accepts. Safe: a refused
        connection carried nothing, and the verbs cgpuctl repeats after a
        daemon died mid-call are idempotent (create by owner, bind)."""
        if self._notice is not None and not self._told:
            self._notice(f"cgpud is not running ({self.socket_path}: {why}); retrying for {self.wait:g} s")
            self._told = True
        deadline = time.monotonic() + self.wait
        delay = _FIRST_RETRY
        last: grpc.RpcError | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if why or last is None:
                    raise DaemonUnreachable(
                        f"cgpud is not running ({self.socket_path}: {why}); it did not come back "
                        f"within {self.wait:g} s: start it (systemctl start cgpud)"
                    )
                raise self._error(last)  # it accepts but does not serve: unreachable() says why
            time.sleep(min(delay, left))
            delay = min(delay * 2, _MAX_RETRY)
            still = _down(self.socket_path)
            if still is None:
                raise unreachable(self.socket_path)
            why = still
            if why:
                continue
            # The socket accepts. gRPC's channel may still be in its
            # reconnect backoff (at most 1 s): then the call fails fast and
            # the loop comes round again.
            try:
                return rpc(request, timeout=self.timeout)
            except grpc.RpcError as e:
                last = e
                again = self._waitable(e)
                if again is None:
                    raise self._error(e) from None
                why = again

    def _error(self, e: grpc.RpcError) -> CgpuError:
        code: grpc.StatusCode = e.code()
        details: str = e.details() or ""
        if code is grpc.StatusCode.UNAVAILABLE:
            return unreachable(self.socket_path, details)
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return CgpuError(f"cgpud at {self.socket_path} did not answer within {self.timeout:g} s")
        # The daemon's own message, as the class it raised (CgpuError for
        # INTERNAL and codes no class maps to).
        return error_for(code, details or f"cgpud at {self.socket_path} failed: {code.name}")


def _down(path: Path) -> str | None:
    """Why cgpud is down (its socket missing, or left behind refusing); ""
    if the socket accepts; None if it fails for a reason waiting does not
    cure (permissions), which unreachable() then explains."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as e:
            return e.strerror or str(e)
        except OSError:
            return None
    return ""


def unreachable(path: Path, details: str = "") -> DaemonUnreachable:
    """Why cgpud cannot be reached, found out by connecting to the socket
    ourselves: gRPC's own text ("failed to connect to all addresses") does not
    tell a stopped daemon from a permission problem."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except PermissionError:
            return DaemonUnreachable(f"cannot reach cgpud at {path}: its socket is root-only; run as root")
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            return DaemonUnreachable(f"cannot reach cgpud at {path}: is it running? (systemctl status cgpud)")
        except OSError as e:
            return DaemonUnreachable(f"cannot reach cgpud at {path}: {e.strerror or e}")
        refusal = _refusal(probe)
        if refusal:
            return DaemonUnreachable(f"cgpud refused this client: {refusal}")
    # The socket answers but gRPC did not get through: starting or stopping.
    return DaemonUnreachable(f"cgpud at {path} is not accepting requests ({details or 'unavailable'}); try again")


def _refusal(probe: socket.socket) -> str | None:
    """The line cgpud's gate sends a peer it turns away (not root), if any;
    an admitted probe hears gRPC or nothing within the timeout."""
    try:
        probe.settimeout(1.0)
        data = probe.recv(1024)
    except OSError:
        return None
    if not data.startswith(REFUSAL_PREFIX):
        return None
    return data[len(REFUSAL_PREFIX) :].split(b"\n")[0].decode("utf-8", "replace")
