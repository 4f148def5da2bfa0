"""Scrape time of cgpud's /metrics with 20 instances, against two baselines
scraped side by side: the same cgpud build with no instance, and an empty
prometheus-client registry served over HTTP in this process (what HTTP and
the client library cost by themselves).

    python -m bench.bench_metrics [--rounds 5] [--scrapes 100] [--instances 20]

Two real cgpud processes in core_mem mode, each on its own simulated
H100; the loaded one holds `--instances` device instances (1 GiB and a 5 %
compute share each, so every one is scheduled by the compute engine and has
a usage file to read). Rounds interleave the three sides, alternating the
order; prints p50 and p90 per scrape, the response size, and the ratios."""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from bench.harness import free_port, sim_environment, start_cgpud
from bench.table import print_table
from cgpud.cli.client import LocalClient
from cgpud.node.model import GIB, Owner, OwnerKind, Request


def start_daemon(tmp: Path, port: int) -> tuple[subprocess.Popen[bytes], Path]:
    tmp.mkdir()
    return start_cgpud(
        tmp,
        sim_environment(tmp, gpus=1),
        "--relay-socket",
        str(tmp / "run" / "relay"),
        "--mode",
        "core_mem",
        "--metrics-listen",
        f"127.0.0.1:{port}",
    )


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # `format`: the base class's parameter name
        pass


def scrape(url: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as r:
        size = len(r.read())
    return time.perf_counter() - t0, size


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--scrapes", type=int, default=100, help="scrapes per round and side")
    p.add_argument("--instances", type=int, default=20)
    args = p.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    created: list[str] = []
    with tempfile.TemporaryDirectory(prefix="cgpu-bench-metrics-") as d:
        tmp = Path(d)
        loaded_port, empty_port, bare_port = free_port(), free_port(), free_port()
        try:
            loaded, sock = start_daemon(tmp / "loaded", loaded_port)
            procs.append(loaded)
            empty, _ = start_daemon(tmp / "empty", empty_port)
            procs.append(empty)
            share = max(1, 100 // args.instances // 5 * 5)
            with LocalClient(sock) as client:
                for n in range(args.instances):
                    created.append(
                        client.create(Request(Owner(OwnerKind.DEVICE, f"bench-{n}"), GIB, core_percent=share)).id
                    )
            bare = make_server("127.0.0.1", bare_port, make_wsgi_app(CollectorRegistry()), handler_class=_Quiet)
            threading.Thread(target=bare.serve_forever, daemon=True).start()
            sides = {
                f"cgpud, {args.instances} instances": f"http://127.0.0.1:{loaded_port}/metrics",
                "cgpud, 0 instances": f"http://127.0.0.1:{empty_port}/metrics",
                "empty registry": f"http://127.0.0.1:{bare_port}/metrics",
            }
            times: dict[str, list[float]] = {k: [] for k in sides}
            sizes: dict[str, int] = {}
            for url in sides.values():
                scrape(url)  # warm: first-scrape imports and connections
            for r in range(args.rounds):
                order = list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]
                for name, url in order:
                    for _ in range(args.scrapes):
                        elapsed, sizes[name] = scrape(url)
                        times[name].append(elapsed)
            bare.shutdown()
        finally:
            # Released, or their tmpfs mounts outlive cgpud (as they must across a restart).
            if created:
                with LocalClient(sock) as client:
                    for instance_id in created:
                        client.release(instance_id)
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"{args.rounds} rounds x {args.scrapes} scrapes per side, interleaved; urllib client, new connection per scrape"
    )
    rows = [
        (name, f"{statistics.median(t) * 1e3:.2f}", f"{pct(t, 0.9) * 1e3:.2f}", str(sizes[name]))
        for name, t in times.items()
    ]
    print_table(("side", "p50 ms", "p90 ms", "bytes"), rows)
    names = list(times)
    p50 = {n: statistics.median(times[n]) for n in names}
    print(
        f"{names[0]} / {names[1]} (p50): {p50[names[0]] / p50[names[1]]:.2f}x "
        f"(+{(p50[names[0]] - p50[names[1]]) * 1e3:.2f} ms for {args.instances} instances)"
    )
    print(f"{names[0]} / {names[2]} (p50): {p50[names[0]] / p50[names[2]]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
