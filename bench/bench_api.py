"""Instance create+release round trips through cgpud's local API, with the
SQLite state on disk, against the same operations on the instance service
called in-process (the baseline: what the socket and gRPC add), and through
the gRPC server's private socket behind the peer-credential gate (what the
gate adds).

    python -m bench.bench_api [--rounds 5] [--ops 300]

Starts a real cgpud on a private simulated machine in a temp dir; prints
round trips per second, p50 and p99 latency of each side, and the ratio."""

from __future__ import annotations

import argparse
import logging
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness import sim_environment, start_cgpud
from cgpud.api.gate import private_socket_path
from cgpud.cli.client import LocalClient
from cgpud.node.model import GIB, GpuCapacity, NodePolicy, Owner, OwnerKind, Request
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from cgpud.logs import configure_logging


def timed(ops: int, once: Callable[[int], None]) -> list[float]:
    latencies = []
    for n in range(ops):
        t0 = time.perf_counter()
        once(n)
        latencies.append(time.perf_counter() - t0)
    return latencies


def summary(latencies: list[float]) -> tuple[float, float, float]:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return len(latencies) / sum(latencies), statistics.median(ordered) * 1e6, p99 * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ops", type=int, default=300, help="create+release pairs per round and side")
    args = p.parse_args()
    configure_logging(logging.WARNING)  # the in-process side logs every change otherwise
    with tempfile.TemporaryDirectory(prefix="cgpu-bench-api-") as d:
        tmp = Path(d)
        env = sim_environment(tmp)
        proc, sock = start_cgpud(tmp, env, "--max-instances-per-gpu", "1000")
        gpus = (
            GpuCapacity(0, "GPU-5c1a0000-0000-4000-8000-000000c90000", 80 * GIB),
            GpuCapacity(1, "GPU-5c1a0000-0000-4000-8000-000000c90001", 80 * GIB),
        )
        local = InstanceService(
            Store(tmp / "baseline" / "cgpud.db"),
            gpus,
            NodePolicy(),
            tmp / "baseline" / "regions",
            "bench",
            "bench-boot",
        )
        api_lat: list[float] = []
        base_lat: list[float] = []
        direct_lat: list[float] = []
        per_round = []
        try:
            with LocalClient(sock) as client, LocalClient(private_socket_path(sock)) as direct:
                for r in range(args.rounds):

                    def via_api(n: int, r: int = r) -> None:
                        inst = client.create(Request(Owner(OwnerKind.CONTAINER, f"api-{r}-{n}"), GIB))
                        client.release(inst.id)

                    def via_private(n: int, r: int = r) -> None:
                        inst = direct.create(Request(Owner(OwnerKind.CONTAINER, f"direct-{r}-{n}"), GIB))
                        direct.release(inst.id)

                    def in_process(n: int, r: int = r) -> None:
                        inst = local.create(Request(Owner(OwnerKind.CONTAINER, f"base-{r}-{n}"), GIB))
                        local.release(inst.id)

                    # Alternate which side goes first: the machine is shared and noisy.
                    sides = [
                        (api_lat, via_api, "api"),
                        (direct_lat, via_private, "no-gate"),
                        (base_lat, in_process, "in-process"),
                    ]
                    for lat, fn, name in sides if r % 2 == 0 else sides[::-1]:
                        got = timed(args.ops, fn)
                        lat.extend(got)
                        per_round.append((r, name, summary(got)[0]))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    api, base, direct_ = summary(api_lat), summary(base_lat), summary(direct_lat)
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"{args.rounds} rounds x {args.ops} create+release pairs per side, interleaved; SQLite (WAL, "
        f"synchronous=FULL) on {tempfile.gettempdir()}"
    )
    print(f"{'side':<12}{'pairs/s':>10}{'p50 us':>10}{'p99 us':>10}")
    print(f"{'local API':<12}{api[0]:>10.0f}{api[1]:>10.0f}{api[2]:>10.0f}")
    print(f"{'no gate':<12}{direct_[0]:>10.0f}{direct_[1]:>10.0f}{direct_[2]:>10.0f}")
    print(f"{'in-process':<12}{base[0]:>10.0f}{base[1]:>10.0f}{base[2]:>10.0f}")
    print(f"API / in-process latency (p50): {api[1] / base[1]:.2f}x")
    print(
        f"API through the gate / gRPC socket direct (p50): {api[1] / direct_[1]:.2f}x (+{api[1] - direct_[1]:.0f} us)"
    )
    print("per round (pairs/s): " + ", ".join(f"{r}:{side}={rate:.0f}" for r, side, rate in per_round))
    return 0


if __name__ == "__main__":
    sys.exit(main())
