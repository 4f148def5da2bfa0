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

`decide` is the whole policy, a pure function of one GPU's state and one
observation; `HealthWatcher` is the I/O around it: one thread that waits on
the event set (at most `wait_ms` at a time, so stop() is bounded) and probes.
"""
from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import pynvml
import structlog

from cgpud.errors import GpuQueryError, UsageError

# XIDs that say an application failed, not the GPU (NVIDIA k8s-device-plugin).
DEFAULT_SKIPPED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
# A GPU with a fatal XID and no further one for this long is trusted again:
# long enough that a GPU failing every job that retries on it stays out,
# short enough that one transient XID does not strand a GPU until a reboot.
DEFAULT_RECOVERY_WINDOW = 300.0
DEFAULT_PROBE_INTERVAL = 5.0
DEFAULT_WAIT_MS = 1000

XID_NAMES = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


class GpuRef(Protocol):
    """A GPU as the inventory names it (cgpud.daemon.inventory.Gpu is one)."""

    @property
    def index(self) -> int: ...

    @property
    def uuid(self) -> str: ...


def parse_xids(text: str) -> frozenset[int]:
    """XIDs written as a setting: numbers separated by spaces or commas."""
    words = text.replace(",", " ").split()
    bad = [w for w in words if not w.isdigit() or not 1 <= int(w) <= 999]
    if bad:
        raise UsageError(f"XIDs must be numbers from 1 to 999 separated by spaces or commas; {bad[0]!r} is not")
    return frozenset(int(w) for w in words)


@dataclass(frozen=True)
class HealthPolicy:
    skipped_xids: frozenset[int] = DEFAULT_SKIPPED_XIDS
    recovery_window: float = DEFAULT_RECOVERY_WINDOW  # seconds; 0: only a reset recovers

    @classmethod
    def build(cls, extra_skipped: Iterable[int] = (), recovery_window: float = DEFAULT_RECOVERY_WINDOW) -> HealthPolicy:
        """NVIDIA's skipped XIDs plus `extra_skipped`."""
        extra = frozenset(extra_skipped)
        bad = sorted(x for x in extra if not 1 <= x <= 999)
        if bad:
            raise UsageError(f"XIDs to skip must be between 1 and 999, got {bad}")
        if recovery_window < 0:
            raise UsageError(f"the XID recovery window must be 0 (reset only) or more seconds, got {recovery_window}")
        return cls(DEFAULT_SKIPPED_XIDS | extra, recovery_window)

    def fatal(self, xid: int) -> bool:
        return xid not in self.skipped_xids


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's verdict (healthy, reason) and what the decision remembers."""

    index: int
    uuid: str
    healthy: bool = True
    reason: str = ""  # why not healthy; "" when healthy
    changed_at: float = 0.0  # monotonic seconds when the verdict last changed
    lost: bool = False  # the last probe failed with GPU_IS_LOST
    unreachable: str = ""  # the last probe's failure other than lost
    fatal_xid: int | None = None
    fatal_xid_at: float = 0.0


@dataclass(frozen=True)
class XidObserved:
    index: int
    xid: int
    at: float


@dataclass(frozen=True)
class ProbeObserved:
    index: int
    at: float
    lost: bool = False
    failure: str = ""  # NVML's message when the probe failed otherwise

    @property
    def ok(self) -> bool:
        return not self.lost and not self.failure


Observation = XidObserved | ProbeObserved


def xid_text(xid: int) -> str:
    name = XID_NAMES.get(xid)
    return f"XID {xid} ({name})" if name else f"XID {xid}"


def _verdict(state: GpuHealth) -> str:
    if state.lost:
        return "GPU is lost"
    if state.unreachable:
        return f"NVML cannot query the GPU: {state.unreachable}"
    if state.fatal_xid is not None:
        return f"fatal {xid_text(state.fatal_xid)}"
    return ""


def decide(state: GpuHealth, obs: Observation, policy: HealthPolicy) -> GpuHealth:
    """The GPU's state after one observation of it."""
    if isinstance(obs, XidObserved):
        if policy.fatal(obs.xid):
            state = replace(state, fatal_xid=obs.xid, fatal_xid_at=obs.at)
    elif obs.ok:
        # Back on the bus means the GPU was reset: its XIDs are history.
        cleared = {"fatal_xid": None, "fatal_xid_at": 0.0} if state.lost else {}
        state = replace(state, lost=False, unreachable="", **cleared)
    else:
        state = replace(state, lost=obs.lost, unreachable="" if obs.lost else obs.failure)
    if (state.fatal_xid is not None and policy.recovery_window > 0
            and obs.at - state.fatal_xid_at >= policy.recovery_window):
        state = replace(state, fatal_xid=None, fatal_xid_at=0.0)
    reason = _verdict(state)
    if reason != state.reason:
        state = replace(state, healthy=not reason, reason=reason, changed_at=obs.at)
    return state


def apply(snapshot: Mapping[int, GpuHealth], obs: Observation, policy: HealthPolicy) -> dict[int, GpuHealth]:
    """Every GPU's state after an observation (of one GPU; others unchanged).
    An observation of a GPU the snapshot lacks changes nothing."""
    out = dict(snapshot)
    if obs.index in out:
        out[obs.index] = decide(out[obs.index], obs, policy)
    return out


def healthy_by_index(snapshot: Mapping[int, GpuHealth]) -> dict[int, bool]:
    """The map DevicePlugin.update(health=...) takes."""
    return {i: h.healthy for i, h in snapshot.items()}


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

    def __init__(self, gpus: Sequence[GpuRef], on_change: Callable[[dict[int, GpuHealth]], None], *,
                 policy: HealthPolicy | None = None, probe_interval: float = DEFAULT_PROBE_INTERVAL,
                 wait_ms: int = DEFAULT_WAIT_MS, clock: Callable[[], float] = time.monotonic) -> None:
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
            self._log.warning("gpu_health_changed", gpu=h.index, uuid=h.uuid,
                              health="Healthy" if h.healthy else "Unhealthy", reason=h.reason)
        if not changed or not notify:
            return
        try:
            self._on_change(dict(after))
        except Exception:
            self._log.exception("gpu_health_callback_failed")
