"""GPU health for the device plugin: which GPUs are Healthy, and why not.

Two sources, as NVIDIA's own device plugin reads them, plus a probe:
- XIDs from NVML's event API (nvmlEventSetWait). An XID that only says an
  application failed (NVIDIA's list: 13, 31, 43, 45, 68, 109, plus any the
  policy adds) changes nothing; any other is fatal: the GPU is Unhealthy
  until it is reset (seen as lost, then answering again) or until
  `recovery_window` seconds pass with no further fatal XID.
- A probe of every GPU each `probe_interval` (its handle by UUID, then its
  memory info): GPU_IS_LOST makes it Unhealthy "GPU is lost", any other
  failure Unhealthy with NVML's message; answering again makes it Healthy.

`decide` (cgpud.kube.health_policy) is the whole policy, a pure function of
one GPU's state and one observation; `HealthWatcher` is the I/O around it:
one thread that waits on the event set (at most `wait_ms` at a time, so
stop() is bounded) and probes.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml
import structlog

from cgpud.errors import GpuQueryError, UsageError
from cgpud.kube.health_policy import DEFAULT_PROBE_INTERVAL, DEFAULT_RECOVERY_WINDOW, DEFAULT_SKIPPED_XIDS
from cgpud.kube.health_policy import DEFAULT_WAIT_MS, XID_NAMES, GpuHealth, GpuRef, HealthPolicy, Observation
from cgpud.kube.health_policy import ProbeObserved, XidObserved, apply, decide, healthy_by_index, parse_xids, xid_text

__all__ = [
    "DEFAULT_PROBE_INTERVAL",
    "DEFAULT_RECOVERY_WINDOW",
    "DEFAULT_SKIPPED_XIDS",
    "DEFAULT_WAIT_MS",
    "XID_NAMES",
    "GpuHealth",
    "GpuRef",
    "HealthPolicy",
    "HealthWatcher",
    "Observation",
    "ProbeObserved",
    "XidObserved",
    "apply",
    "decide",
    "healthy_by_index",
    "parse_xids",
    "xid_text",
]


def _address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


@dataclass
class _Gpu:
    index: int
    uuid: str
    registered: bool = False
    events_unsupported: bool = False
    handle_address: int | None = None


@dataclass
class _Watch:
    """What the watcher thread owns while it runs."""

    event_set: Any
    gpus: list[_Gpu] = field(default_factory=list)


class HealthWatcher:
    """Watches the GPUs' health through NVML; calls `on_change` with every
    GPU's state (from its own thread) whenever a verdict changes.

    start() initialises NVML, probes once and registers for XIDs, so
    snapshot() holds a verdict for each GPU as soon as it returns (that
    first verdict is not passed to on_change); it raises
    GpuQueryError when NVML cannot be used at all. stop() returns within
    about wait_ms plus one probe of every GPU."""

    def __init__(
        self,
        gpus: Sequence[GpuRef],
        on_change: Callable[[dict[int, GpuHealth]], None],
        *,
        policy: HealthPolicy | None = None,
        probe_interval: float = DEFAULT_PROBE_INTERVAL,
        wait_ms: int = DEFAULT_WAIT_MS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if probe_interval <= 0:
            raise UsageError(f"the GPU probe interval must be more than 0 seconds, got {probe_interval}")
        if not 1 <= wait_ms <= 60_000:
            raise UsageError(f"the NVML event wait must be 1-60000 ms, got {wait_ms}")
        self._policy = policy or HealthPolicy()
        self._on_change = on_change
        self._probe_interval = probe_interval
        self._wait_ms = wait_ms
        self._clock = clock
        self._log = structlog.get_logger("cgpud.health")
        self._lock = threading.Lock()
        now = clock()
        self._snapshot = {g.index: GpuHealth(g.index, g.uuid, changed_at=now) for g in gpus}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: _Watch | None = None

    def snapshot(self) -> dict[int, GpuHealth]:
        with self._lock:
            return dict(self._snapshot)

    def start(self) -> HealthWatcher:
        if self._thread is not None:
            raise RuntimeError("HealthWatcher.start called twice")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise GpuQueryError(f"cannot initialise NVML to watch GPU health: {e}") from e
        try:
            event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            pynvml.nvmlShutdown()
            raise GpuQueryError(f"cannot create an NVML event set to watch GPU XIDs: {e}") from e
        self._watch = _Watch(event_set, [_Gpu(h.index, h.uuid) for h in self._snapshot.values()])
        self._probe_all(self._watch, notify=False)
        self._thread = threading.Thread(target=self._run, args=(self._watch,), name="cgpud-gpu-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is None:
            return
        # One wait, then at most one probe round of every GPU.
        thread.join(self._wait_ms / 1000 + 2.0 + 0.5 * len(self._snapshot))
        if thread.is_alive():
            self._log.error("gpu_health_stop_timeout", detail="the NVML health thread did not stop; abandoned")

    # ---- the thread --------------------------------------------------------

    def _run(self, watch: _Watch) -> None:
        try:
            self._loop(watch)
        except Exception:
            self._log.exception("gpu_health_thread_failed")
        finally:
            for release in (lambda: pynvml.nvmlEventSetFree(watch.event_set), pynvml.nvmlShutdown):
                try:
                    release()
                except pynvml.NVMLError as e:
                    self._log.warning("gpu_health_release_failed", error=str(e))

    def _loop(self, watch: _Watch) -> None:
        next_probe = self._clock() + self._probe_interval
        while not self._stop.is_set():
            timeout_ms = max(1, min(self._wait_ms, int((next_probe - self._clock()) * 1000)))
            try:
                data = pynvml.nvmlEventSetWait_v2(watch.event_set, timeout_ms)
            except pynvml.NVMLError as e:
                if e.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                    # The set stays in that state until the GPU is back:
                    # find which GPU, then wait a probe interval, not a spin.
                    self._probe_all(watch)
                    next_probe = self._clock() + self._probe_interval
                    self._stop.wait(self._probe_interval)
                elif e.value != pynvml.NVML_ERROR_TIMEOUT:
                    self._log.warning("gpu_event_wait_failed", error=str(e))
                    self._stop.wait(min(1.0, self._probe_interval))
            else:
                self._on_event(watch, data)
            if self._clock() >= next_probe and not self._stop.is_set():
                self._probe_all(watch)
                next_probe = self._clock() + self._probe_interval

    def _on_event(self, watch: _Watch, data: Any) -> None:
        if not data.eventType & pynvml.nvmlEventTypeXidCriticalError:
            return
        address = _address(data.device)
        gpu = next((g for g in watch.gpus if g.handle_address == address), None)
        if gpu is None:
            self._log.warning("gpu_xid_unknown_device", xid=int(data.eventData))
            return
        xid = int(data.eventData)
        fatal = self._policy.fatal(xid)
        self._log.warning("gpu_xid", gpu=gpu.index, uuid=gpu.uuid, xid=xid, fatal=fatal, what=xid_text(xid))
        self._observe(XidObserved(gpu.index, xid, self._clock()))

    def _probe_all(self, watch: _Watch, notify: bool = True) -> None:
        for gpu in watch.gpus:
            if self._stop.is_set():
                return
            obs = self._probe(gpu)
            if obs.ok and not gpu.registered and not gpu.events_unsupported:
                self._register(watch, gpu)
            if not obs.ok:
                gpu.registered = False  # after a reset, register again
            self._observe(obs, notify)

    def _probe(self, gpu: _Gpu) -> ProbeObserved:
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            pynvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError as e:
            lost = e.value == pynvml.NVML_ERROR_GPU_IS_LOST
            return ProbeObserved(gpu.index, self._clock(), lost=lost, failure="" if lost else str(e))
        return ProbeObserved(gpu.index, self._clock())

    def _register(self, watch: _Watch, gpu: _Gpu) -> None:
        """XID events of one GPU into the set. A GPU without them is watched
        by the probe alone."""
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
            if not supported & pynvml.nvmlEventTypeXidCriticalError:
                gpu.events_unsupported = True
                self._log.warning("gpu_xid_events_unsupported", gpu=gpu.index, uuid=gpu.uuid)
                return
            pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, watch.event_set)
        except pynvml.NVMLError as e:
            if e.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                gpu.events_unsupported = True
            self._log.warning("gpu_xid_register_failed", gpu=gpu.index, uuid=gpu.uuid, error=str(e))
            return
        gpu.handle_address = _address(handle)
        gpu.registered = True

    def _observe(self, obs: Observation, notify: bool = True) -> None:
        with self._lock:
            before = self._snapshot
            after = apply(before, obs, self._policy)
            self._snapshot = after
        changed = [h for i, h in after.items() if (h.healthy, h.reason) != (before[i].healthy, before[i].reason)]
        for h in changed:
            self._log.warning(
                "gpu_health_changed",
                gpu=h.index,
                uuid=h.uuid,
                health="Healthy" if h.healthy else "Unhealthy",
                reason=h.reason,
            )
        if not changed or not notify:
            return
        try:
            self._on_change(dict(after))
        except Exception:
            self._log.exception("gpu_health_callback_failed")
