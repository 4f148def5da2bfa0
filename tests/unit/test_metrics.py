"""The metrics collector's pure parts: request and duration bookkeeping,
reading (and bounding) the tenant-written usage counters, and the families
built from a daemon's state, exposed and parsed back as Prometheus text."""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cgpud._region import ffi as rffi
from cgpud.containers.relay import RelayServer
from cgpud import config as settings
from cgpud.node.compute import GpuSchedule, TenantMetrics
from cgpud.daemon.metrics import CgpuCollector, MetricsServer, read_usage
from cgpud.daemon.stats import CountedAllocator, DaemonStats
from cgpud.node.model import GIB, MIB, GpuCapacity, Grant, Instance, InstanceState, NodeMode, NodePolicy, Owner
from cgpud.node.model import ComputePolicy, OwnerKind, Reservation
from cgpud.node.region import USAGE_FILE, DeviceLimit, InstanceLimits, write_region
from cgpud.errors import CgpuError, UsageError

DEVICE = rffi.offsetof("struct cgpu_usage", "device")
DEVSIZE = rffi.sizeof("struct cgpu_device_usage")
USED = rffi.offsetof("struct cgpu_device_usage", "used")
GATED = rffi.offsetof("struct cgpu_device_usage", "gated")
PACED = rffi.offsetof("struct cgpu_device_usage", "paced_ns")


def poke(path: Path, slot: int, field: int, value: int) -> None:
    """What a tenant process writes, or scribbles, into its usage file."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, value.to_bytes(8, "little"), DEVICE + slot * DEVSIZE + field)
    finally:
        os.close(fd)


def test_requests_and_errors_are_counted_by_kind_and_method() -> None:
    stats = DaemonStats()
    stats.request("admin", "ListInstances")
    stats.request("admin", "ListInstances")
    stats.request("admin", "ReleaseInstance", "NOT_FOUND")
    stats.request("relay", "prepare", "error")
    requests, errors, _ = stats.snapshot()
    assert requests == {("admin", "ListInstances"): 2, ("admin", "ReleaseInstance"): 1, ("relay", "prepare"): 1}
    assert errors == {("admin", "ReleaseInstance", "NOT_FOUND"): 1, ("relay", "prepare", "error"): 1}


def test_durations_land_in_cumulative_buckets_failures_included() -> None:
    ticks = iter([0.0, 0.003, 10.0, 10.2, 20.0, 40.0])
    stats = DaemonStats(clock=lambda: next(ticks))
    assert stats.timed("sweep", lambda: 7) == 7
    stats.timed("sweep", lambda: None)

    def boom() -> None:
        raise OSError("disk")

    with pytest.raises(OSError):
        stats.timed("sweep", boom)
    buckets, total = stats.snapshot()[2]["sweep"]
    counts = dict(buckets)
    assert counts["0.0025"] == 0 and counts["0.005"] == 1 and counts["0.25"] == 2 and counts["10"] == 2
    assert counts["+Inf"] == 3
    assert total == pytest.approx(20.203)


def _region(tmp_path: Path, slots: int = 2) -> Path:
    devices = tuple(DeviceLimit(f"GPU-{i}", GIB, i, 0) for i in range(slots))
    write_region(tmp_path / "r", InstanceLimits("i1", devices))
    return tmp_path / "r" / USAGE_FILE


def test_usage_counters_are_read_per_device(tmp_path: Path) -> None:
    usage = _region(tmp_path)
    poke(usage, 0, USED, 300 * MIB)
    poke(usage, 1, USED, 5 * MIB)
    poke(usage, 1, GATED, 42)
    poke(usage, 1, PACED, 2_500_000_000)
    got = read_usage(usage, 2)
    assert got is not None
    assert [(d.used, d.gated, d.paced_ns) for d in got] == [(300 * MIB, 0, 0), (5 * MIB, 42, 2_500_000_000)]


def test_a_truncated_missing_or_special_usage_file_reads_as_nothing(tmp_path: Path) -> None:
    usage = _region(tmp_path)
    os.truncate(usage, DEVICE + DEVSIZE // 2)
    assert read_usage(usage, 1) is None
    assert read_usage(tmp_path / "missing", 1) is None
    os.mkfifo(tmp_path / "fifo")
    assert read_usage(tmp_path / "fifo", 1) is None  # never blocks on a FIFO
    (tmp_path / "link").symlink_to(usage)
    assert read_usage(tmp_path / "link", 1) is None


class FakeDaemon:
    def __init__(self, root: Path, instances: list[Instance], compute: dict[str, list[TenantMetrics]]) -> None:
        self.root = root
        self.instances = instances
        self.compute = compute
        self.schedules: dict[int, GpuSchedule] = {}
        self.snapshots = 0

    def holdings(self) -> tuple[list[Instance], list[Reservation]]:
        self.snapshots += 1
        return self.instances, []

    def gpus(self) -> tuple[GpuCapacity, ...]:
        return (GpuCapacity(0, "GPU-a", 16 * GIB), GpuCapacity(1, "GPU-b", 16 * GIB))

    def policy(self) -> NodePolicy:
        return NodePolicy(mode=NodeMode.CORE_MEM)

    def compute_metrics(self) -> dict[str, list[TenantMetrics]]:
        return self.compute

    def compute_schedules(self) -> dict[int, GpuSchedule]:
        return self.schedules

    def region_dir(self, instance_id: str) -> Path:
        return self.root / instance_id


def _instance(root: Path, name: str, grants: tuple[Grant, ...]) -> Instance:
    write_region(
        root / name,
        InstanceLimits(name, tuple(DeviceLimit(g.gpu_uuid, g.memory, g.gpu_index, g.core_percent) for g in grants)),
    )
    return Instance(name, Owner(OwnerKind.CONTAINER, f"ctr-{name}"), grants, InstanceState.BOUND, True)


def _scrape(collector: CgpuCollector) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def _one(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    found = [v for lab, v in samples[name] if all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, samples[name])
    return found[0]


def test_collector_builds_instance_and_gpu_families_from_one_snapshot(tmp_path: Path) -> None:
    a = _instance(tmp_path, "a", (Grant(0, "GPU-a", 2 * GIB, 30),))
    b = _instance(tmp_path, "b", (Grant(0, "GPU-a", GIB, 0), Grant(1, "GPU-b", GIB, 0)))
    poke(tmp_path / "a" / USAGE_FILE, 0, USED, 512 * MIB)
    poke(tmp_path / "a" / USAGE_FILE, 0, GATED, 17)
    poke(tmp_path / "a" / USAGE_FILE, 0, PACED, 1_500_000_000)
    poke(tmp_path / "b" / USAGE_FILE, 1, USED, 1 << 62)  # scribbled: bounded by the GPU's memory
    compute = {"a": [TenantMetrics(0, 3_000_000_000, 7_000_000_000, 300, 1_000_000_000, 290_000_000, 100_000)]}
    daemon = FakeDaemon(tmp_path, [a, b], compute)
    daemon.schedules = {
        0: GpuSchedule(0, ComputePolicy.FAIR, 2, 0, 9, 9, 9, 0, 0, paced=True, busy_ended=3),
        1: GpuSchedule(1, ComputePolicy.FAIR, 1, 1, 9, 9, 9, 0, 0),
        7: GpuSchedule(7, ComputePolicy.FAIR, 0, 0, 0, 0, 0, 0, 0, paced=True),  # not this node's GPU
    }
    stats = DaemonStats()
    stats.request("admin", "CreateInstance")
    stats.request("admin", "ReleaseInstance", "NOT_FOUND")
    s = _scrape(CgpuCollector(daemon, stats, "9.9.9", {0: "Model A", 1: "Model B"}, lambda: {0: 55, 7: 1}))
    assert daemon.snapshots == 1

    ia = {
        "instance_id": "a",
        "gpu": "0",
        "UUID": "GPU-a",
        "modelName": "Model A",
        "owner_kind": "container",
        "owner": "ctr-a",
    }
    assert _one(s, "cgpu_instance_memory_limit_bytes", **ia) == 2 * GIB
    assert _one(s, "cgpu_instance_memory_used_bytes", **ia) == 512 * MIB
    assert _one(s, "cgpu_instance_launches_gated_total", **ia) == 17
    assert _one(s, "cgpu_instance_compute_paced_seconds_total", **ia) == 1.5
    assert _one(s, "cgpu_instance_compute_share_percent", **ia) == 30
    assert _one(s, "cgpu_instance_compute_achieved_percent", **ia) == 29
    assert _one(s, "cgpu_instance_compute_charged_seconds_total", **ia) == 3
    assert _one(s, "cgpu_instance_throttled_seconds_total", **ia) == 7
    assert _one(s, "cgpu_instance_compute_grants_total", **ia) == 300
    assert _one(s, "cgpu_instance_idle_grace_seconds", **ia) == 0.0001
    assert _one(s, "cgpu_instance_memory_used_bytes", instance_id="b", gpu="1") == 16 * GIB
    assert _one(s, "cgpu_instance_memory_used_bytes", instance_id="b", gpu="0") == 0
    # Not scheduled (no compute metrics): no achieved share rather than a made-up 0.
    assert not [lab for lab, _ in s.get("cgpu_instance_compute_achieved_percent", []) if lab["instance_id"] == "b"]

    assert _one(s, "cgpu_gpu_memory_allocated_bytes", gpu="0") == 3 * GIB
    assert _one(s, "cgpu_gpu_memory_allocated_bytes", gpu="1") == GIB
    assert _one(s, "cgpu_gpu_memory_total_bytes", gpu="1", modelName="Model B") == 16 * GIB
    assert _one(s, "cgpu_gpu_instances", gpu="0") == 2
    assert _one(s, "cgpu_gpu_compute_allocated_percent", gpu="0") == 30
    assert [lab["gpu"] for lab, _ in s["cgpu_gpu_utilization_percent"]] == ["0"]  # GPU 7 is not this node's
    assert _one(s, "cgpu_gpu_utilization_percent", gpu="0") == 55
    assert _one(s, "cgpu_gpu_compute_windowed", gpu="0") == 1
    assert _one(s, "cgpu_gpu_compute_windowed", gpu="1") == 0
    assert _one(s, "cgpu_gpu_compute_busy_windows_ended_total", gpu="0") == 3
    assert [lab["gpu"] for lab, _ in s["cgpu_gpu_compute_windowed"]] == ["0", "1"]

    assert _one(s, "cgpu_build_info", version="9.9.9") == 1
    assert _one(s, "cgpu_node_info", mode="core_mem", placement="binpack", compute_policy="native") == 1
    assert _one(s, "cgpu_requests_total", kind="admin", method="ReleaseInstance") == 1
    assert _one(s, "cgpu_request_errors_total", kind="admin", method="ReleaseInstance", code="NOT_FOUND") == 1
    assert _one(s, "cgpu_reconcile_duration_seconds_count") == 0
    assert _one(s, "cgpu_sweep_duration_seconds_bucket", le="+Inf") == 0


def test_a_broken_usage_file_leaves_only_its_tenant_reported_values_out(tmp_path: Path) -> None:
    a = _instance(tmp_path, "a", (Grant(0, "GPU-a", GIB, 0),))
    os.truncate(tmp_path / "a" / USAGE_FILE, 10)
    s = _scrape(CgpuCollector(FakeDaemon(tmp_path, [a], {}), DaemonStats(), "1"))
    assert _one(s, "cgpu_instance_memory_limit_bytes", instance_id="a") == GIB
    assert "cgpu_instance_memory_used_bytes" not in s
    assert "cgpu_gpu_utilization_percent" not in s  # no NVML given


@pytest.mark.parametrize("listen", ["9400", "host", "::1:9400", "[::1]", "h:99999", "[nope]:1"])
def test_a_bad_metrics_listen_is_one_usage_error_naming_the_setting(tmp_path: Path, listen: str) -> None:
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(UsageError, match="metrics_listen"):
        settings.load(tmp_path / "c.toml", {"metrics_listen": listen})


@pytest.mark.parametrize("listen", ["127.0.0.1:9400", "[::1]:0", "0.0.0.0:9400", ""])
def test_good_metrics_listen_values_are_taken(tmp_path: Path, listen: str) -> None:
    (tmp_path / "c.toml").write_text(f"metrics_listen = {listen!r}\n")
    assert settings.load(tmp_path / "c.toml", {}).metrics_listen == listen


class FakeLifecycle:
    """The relay's side of cgpud: prepares anything, refuses poststop."""

    class Prepared:
        def summary(self) -> str:
            return "prepared"

    def prepare(
        self, container_id: str, bundle: Path, *, hooks: bool = True, spec_fd: int | None = None
    ) -> FakeLifecycle.Prepared:
        return self.Prepared()

    def hook(self, stage: str, instance_id: str, state_json: bytes, decided: object = None) -> str:
        raise UsageError(f"no instance {instance_id}")


def _ask(path: Path, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        return s.makefile("rb").readline()


def test_relay_requests_are_counted_by_verb_and_outcome(tmp_path: Path) -> None:
    stats = DaemonStats()
    path = tmp_path / "relay.sock"
    relay = RelayServer(
        FakeLifecycle(),
        path,  # type: ignore[arg-type]  (duck-typed lifecycle)
        on_request=lambda verb, code: stats.request("relay", verb, code),
    ).start()
    try:
        assert _ask(path, b"prepare c1\n/b").startswith(b"ok ")
        assert _ask(path, b"prepare c2 shim-binds\n/b").startswith(b"ok ")
        assert _ask(path, b"prepare c3 other-flag\n/b").startswith(b"error ")  # malformed
        assert _ask(path, b"bind i1\n{}").startswith(b"error ")
        assert _ask(path, b"hook poststop i1\n{}").startswith(b"error ")
        assert _ask(path, b"hook createRuntime\n{}").startswith(b"error ")  # no instance id: malformed
        assert _ask(path, b"bogus x\n").startswith(b"error ")
    finally:
        relay.stop()
    requests, errors, _ = stats.snapshot()
    assert requests == {
        ("relay", "prepare"): 3,
        ("relay", "bind"): 1,
        ("relay", "hook poststop"): 1,
        ("relay", "hook createRuntime"): 1,
        ("relay", "other"): 1,
    }
    assert errors == {
        ("relay", "prepare", "error"): 1,
        ("relay", "bind", "error"): 1,
        ("relay", "hook poststop", "error"): 1,
        ("relay", "hook createRuntime", "error"): 1,
        ("relay", "other", "error"): 1,
    }


class FakeAllocator:
    def allocate(self, resource: object, device_ids: Sequence[str]) -> str:
        if "bad" in device_ids:
            raise UsageError("no such device")
        return "allocation"


def test_device_plugin_allocations_are_counted_and_errors_named() -> None:
    stats = DaemonStats()
    counted = CountedAllocator(FakeAllocator(), stats)  # type: ignore[arg-type]  (duck-typed allocator)
    assert counted.allocate(object(), ["gpu-0"]) == "allocation"  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        counted.allocate(object(), ["bad"])  # type: ignore[arg-type]
    requests, errors, _ = stats.snapshot()
    assert requests == {("device_plugin", "Allocate"): 2}
    assert errors == {("device_plugin", "Allocate", "UsageError"): 1}


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "[::1]:0"])
def test_the_server_answers_metrics_only_and_reports_its_port(listen: str) -> None:
    registry = CollectorRegistry(auto_describe=False)
    closed: list[bool] = []
    server = MetricsServer(registry, listen, on_close=lambda: closed.append(True)).start()
    try:
        port = server.endpoint.port
        assert port != 0
        host = server.endpoint.host
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/other", timeout=10)
        assert e.value.code == 404
        with pytest.raises(CgpuError, match=rf"cannot serve metrics on .*:{port}: .*in use"):
            MetricsServer(registry, f"{listen.rsplit(':', 1)[0]}:{port}").start()
    finally:
        server.stop()
    assert closed == [True]
