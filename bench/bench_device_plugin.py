"""The device plugin as the kubelet meets it: Allocate latency and how fast a
GPU health change reaches ListAndWatch, on a real cgpud (orchestrator =
kubernetes) over the simulated GPUs.

    python -m bench.bench_device_plugin [--rounds 3] [--allocations 100] [--faults 10]

The kubelet is played over its real gRPC (tests/kube/test_device_plugin.py's
Kubelet), the API server over its real REST paths (tests/harness/api_server.py).

- Allocate: each allocation is a new assumed pod of 1 GiB, so every call
  resolves its pod through the API server, creates an instance (SQLite, region
  files), writes its CDI spec and marks the pod. Beside each one, on the same
  socket, a GetPreferredAllocation for the same devices: a gRPC round trip to
  the same servicer that changes nothing (the baseline). Interleaved; a fresh
  cgpud and machine per round.
- Health: a GPU is made lost and then recovered by another process
  (cgpu-sim-stat, as `cgpuctl sim fault` runs it); the time from starting that
  process to the ListAndWatch message that shows the change, beside the time
  the injecting process itself takes (the baseline). Recovery is found by the
  periodic probe: its latency is bounded by --probe-interval."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc

from bench.harness import sim_environment
from bench.table import print_table
from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2 as pb
from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from cgpud.kube.model import Resource
from cgpud.native import native_path
from tests.harness.daemon import running_daemon
from tests.harness.api_server import ApiServerProcess, api_server, assumed, node_json, pod_json
from tests.harness.kubelet_pods import kubelet_pods
from tests.harness.kubelet import Kubelet, cgpud_kube_args

NODE = "bench-node"
WAIT = 30.0


@dataclass
class Samples:
    allocate: list[float] = field(default_factory=list)
    preferred: list[float] = field(default_factory=list)
    unhealthy: list[float] = field(default_factory=list)
    healthy: list[float] = field(default_factory=list)
    injector: list[float] = field(default_factory=list)


@contextmanager
def node(tmp: Path, probe_interval: float) -> Iterator[tuple[ApiServerProcess, dict[str, str], dict[Resource, Path]]]:
    """A fresh simulated machine, API server, kubelet and cgpud."""
    env = sim_environment(tmp)
    plugins = Path(tempfile.mkdtemp(prefix="bdp-", dir="/tmp"))  # short: unix socket paths
    kubelet = Kubelet(plugins).start()
    try:
        with (
            api_server(tmp) as (server, kubeconfig),
            kubelet_pods() as (_, pod_resources),
            running_daemon(
                tmp,
                env,
                *cgpud_kube_args(plugins, pod_resources, kubeconfig, NODE, tmp / "cdi"),
                "--mode",
                "cgpu",
                "--max-instances-per-gpu",
                "200",
                "--gpu-health-probe-interval",
                str(probe_interval),
            ),
        ):
            server.state.nodes[NODE] = node_json(NODE, {"ack.node.gpu.schedule": "cgpu"})
            sockets = {
                Resource(r.resource_name): plugins / r.endpoint for r in kubelet.take_registrations(len(Resource))
            }
            yield server, env, sockets
    finally:
        kubelet.stop()
        subprocess.run(["rm", "-rf", str(plugins)], check=False)


def detach_regions(under: Path) -> None:
    """cgpud keeps its instances' tmpfs mounts when it stops (instances
    outlive it); the bench's machine is thrown away, so are they."""
    from cgpud._region import lib

    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if Path(point).is_relative_to(under):
            lib.cgpu_region_unmount(point.encode())


def measure_allocations(server: ApiServerProcess, socket: Path, count: int, round_: int, out: Samples) -> None:
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        stream = stub.ListAndWatch(pb.Empty(), timeout=WAIT)
        devices = [d.ID for d in next(iter(stream)).devices]
        stream.cancel()
        for n in range(count):
            server.state.add_pod(
                pod_json(
                    f"p{round_}-{n}",
                    NODE,
                    containers={"main": {Resource.GPU_MEM.value: 1}},
                    annotations=assumed(n + 1),
                )
            )
            ids = [devices[n % len(devices)]]
            preferred = pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=devices, allocation_size=1)
                ]
            )
            allocate = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
            # partial binds this round's requests now (a lambda would read the loop variables when it runs).
            calls = [
                (out.preferred, partial(stub.GetPreferredAllocation, preferred, timeout=WAIT)),
                (out.allocate, partial(stub.Allocate, allocate, timeout=WAIT)),
            ]
            for samples, call in calls if n % 2 == 0 else calls[::-1]:
                t0 = time.perf_counter()
                call()
                samples.append(time.perf_counter() - t0)


def _health(message: pb.ListAndWatchResponse) -> set[str]:
    return {d.health for d in message.devices}


def measure_faults(env_sim: dict[str, str], socket: Path, faults: int, out: Samples) -> None:
    stat = str(native_path("bin/cgpu-sim-stat"))
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stream = iter(pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=WAIT * faults))
        assert _health(next(stream)) == {"Healthy"}
        for _ in range(faults):
            for flag, want, samples in (("--lost", "Unhealthy", out.unhealthy), ("--recover", None, out.healthy)):
                t0 = time.perf_counter()
                subprocess.run([stat, flag, "1"], env=env_sim, check=True, capture_output=True)
                ran = time.perf_counter() - t0
                while True:
                    seen = _health(next(stream))
                    if (want in seen) if want else seen == {"Healthy"}:
                        break
                samples.append(time.perf_counter() - t0)
                if want:
                    out.injector.append(ran)


def ms(values: list[float], q: float) -> str:
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--allocations", type=int, default=100, help="Allocates per round (one new pod each)")
    p.add_argument("--faults", type=int, default=10, help="lost/recovered cycles per round")
    p.add_argument("--probe-interval", type=float, default=0.2, help="cgpud's gpu_health_probe_interval")
    args = p.parse_args()
    out = Samples()
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="cgpu-bench-dp-") as d:
            tmp = Path(d)
            try:
                with node(tmp, args.probe_interval) as (server, env, sockets):
                    measure_allocations(server, sockets[Resource.GPU_MEM], args.allocations, r, out)
                    measure_faults(env, sockets[Resource.GPU_COUNT], args.faults, out)
            finally:
                detach_regions(tmp)
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"{args.rounds} rounds (fresh cgpud each); {args.allocations} Allocates and {args.faults} lost/recover "
        f"cycles per round; probe interval {args.probe_interval} s"
    )
    rows = [
        ("Allocate (new pod, instance, CDI spec)", out.allocate),
        ("GetPreferredAllocation (baseline)", out.preferred),
        ("lost GPU -> Unhealthy in ListAndWatch", out.unhealthy),
        ("  the injecting process alone (baseline)", out.injector),
        ("recovered GPU -> Healthy in ListAndWatch", out.healthy),
    ]
    print_table(
        ("ms", "n", "p50", "p99", "max"),
        [(name, str(len(v)), ms(v, 0.5), ms(v, 0.99), f"{max(v) * 1e3:.2f}") for name, v in rows],
    )
    print(
        f"Allocate / GetPreferredAllocation (p50): "
        f"{statistics.median(out.allocate) / statistics.median(out.preferred):.1f}x"
    )
    print(
        f"lost -> Unhealthy beyond the injecting process (p50): "
        f"{(statistics.median(out.unhealthy) - statistics.median(out.injector)) * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
