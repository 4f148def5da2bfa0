"""cgpud's Prometheus metrics (`metrics_listen`, GET /metrics).

Values are built at scrape time from cgpud's own state: one store snapshot
(the active instances), the compute engine's per-instance accounting, one
read of each instance's usage file, one NVML utilisation query per GPU. No
module-level registry: each daemon owns a CollectorRegistry with one
Collector. Names and labels follow dcgm-exporter (gpu, UUID, modelName) and
HAMi's vGPU monitor; docs/metrics.md maps them.

Ownership: MetricsServer owns its HTTP server thread from start() to stop().
Thread-safety: the Collector runs on the HTTP server's threads and only
reads (DaemonStats, stats.py, has its own lock)."""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from cgpud._region import ffi as _region_ffi
from cgpud._region import lib as _region_lib
from cgpud.api.listen import Endpoint, parse_endpoint
from cgpud.boundedhttp import BoundedHandler, BoundedServer, Bounds
from cgpud.node.bypass_model import BypassEvents
from cgpud.node.compute import GpuSchedule, TenantMetrics
from cgpud.node.inventory import NvmlHandles
from cgpud.node.model import GpuCapacity, Instance, NodePolicy, Reservation
from cgpud.node.region import USAGE_FILE
from cgpud.daemon.stats import DURATION_BUCKETS, DaemonStats
from cgpud.errors import CgpuError

_DEVICE_OFFSET = _region_ffi.offsetof("struct cgpu_usage", "device")
_DEVICE_SIZE = _region_ffi.sizeof("struct cgpu_device_usage")
_USED_OFFSET = _region_ffi.offsetof("struct cgpu_device_usage", "used")
_GATED_OFFSET = _region_ffi.offsetof("struct cgpu_device_usage", "gated")
_PACED_OFFSET = _region_ffi.offsetof("struct cgpu_device_usage", "paced_ns")
_MAX_DEVICES: int = _region_lib.CGPU_MAX_DEVICES


@dataclass(frozen=True)
class DeviceUsage:
    used: int  # bytes, as the tenant's processes account them
    gated: int  # launches that waited at a closed gate, as they count them
    paced_ns: int  # device time of their launches while paced in their window, as they measure it


def read_usage(path: os.PathLike[str] | str, slots: int) -> list[DeviceUsage] | None:
    """The tenant-written counters of the first `slots` devices of a usage
    file, in one read; None when the file is missing, not a regular file or
    cut short (a tenant can truncate it). Values are not yet bounded."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        size = slots * _DEVICE_SIZE
        raw = os.pread(fd, size, _DEVICE_OFFSET)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) < size:
        return None
    out = []
    for slot in range(slots):
        base = slot * _DEVICE_SIZE
        out.append(
            DeviceUsage(
                int.from_bytes(raw[base + _USED_OFFSET : base + _USED_OFFSET + 8], "little"),
                int.from_bytes(raw[base + _GATED_OFFSET : base + _GATED_OFFSET + 8], "little"),
                int.from_bytes(raw[base + _PACED_OFFSET : base + _PACED_OFFSET + 8], "little"),
            )
        )
    return out


class MetricsSource(Protocol):
    """What the collector needs of the daemon (InstanceService has it)."""

    def holdings(self) -> tuple[list[Instance], list[Reservation]]: ...

    def gpus(self) -> tuple[GpuCapacity, ...]: ...

    def policy(self) -> NodePolicy: ...

    def compute_metrics(self) -> dict[str, list[TenantMetrics]]: ...

    def compute_schedules(self) -> dict[int, GpuSchedule]: ...

    def region_dir(self, instance_id: str) -> os.PathLike[str]: ...


class NvmlUtilisation:
    """Device busy percent from NVML, one query per GPU per scrape. NVML is
    initialised once for the server's life; GPUs it cannot answer for are
    left out of the scrape rather than shown idle."""

    def __init__(self, indexes: Iterable[int]) -> None:
        import pynvml

        self._nvml = pynvml
        self._log = structlog.get_logger("cgpud.metrics")
        self._gpus = NvmlHandles(
            pynvml,
            indexes,
            self._log,
            "GPU utilisation is not reported: NVML does not start",
            "GPU utilisation is not reported",
        )

    def __call__(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for index, handle in self._gpus.handles.items():
            try:
                out[index] = int(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except self._nvml.NVMLError:
                continue
        return out

    def close(self) -> None:
        self._gpus.close()


_GPU_LABELS = ("gpu", "UUID", "modelName")
_INSTANCE_LABELS = ("instance_id", "owner_kind", "owner", *_GPU_LABELS)


class CgpuCollector(Collector):
    """Builds every cgpu_* family from the daemon's state at scrape time."""

    def __init__(
        self,
        source: MetricsSource,
        stats: DaemonStats,
        version: str,
        models: Mapping[int, str] | None = None,
        utilisation: Callable[[], Mapping[int, int]] | None = None,
        events: BypassEvents | None = None,
    ):
        self._source = source
        self._stats = stats
        self._version = version
        self._models = dict(models or {})
        self._utilisation = utilisation
        self._events = events

    def _gpu_labels(self, gpu: GpuCapacity) -> list[str]:
        return [str(gpu.index), gpu.uuid, self._models.get(gpu.index, "")]

    def collect(self) -> Iterator[Metric]:
        yield from self._daemon()
        gpus = {g.index: g for g in self._source.gpus()}
        instances, _ = self._source.holdings()  # one store snapshot
        yield from self._per_gpu(gpus, instances)
        yield from self._per_instance(gpus, instances)

    def _daemon(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("cgpu_build_info", "cgpud's version; always 1", labels=["version"])
        info.add_metric([self._version], 1)
        yield info
        yield GaugeMetricFamily(
            "cgpu_start_time_seconds", "when this cgpud started (Unix time)", value=self._stats.started
        )
        policy = self._source.policy()
        node = GaugeMetricFamily(
            "cgpu_node_info",
            "the node's mode, placement and compute policy; always 1",
            labels=["mode", "placement", "compute_policy"],
        )
        node.add_metric([policy.mode.value, policy.placement.value, policy.compute_policy.name.lower()], 1)
        yield node
        requests, errors, durations = self._stats.snapshot()
        total = CounterMetricFamily(
            "cgpu_requests", "requests cgpud answered, by kind and method", labels=["kind", "method"]
        )
        for (kind, method), n in sorted(requests.items()):
            total.add_metric([kind, method], n)
        yield total
        failed = CounterMetricFamily(
            "cgpu_request_errors",
            "requests cgpud refused or failed, by kind, method and code",
            labels=["kind", "method", "code"],
        )
        for (kind, method, code), n in sorted(errors.items()):
            failed.add_metric([kind, method, code], n)
        yield failed
        for what, doc in (
            ("reconcile", "how long each reconcile of the instance tables took"),
            ("sweep", "how long each sweep of the instance tables took"),
            ("bypass", "how long each round of the bypass watchdog took"),
        ):
            h = HistogramMetricFamily(f"cgpu_{what}_duration_seconds", doc)
            buckets, total_s = durations.get(what, ([(f"{b:g}", 0) for b in DURATION_BUCKETS] + [("+Inf", 0)], 0.0))
            h.add_metric([], buckets, total_s)
            yield h
        yield from self._bypass()

    def _bypass(self) -> Iterator[Metric]:
        by_kind, killed = self._events.totals() if self._events is not None else ({}, 0)
        events = CounterMetricFamily(
            "cgpu_bypass_events",
            "the bypass watchdog's reports and kills, by kind of violation and action",
            labels=["kind", "action"],
        )
        for (kind, action), n in sorted(by_kind.items()):
            events.add_metric([kind, action], n)
        yield events
        yield CounterMetricFamily("cgpu_bypass_processes_killed", "processes the bypass watchdog killed", value=killed)

    def _per_gpu(self, gpus: Mapping[int, GpuCapacity], instances: Sequence[Instance]) -> Iterator[Metric]:
        total = GaugeMetricFamily("cgpu_gpu_memory_total_bytes", "GPU memory (NVML total)", labels=_GPU_LABELS)
        allocated = GaugeMetricFamily(
            "cgpu_gpu_memory_allocated_bytes", "GPU memory granted to active instances", labels=_GPU_LABELS
        )
        cores = GaugeMetricFamily(
            "cgpu_gpu_compute_allocated_percent", "compute shares granted to active instances", labels=_GPU_LABELS
        )
        count = GaugeMetricFamily("cgpu_gpu_instances", "active instances on the GPU", labels=_GPU_LABELS)
        held: dict[int, list[int]] = {i: [0, 0, 0] for i in gpus}
        for instance in instances:
            for grant in instance.grants:
                h = held.setdefault(grant.gpu_index, [0, 0, 0])
                h[0] += grant.memory
                h[1] += grant.core_percent
                h[2] += 1
        for index, gpu in sorted(gpus.items()):
            labels = self._gpu_labels(gpu)
            total.add_metric(labels, gpu.memory)
            allocated.add_metric(labels, held[index][0])
            cores.add_metric(labels, held[index][1])
            count.add_metric(labels, held[index][2])
        yield from (total, allocated, cores, count)
        yield from self._schedules(gpus)
        if self._utilisation is not None:
            busy = GaugeMetricFamily(
                "cgpu_gpu_utilization_percent",
                "percent of the last sample period the GPU was busy (NVML)",
                labels=_GPU_LABELS,
            )
            for index, percent in sorted(self._utilisation().items()):
                if index in gpus:
                    busy.add_metric(self._gpu_labels(gpus[index]), percent)
            yield busy

    def _schedules(self, gpus: Mapping[int, GpuCapacity]) -> Iterator[Metric]:
        windowed = GaugeMetricFamily(
            "cgpu_gpu_compute_windowed",
            "1 while every instance on the GPU keeps to its own window of each period by itself "
            "(fixed_windows, busy_windows) and the scheduler hands out no slices",
            labels=_GPU_LABELS,
        )
        ended = CounterMetricFamily(
            "cgpu_gpu_compute_busy_windows_ended",
            "times busy windows ended because an instance left its window unused",
            labels=_GPU_LABELS,
        )
        for index, s in sorted(self._source.compute_schedules().items()):
            if index in gpus:
                labels = self._gpu_labels(gpus[index])
                windowed.add_metric(labels, int(s.paced))
                ended.add_metric(labels, s.busy_ended)
        yield from (windowed, ended)

    def _per_instance(self, gpus: Mapping[int, GpuCapacity], instances: Sequence[Instance]) -> Iterator[Metric]:
        limit = GaugeMetricFamily(
            "cgpu_instance_memory_limit_bytes", "GPU memory the instance may hold", labels=_INSTANCE_LABELS
        )
        used = GaugeMetricFamily(
            "cgpu_instance_memory_used_bytes",
            "GPU memory the instance's processes hold, "
            "as they report it in the usage file (tenant-reported, bounded by the GPU's memory)",
            labels=_INSTANCE_LABELS,
        )
        share = GaugeMetricFamily(
            "cgpu_instance_compute_share_percent",
            "compute share granted (0: no compute limit)",
            labels=_INSTANCE_LABELS,
        )
        achieved = GaugeMetricFamily(
            "cgpu_instance_compute_achieved_percent",
            "device time charged to the instance over the scheduler's last 1 s window, in percent",
            labels=_INSTANCE_LABELS,
        )
        charged = CounterMetricFamily(
            "cgpu_instance_compute_charged_seconds",
            "device time charged to the instance by the compute scheduler",
            labels=_INSTANCE_LABELS,
        )
        throttled = CounterMetricFamily(
            "cgpu_instance_throttled_seconds",
            "time the instance had launches waiting at its closed gate",
            labels=_INSTANCE_LABELS,
        )
        grants = CounterMetricFamily(
            "cgpu_instance_compute_grants", "times the scheduler opened the instance's gate", labels=_INSTANCE_LABELS
        )
        grace = GaugeMetricFamily(
            "cgpu_instance_idle_grace_seconds",
            "how long the instance may hold the GPU "
            "idle while another instance waits: the full grace, or none once it has shown "
            "it stays idle",
            labels=_INSTANCE_LABELS,
        )
        gated = CounterMetricFamily(
            "cgpu_instance_launches_gated",
            "launches that waited at a closed gate (tenant-reported)",
            labels=_INSTANCE_LABELS,
        )
        paced = CounterMetricFamily(
            "cgpu_instance_compute_paced_seconds",
            "device time of the instance's launches while they kept to its window of each period by themselves "
            "(fixed_windows, busy_windows, or cgpud away), as its processes measure it (tenant-reported)",
            labels=_INSTANCE_LABELS,
        )
        violations = CounterMetricFamily(
            "cgpu_instance_bypass_violations",
            "the bypass watchdog's reports and kills for the instance (on any of its GPUs)",
            labels=_INSTANCE_LABELS,
        )
        compute = self._source.compute_metrics()
        for instance in instances:
            by_gpu = {m.gpu: m for m in compute.get(instance.id, [])}
            usage = (
                read_usage(
                    os.path.join(self._source.region_dir(instance.id), USAGE_FILE),
                    min(len(instance.grants), _MAX_DEVICES),
                )
                if instance.enforced
                else None
            )
            counted = self._events.count(instance.id) if self._events is not None else 0
            for slot, grant in enumerate(instance.grants):
                gpu = gpus.get(grant.gpu_index)
                labels = [
                    instance.id,
                    instance.owner.kind.value,
                    instance.owner.id,
                    str(grant.gpu_index),
                    grant.gpu_uuid,
                    self._models.get(grant.gpu_index, ""),
                ]
                limit.add_metric(labels, grant.memory or (gpu.memory if gpu else 0))
                if slot == 0:  # one series per instance: events are not kept per GPU
                    violations.add_metric(labels, counted)
                share.add_metric(labels, grant.core_percent)
                if usage is not None and slot < len(usage):
                    bound = gpu.memory if gpu else grant.memory
                    used.add_metric(labels, min(usage[slot].used, bound))
                    gated.add_metric(labels, usage[slot].gated)
                    paced.add_metric(labels, usage[slot].paced_ns / 1e9)
                m = by_gpu.get(grant.gpu_index)
                if m is not None:
                    achieved.add_metric(labels, round(m.achieved_percent, 3))
                    charged.add_metric(labels, m.charged_ns / 1e9)
                    throttled.add_metric(labels, m.throttled_ns / 1e9)
                    grants.add_metric(labels, m.grants)
                    grace.add_metric(labels, m.idle_grace_ns / 1e9)
        yield from (limit, used, share, achieved, charged, throttled, grants, grace, gated, paced, violations)


# A scrape is one short GET: few connections, little patience (boundedhttp.py).
BOUNDS = Bounds(max_connections=16, idle_timeout=10.0, body_budget=0)


class _Server(BoundedServer, WSGIServer):
    bounds = BOUNDS


class _QuietHandler(BoundedHandler, WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # `format`: the base class's parameter name
        pass  # one line per scrape would drown cgpud's log

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:
            self.answering()  # the request line and headers are in: the scrape is ours to answer
        return ok


def _only_metrics(app: Callable[..., Any]) -> Callable[..., Any]:
    def routed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"cgpud serves /metrics only\n"]
        return app(environ, start_response)

    return routed


class MetricsServer:
    """GET /metrics over HTTP on one HOST:PORT (plaintext: no tenant data
    beyond counts and instance ids; bind it where only your Prometheus
    reaches)."""

    def __init__(self, registry: CollectorRegistry, listen: str, on_close: Callable[[], None] = lambda: None):
        self._registry = registry
        self._endpoint: Endpoint = parse_endpoint(listen, "metrics_listen")
        self._on_close = on_close
        self._server: _Server | None = None

    @property
    def endpoint(self) -> Endpoint:
        """Where it listens; the real port once started (listen said 0)."""
        if self._server is None:
            return self._endpoint
        return Endpoint(self._endpoint.host, self._server.server_address[1])

    def start(self) -> MetricsServer:
        host = self._endpoint.host
        try:
            family = socket.getaddrinfo(host, self._endpoint.port, type=socket.SOCK_STREAM)[0][0]
        except socket.gaierror as e:
            raise CgpuError(f"cannot serve metrics on {self._endpoint}: {e.strerror}") from e

        class Server(_Server):
            address_family = family

        try:
            server = make_server(
                host,
                self._endpoint.port,
                _only_metrics(make_wsgi_app(self._registry)),
                Server,
                handler_class=_QuietHandler,
            )
        except OSError as e:
            raise CgpuError(f"cannot serve metrics on {self._endpoint}: {e.strerror or e}") from e
        self._server = server
        server.start_reaper()
        threading.Thread(target=server.serve_forever, name="cgpud-metrics", daemon=True).start()
        structlog.get_logger("cgpud.metrics").info("serving metrics", listen=str(self.endpoint))
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        self._on_close()


def serve_metrics(
    listen: str,
    source: MetricsSource,
    stats: DaemonStats,
    version: str,
    models: Mapping[int, str],
    events: BypassEvents | None = None,
) -> MetricsServer:
    """A started MetricsServer with its own registry and collector;
    `events` is the bypass watchdog's ring (its counters are 0 without it)."""
    nvml = NvmlUtilisation(models.keys())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CgpuCollector(source, stats, version, models, nvml, events))
    server = MetricsServer(registry, listen, on_close=nvml.close)
    try:
        return server.start()
    except CgpuError:
        nvml.close()
        raise
