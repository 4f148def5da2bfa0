"""The extender's side of a node's Capacity API (cgpu.v1.Capacity): channels
(TLS with a client certificate, or plaintext), and the calls, with gRPC
failures turned into CapacityError carrying the node's own message."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from cgpud.api.cgpu.v1 import capacity_pb2 as pb
from cgpud.api.cgpu.v1 import capacity_pb2_grpc as pb_grpc
from cgpud.node.model import Share
from cgpud.errors import CgpuError, UsageError
from cgpud.extender.model import NodeState, node_from_pb

DEFAULT_TIMEOUT = 5.0

# A watcher whose node died without closing the connection (power, network)
# learns it from a missed keepalive: a ping every 15 s on a live stream, and
# the connection is dropped 5 s after one goes unanswered (a frozen node is
# refused 20 s after it froze). cgpud allows pings every 10 s on its Capacity
# port; more often would get the connection closed for too many pings.
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 15_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # Without this the core waits its default ping timeout (~30 s here), not
    # keepalive_timeout_ms, for the pong.
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 0),
    # Reconnect soon after a node comes back; the watcher backs off itself.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.enable_retries", 0),
]


@dataclass(frozen=True)
class TlsFiles:
    cert: Path | None  # the client certificate cgpud checks (with key)
    key: Path | None
    ca: Path  # the CA that signed cgpud's server certificate

    def credentials(self) -> grpc.ChannelCredentials:
        try:
            ca = Path(self.ca).read_bytes()
            cert = Path(self.cert).read_bytes() if self.cert else None
            key = Path(self.key).read_bytes() if self.key else None
        except OSError as e:
            raise UsageError(f"cannot read the Capacity API's TLS files: {e}") from e
        if (cert is None) != (key is None):
            raise UsageError("give the client certificate and its key together (--tls-cert, --tls-key)")
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


class CapacityError(CgpuError):
    """A Capacity call failed; `code` is the gRPC status, the message the
    node's (or the transport's) explanation."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


def capacity_channel(address: str, tls: TlsFiles | None, node: str | None = None) -> grpc.Channel:
    """A channel to a node's Capacity API at HOST:PORT ([v6]:PORT). With TLS
    and a node name, the server's certificate must name that node (a DNS
    subjectAltName): the address came from the Node object, which whoever
    may patch Nodes can point anywhere, so the certificate, not the address,
    says whose Capacity API answers. Without a node name the address's host
    is checked, as any TLS client does."""
    if tls is None:
        return grpc.insecure_channel(address, options=_KEEPALIVE)
    options: list[tuple[str, str | int]] = list(_KEEPALIVE)
    if node:
        options.append(("grpc.ssl_target_name_override", node))
    return grpc.secure_channel(address, tls.credentials(), options=options)


def _failure(what: str, address: str, e: grpc.RpcError) -> CapacityError:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    name = code.name if code is not None else "UNKNOWN"
    return CapacityError(f"{what} at {address}: {name}: {details}", code)


class CapacityClient:
    """One node's Capacity API over one long-lived channel (thread-safe)."""

    def __init__(self, address: str, tls: TlsFiles | None, node: str | None = None) -> None:
        self.address = address
        self.node = node
        self._channel = capacity_channel(address, tls, node)
        self.stub = pb_grpc.CapacityStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def get_node(self, timeout: float = DEFAULT_TIMEOUT) -> NodeState:
        try:
            return node_from_pb(self.stub.GetNode(pb.GetNodeRequest(), timeout=timeout))
        except grpc.RpcError as e:
            raise _failure("GetNode", self.address, e) from None

    def reserve(
        self,
        pod_uid: str,
        namespace: str,
        name: str,
        shares: Sequence[Share],
        ttl: int = 0,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> pb.Reservation:
        request = pb.ReserveRequest(
            pod_uid=pod_uid,
            pod_namespace=namespace,
            pod_name=name,
            ttl_seconds=ttl,
            shares=[
                pb.Share(
                    gpu_index=s.gpu_index, memory_bytes=s.memory, core_percent=s.core_percent, instances=s.instances
                )
                for s in shares
            ],
        )
        try:
            return self.stub.Reserve(request, timeout=timeout)
        except grpc.RpcError as e:
            raise _failure("Reserve", self.address, e) from None

    def unreserve(self, pod_uid: str, timeout: float = DEFAULT_TIMEOUT) -> pb.UnreserveResponse:
        try:
            return self.stub.Unreserve(pb.UnreserveRequest(pod_uid=pod_uid), timeout=timeout)
        except grpc.RpcError as e:
            raise _failure("Unreserve", self.address, e) from None


def get_node(
    address: str, tls: TlsFiles | None, timeout: float = DEFAULT_TIMEOUT, node: str | None = None
) -> NodeState:
    """One GetNode on a channel of its own (kubectl inspect cgpu --nodes)."""
    client = CapacityClient(address, tls, node)
    try:
        return client.get_node(timeout)
    finally:
        client.close()


class Clients:
    """One CapacityClient per (node, address), shared by watchers and bind:
    a channel is made for one node's name, which its certificate must carry."""

    def __init__(self, tls: TlsFiles | None) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str], CapacityClient] = {}

    def get(self, node: str, address: str) -> CapacityClient:
        with self._lock:
            c = self._clients.get((node, address))
            if c is None:
                c = self._clients[(node, address)] = CapacityClient(address, self.tls, node)
            return c

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
