"""Serving cgpu.v1.Capacity on TCP: TLS with client certificates checked
against one CA, or plaintext where only this node can connect (loopback)
unless the operator says otherwise (capacity_insecure), and
grpc.health.v1 beside it.

The port is a cluster scheduler's way to hold capacity: a client that can
call Reserve can make the node look full. Hence mutual TLS: a client
without a certificate of the configured CA fails the handshake before any
RPC runs."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cgpud.api.capacity import SERVICE_NAME, CapacityServicer
from cgpud.api.cgpu.v1 import capacity_pb2_grpc as pb_grpc
from cgpud.api.listen import Endpoint, parse_endpoint, plaintext_problem, tls_problem
from cgpud.errors import CgpuError, UsageError

# Each WatchNode stream holds a worker thread for its whole life: room for
# the schedulers' watchers (one or two each, a kubectl inspect now and
# then) and the unary calls beside them.
DEFAULT_WORKERS = 64
# A watcher whose host died without a FIN is noticed by its missing pong:
# ping every 30 s, give up 10 s later. Clients may ping every 10 s.
_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.so_reuseport", 0),  # a second cgpud on the same port must fail, not share it
    # Bounds: requests are a few hundred bytes; a connection with no call for
    # 5 minutes is closed (a watcher always has its stream open).
    ("grpc.max_receive_message_length", 1 << 20),
    ("grpc.max_connection_idle_ms", 300_000),
)


@dataclass(frozen=True)
class CapacityTls:
    """The capacity_tls_cert / _key / _ca settings: the server's certificate
    and key (PEM) and the CA that clients' certificates must chain to."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def from_settings(cls, cert: str, key: str, ca: str) -> CapacityTls | None:
        """All three or none (None: no TLS)."""
        problem = tls_problem(cert, key, ca)
        if problem is not None:
            raise UsageError(problem)
        return cls(Path(cert), Path(key), Path(ca)) if cert else None

    def credentials(self) -> grpc.ServerCredentials:
        pem = {}
        for setting, path in (
            ("capacity_tls_cert", self.cert),
            ("capacity_tls_key", self.key),
            ("capacity_tls_ca", self.ca),
        ):
            try:
                pem[setting] = path.read_bytes()
            except OSError as e:
                raise UsageError(f"setting {setting}: cannot read {path}: {e.strerror}") from e
            if b"-----BEGIN " not in pem[setting]:
                raise UsageError(f"setting {setting}: {path} is not a PEM file")
        return grpc.ssl_server_credentials(
            [(pem["capacity_tls_key"], pem["capacity_tls_cert"])],
            root_certificates=pem["capacity_tls_ca"],
            require_client_auth=True,
        )


class CapacityServer:
    """The started server: `port` is the one bound (a listen port of 0 picks one)."""

    def __init__(
        self,
        server: grpc.Server,
        servicer: CapacityServicer,
        health_servicer: health.HealthServicer,
        endpoint: Endpoint,
        tls: bool,
    ) -> None:
        self.grpc_server = server
        self.servicer = servicer
        self.health = health_servicer
        self.endpoint = endpoint  # as bound: the real port
        self.tls = tls

    @property
    def port(self) -> int:
        return self.endpoint.port

    @property
    def address(self) -> str:
        return str(self.endpoint)

    def stop(self, grace: float | None) -> threading.Event:
        """As grpc.Server.stop; watch streams end first (within a poll)."""
        self.health.enter_graceful_shutdown()
        self.servicer.stop()
        return self.grpc_server.stop(grace)


def serve_capacity(
    servicer: CapacityServicer,
    listen: str,
    tls: CapacityTls | None,
    insecure: bool = False,
    *,
    max_workers: int = DEFAULT_WORKERS,
) -> CapacityServer:
    """Start serving on `listen` ("HOST:PORT", IPv6 in brackets, port 0 for
    any). UsageError when the settings do not allow it (plaintext off
    loopback, unreadable TLS files); CgpuError when the port cannot be bound."""
    log = structlog.get_logger("cgpud.capacity")
    endpoint = parse_endpoint(listen, "capacity_listen")
    problem = plaintext_problem(endpoint, tls is not None, insecure)
    if problem is not None:
        raise UsageError(problem)
    credentials = tls.credentials() if tls is not None else None

    # A call holds a worker while it runs (a watch for as long as it
    # watches); calls past twice the workers are refused, not queued.
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="cgpud-capacity"),
        options=_OPTIONS,
        maximum_concurrent_rpcs=2 * max_workers,
    )
    pb_grpc.add_CapacityServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    target = str(endpoint)
    try:
        port = (
            server.add_secure_port(target, credentials) if credentials is not None else server.add_insecure_port(target)
        )
        if port == 0:  # older grpcio reports a failed bind as 0
            raise RuntimeError("bind failed")
    except RuntimeError as e:
        server.stop(None)
        raise CgpuError(
            f"the Capacity API cannot listen on {target} (capacity_listen): the port is in use, or the "
            "address is not one of this node's"
        ) from e
    server.start()
    bound = Endpoint(endpoint.host, port)
    log.info(
        "serving",
        listen=str(bound),
        port=port,
        tls=credentials is not None,
        client_certificates="required" if credentials is not None else "none",
        services=[SERVICE_NAME, health.SERVICE_NAME],
    )
    if credentials is None and not endpoint.loopback:
        log.warning(
            "the Capacity API serves plaintext to the network (capacity_insecure = true): anyone who "
            "reaches the port can hold this node's capacity",
            listen=str(bound),
        )
    return CapacityServer(server, servicer, health_servicer, bound, credentials is not None)


def advertised(endpoint: Endpoint, advertise: str, primary_address: str) -> Endpoint:
    """HOST:PORT for the Node annotation: capacity_advertise (its port, or the
    bound one when it names none), else the listen host, else (listening on
    every address) the node's primary address."""
    if advertise:
        given = parse_endpoint(advertise, "capacity_advertise", port_optional=True)
        return Endpoint(given.host, given.port or endpoint.port)
    if endpoint.wildcard:
        if not primary_address:
            raise UsageError(
                f"capacity_listen = {str(endpoint)!r} listens on every address and this node has no "
                'primary address to advertise: set capacity_advertise = "HOST:PORT"'
            )
        return Endpoint(primary_address, endpoint.port)
    return endpoint
