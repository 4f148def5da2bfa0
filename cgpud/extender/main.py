"""cgpu-scheduler: the kube-scheduler extender. Wiring only.

    cgpu-scheduler --listen HOST:PORT [--nodes FILE] [--kubeconfig FILE]
                   [--tls-cert FILE --tls-key FILE --tls-ca FILE]
                   [--serve-cert FILE --serve-key FILE [--client-ca FILE]]
                   [--pick-at-filter]

Nodes come from --nodes (one `NAME HOST:PORT` a line) or, without it, from
the API server's Nodes. Binding goes to the API server (--kubeconfig, or the
pod's service account in a cluster); with --nodes and no API server it runs
standalone: bind reserves on the node and reports the assignment.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import structlog

from cgpud.api.listen import join_host_port, parse_endpoint
from cgpud.errors import UsageError
from cgpud.logs import configure_logging, run_command
from cgpud.signals import StopSignals


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cgpu-scheduler",
        description="kube-scheduler extender placing cgpu GPU shares (filter, prioritize, "
        "bind) from every node's live Capacity view.",
    )
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="where kube-scheduler calls the extender")
    p.add_argument(
        "--nodes",
        type=Path,
        metavar="FILE",
        help="node file: `NAME HOST:PORT` a line (its cgpud's Capacity address); default: the API "
        "server's Nodes (annotation cgpu.io/capacity-address)",
    )
    p.add_argument(
        "--kubeconfig",
        type=Path,
        metavar="FILE",
        help="API server credentials (default: the pod's service account when in a cluster)",
    )
    p.add_argument("--tls-cert", type=Path, metavar="FILE", help="client certificate for the Capacity API")
    p.add_argument("--tls-key", type=Path, metavar="FILE", help="its key")
    p.add_argument("--tls-ca", type=Path, metavar="FILE", help="CA of the nodes' Capacity server certificates")
    p.add_argument(
        "--serve-cert",
        type=Path,
        metavar="FILE",
        help="serve kube-scheduler over HTTPS with this certificate (and --serve-key)",
    )
    p.add_argument("--serve-key", type=Path, metavar="FILE", help="its key")
    p.add_argument(
        "--client-ca",
        type=Path,
        metavar="FILE",
        help="only callers with a client certificate this CA signed may filter, prioritize and bind "
        "(kube-scheduler's extender tlsConfig); /healthz and /inspect stay open",
    )
    p.add_argument(
        "--reservation-ttl",
        type=int,
        default=0,
        metavar="SECONDS",
        help="how long a node holds a bind's reservation for the pod's Allocate (0: the node's default)",
    )
    p.add_argument(
        "--pick-at-filter",
        action="store_true",
        help="the filter passes a GPU-share pod only the node it would score highest, so kube-scheduler "
        "binds there without prioritize (one round trip fewer a pod; kube-scheduler's own scores no "
        "longer weigh in for these pods); needs --client-ca",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def run(args: argparse.Namespace) -> int:
    from cgpud.extender.bind import Binder, KubePodApi
    from cgpud.extender.client import Clients, TlsFiles
    from cgpud.extender.server import ExtenderServer, ServerTls
    from cgpud.extender.state import ClusterState
    from cgpud.extender.watch import ApiNodeSource, Watchers, read_node_file
    from cgpud.kube.apiserver import client_from

    log = structlog.get_logger("cgpud.extender")
    listen = parse_endpoint(args.listen, "--listen")
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key:
        if not args.tls_ca:
            raise UsageError("--tls-cert/--tls-key need --tls-ca (the CA of the nodes' server certificates)")
        tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)
        tls.credentials()  # unreadable files fail now, not at the first node
    serving = None
    if args.serve_cert or args.serve_key or args.client_ca:
        if not (args.serve_cert and args.serve_key):
            raise UsageError(
                "--serve-cert and --serve-key go together (--client-ca needs them: client "
                "certificates are checked over HTTPS only)"
            )
        serving = ServerTls(args.serve_cert, args.serve_key, args.client_ca)
        serving.context()  # unreadable files fail now, not at the first request
    verified = serving is not None and serving.client_ca is not None
    if args.pick_at_filter and not verified:
        raise UsageError(
            "--pick-at-filter needs --client-ca: the pick is held on its node until the pod's bind, and a "
            "filter anyone may call must not hold capacity (docs/scheduler.md)"
        )
    nodes = read_node_file(args.nodes) if args.nodes else None
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    api = KubePodApi(args.kubeconfig) if args.kubeconfig or in_cluster else None
    if nodes is None and api is None:
        raise UsageError(
            "no nodes: give --nodes FILE, or --kubeconfig (or run in a cluster) to find them through the API server"
        )
    state = ClusterState()
    clients = Clients(tls)
    binder = Binder(state, clients, api, ttl=args.reservation_ttl, callers_verified=verified)
    server = ExtenderServer(state, binder, listen.host, listen.port, tls=serving, pick_at_filter=args.pick_at_filter)
    watchers = Watchers(state, clients)
    source = None
    server.start()
    if nodes is not None:
        watchers.sync(nodes)
    else:

        def skipped(reasons: dict[str, str]) -> None:
            server.extender.skipped = dict(reasons)

        source = ApiNodeSource(client_from(args.kubeconfig, timeout=10), watchers.sync, skipped).start()
    signals = StopSignals(threading.Event())
    log.info(
        "ready",
        listen=join_host_port(listen.host, server.port),
        nodes=len(nodes) if nodes is not None else "api-server",
        tls=tls is not None,
        pick_at_filter=args.pick_at_filter,
        binding="api-server" if api is not None else "standalone",
        serving="https with client certificates"
        if serving is not None and serving.client_ca
        else "https"
        if serving is not None
        else "http",
    )
    print(f"cgpu-scheduler listening on {server.url}", file=sys.stderr, flush=True)
    while not signals.wait(1.0):
        state.expire()
    log.info("stopping")
    server.stop()
    if source is not None:
        source.stop()
    watchers.stop()
    clients.close()
    if api is not None:
        api.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(getattr(logging, args.log_level.upper()))
    return run_command("cgpu-scheduler", lambda: run(args), failed=2)


if __name__ == "__main__":
    sys.exit(main())
