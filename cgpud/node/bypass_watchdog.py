"""The bypass watchdog: each round, what NVML says runs on the GPUs is held
against the instances' limits, and processes that went around libcgpu are
reported (and killed in kill mode).

The decision is pure (bypass_policy.decide), the /proc side and the kill
live in procmap.py; this module owns the I/O of NVML, the loop, the
debounce of events and the event log lines.

Ownership: NvmlProcessReader holds NVML from its construction to close().
BypassWatchdog is driven by one thread (start()); the reader, the mapper
and the debounce state are touched by that thread only. BypassEvents is
thread-safe and shared with the API and the metrics."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from cgpud.node import bypass_policy, procmap
from cgpud.node.bypass_model import BypassAction, BypassEvent, BypassEvents, ComputeView, EventAction, GpuProcess
from cgpud.node.bypass_model import ProcessIdentity, Violation, ViolationKind, WatchSettings
from cgpud.node.compute_policy import limits_compute
from cgpud.node.inventory import NvmlHandles
from cgpud.node.model import ComputePolicy, Instance, NodeMode, NodePolicy, isolates
from cgpud.errors import CgpuError

if TYPE_CHECKING:
    from cgpud.node.compute import TenantMetrics
    from cgpud.node.model import Reservation

# Modes whose instances are isolated: there a process outside libcgpu's
# reach breaks a promise cgpud made.
# Policies under which a share is also a ceiling (the others lend idle time).
CAPPING_POLICIES = (ComputePolicy.FIXED, ComputePolicy.SOFT)
# An ongoing violation is reported again this often (seconds) in report mode.
REPEAT_S = 60.0
# Longest stretch one utilisation sample stands for: the simulator averages
# at most 1 s, real drivers sample every ~1/6 s (the gap between samples of
# one answer narrows it, see _UtilWindow).
_SAMPLE_CAP_US = 1_000_000


class RoundTimer(Protocol):
    """Times a round for the metrics (cgpud.daemon.metrics.DaemonStats is one)."""

    def timed(self, what: str, fn: Callable[[], object]) -> object: ...


@dataclass
class _UtilWindow:
    """One GPU's per-process utilisation samples over the compute window.

    NVML returns a sample only for a process that was busy in the sampled
    period, so a plain mean of the samples would call a process that is
    busy in bursts fully busy. Each sample instead stands for the time since
    the previous sample on the GPU (at most one driver sampling period), and
    a process's figure is sm% x time summed over the window divided by the
    window: periods without a sample count as idle."""

    started_us: int  # when watching began: the window never reaches back past it
    last_seen_us: int  # the newest sample timestamp read (NVML's lastSeenTimeStamp)
    period_us: int = _SAMPLE_CAP_US
    supported: bool = True
    samples: deque[tuple[int, int, int, float]] = field(default_factory=deque)  # (timestamp µs, covered µs, pid, sm%)

    def add(self, raw: Iterable[Any]) -> None:
        by_stamp: dict[int, list[Any]] = {}
        for s in raw:
            if int(s.timeStamp) > self.last_seen_us:
                by_stamp.setdefault(int(s.timeStamp), []).append(s)
        stamps = sorted(by_stamp)
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        if gaps:  # several sampling periods in one answer: the driver's period shows
            self.period_us = min(self.period_us, min(gaps))
        previous = self.last_seen_us
        for stamp in stamps:
            covered = min(stamp - previous, self.period_us, _SAMPLE_CAP_US)
            for s in by_stamp[stamp]:
                self.samples.append((stamp, covered, int(s.pid), float(s.smUtil)))
            previous = stamp
        if stamps:
            self.last_seen_us = stamps[-1]

    def means(self, now_us: int, window_us: int) -> dict[int, float]:
        start = max(now_us - window_us, self.started_us)
        while self.samples and self.samples[0][0] <= start:
            self.samples.popleft()
        if now_us <= start:
            return {}
        total: dict[int, float] = {}
        for stamp, covered, pid, sm in self.samples:
            inside = min(stamp, now_us) - max(stamp - covered, start)  # the part of its period in the window
            total[pid] = total.get(pid, 0.0) + sm * max(inside, 0)
        return {pid: min(100.0, w / (now_us - start)) for pid, w in total.items()}


class NvmlProcessReader:
    """What NVML lists on each GPU: the running processes (compute, graphics
    and, in mps mode, MPS clients), their memory, and their utilisation
    averaged over `window_s`. NVML is initialised once for the reader's life;
    a GPU NVML cannot answer for is left out of a round (logged when that
    starts and when it ends), never shown empty."""

    def __init__(
        self, gpu_indexes: Iterable[int], window_s: float, nvml: Any = None, clock: Callable[[], float] = time.time
    ) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml = nvml
        self.window_s = window_s
        self._clock = clock
        self._log = structlog.get_logger("cgpud.bypass")
        self._util: dict[int, _UtilWindow] = {}
        self._trouble: dict[int, str] = {}  # GPU -> the error it answers, while it does
        self._versioned: dict[str, str] = {}  # list name -> the pynvml function that works here
        self._no_mps: set[int] = set()
        self._gpus = NvmlHandles(
            nvml,
            gpu_indexes,
            self._log,
            "the bypass watchdog reads no GPU: NVML does not start",
            "the bypass watchdog does not read this GPU",
        )

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(self._gpus.handles)

    def compute_supported(self, gpu: int) -> bool:
        """False once NVML said it has no per-process utilisation there."""
        window = self._util.get(gpu)
        return window is None or window.supported

    def read(self, mps: bool = False) -> list[GpuProcess]:
        out: list[GpuProcess] = []
        now_us = int(self._clock() * 1e6)
        for gpu, handle in self._gpus.handles.items():
            try:
                memory = self._processes(gpu, handle, mps)
                util = self._utilisation(gpu, handle, now_us)
            except self._nvml.NVMLError as e:
                if self._trouble.get(gpu) != str(e):
                    self._log.error("the bypass watchdog skips a GPU NVML does not answer for", gpu=gpu, error=str(e))
                    self._trouble[gpu] = str(e)
                continue
            if self._trouble.pop(gpu, None) is not None:
                self._log.info("the bypass watchdog reads a GPU again", gpu=gpu)
            out.extend(
                GpuProcess(gpu, pid, used, util.get(pid) if util is not None else None)
                for pid, used in sorted(memory.items())
            )
        return out

    def _list(self, name: str, handle: Any) -> list[Any]:
        """One of NVML's process lists, through the newest layout this
        driver has (`..._v3`, else `..._v2` on older drivers)."""
        nvml = self._nvml
        chosen = self._versioned.get(name, name)
        try:
            return list(getattr(nvml, chosen)(handle))
        except (nvml.NVMLError_FunctionNotFound, nvml.NVMLLibraryMismatchError):
            if chosen != name:
                raise
            self._versioned[name] = f"{name}_v2"
            return list(getattr(nvml, f"{name}_v2")(handle))

    def _processes(self, gpu: int, handle: Any, mps: bool) -> dict[int, int | None]:
        nvml = self._nvml
        lists = [
            self._list("nvmlDeviceGetComputeRunningProcesses", handle),
            self._list("nvmlDeviceGetGraphicsRunningProcesses", handle),
        ]
        if mps and gpu not in self._no_mps:
            try:
                lists.append(self._list("nvmlDeviceGetMPSComputeRunningProcesses", handle))
            except (nvml.NVMLError_FunctionNotFound, nvml.NVMLError_NotSupported, nvml.NVMLLibraryMismatchError) as e:
                self._no_mps.add(gpu)  # the other lists still show MPS clients' server
                self._log.warning("NVML lists no MPS clients on this GPU", gpu=gpu, error=str(e))
        memory: dict[int, int | None] = {}
        for listed in lists:
            for p in listed:
                pid, used = int(p.pid), p.usedGpuMemory
                if pid <= 0:  # not visible from here: nothing to map or kill
                    continue
                if used is not None and used >= (1 << 64) - 1:  # NVML_VALUE_NOT_AVAILABLE, raw
                    used = None
                known = memory.get(pid)
                memory[pid] = used if known is None else (known if used is None else max(known, int(used)))
        return memory

    def _utilisation(self, gpu: int, handle: Any, now_us: int) -> dict[int, float] | None:
        nvml = self._nvml
        window = self._util.get(gpu)
        if window is None:  # watching starts now: older samples are not this window's
            window = self._util[gpu] = _UtilWindow(started_us=now_us, last_seen_us=now_us)
            return None
        if not window.supported:
            return None
        try:
            window.add(nvml.nvmlDeviceGetProcessUtilization(handle, window.last_seen_us))
        except nvml.NVMLError_NotFound:
            pass  # no sample newer than the last one: every process was idle
        except nvml.NVMLError_InsufficientSize:
            pass  # a process started between pynvml's two calls: the next round reads it
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound) as e:
            window.supported = False
            self._log.warning(
                "the compute rule is off on this GPU: NVML has no per-process utilisation", gpu=gpu, error=str(e)
            )
            return None
        except nvml.NVMLError as e:
            if getattr(e, "value", None) != getattr(nvml, "NVML_SUCCESS", 0):
                raise
            # pynvml raises "success" when the size query finds no sample
        return window.means(now_us, int(self.window_s * 1e6))

    @property
    def up(self) -> bool:
        return self._gpus.up

    def close(self) -> None:
        self._gpus.close()


class ProcessReader(Protocol):
    window_s: float

    def read(self, mps: bool = False) -> list[GpuProcess]: ...


class WatchedService(Protocol):
    """What the watchdog needs of the daemon (InstanceService has it)."""

    def holdings(self) -> tuple[list[Instance], list[Reservation]]: ...

    def policy(self) -> NodePolicy: ...

    def compute_metrics(self) -> dict[str, list[TenantMetrics]]: ...


class Mapper(Protocol):
    def identify(self, pids: Sequence[int], instances: Sequence[Instance]) -> dict[int, ProcessIdentity]: ...


Decide = Callable[
    [Sequence[Instance], Sequence[GpuProcess], Mapping[int, ProcessIdentity], Sequence[ComputeView], WatchSettings],
    list[Violation],
]
Kill = Callable[..., tuple[bool, str]]  # procmap.kill_process(identity, mapper, instances, allow=...)


@dataclass
class _Seen:
    first: float
    reported: float | None = None


class BypassWatchdog:
    """One round every `interval` seconds: read NVML, map the processes to
    instances, decide, then report (and kill) what goes around libcgpu.
    Does nothing while the node's mode does not isolate (labels can change
    the mode at run time)."""

    def __init__(
        self,
        service: WatchedService,
        events: BypassEvents,
        reader: ProcessReader,
        mapper: Mapper,
        settings: WatchSettings,
        action: BypassAction,
        interval: float,
        stats: RoundTimer | None = None,
        log: Any = None,
        decide: Decide | None = None,
        kill: Kill | None = None,
        repeat_s: float = REPEAT_S,
    ) -> None:
        self._service = service
        self._events = events
        self._reader = reader
        self._mapper = mapper
        self._settings = settings
        self._action = action
        self.interval = interval
        self._stats = stats
        self._log = log if log is not None else structlog.get_logger("cgpud.bypass")
        self._decide = decide if decide is not None else bypass_policy.decide
        self._kill: Kill = kill if kill is not None else procmap.kill_process
        self._repeat_s = repeat_s
        self._seen: dict[tuple[str, str, int], _Seen] = {}
        self._engine: dict[tuple[str, int], deque[tuple[float, float]]] = {}
        self.last_round_s = 0.0  # how long the last round took (seconds of wall time)

    def tick(self, now: float | None = None) -> list[BypassEvent]:
        """One round; the events it added (also in the BypassEvents ring)."""
        start = time.perf_counter()
        try:
            return self._round(time.time() if now is None else now)
        finally:
            self.last_round_s = time.perf_counter() - start

    def _round(self, now: float) -> list[BypassEvent]:
        policy = self._service.policy()
        if not isolates(policy.mode):
            self._seen.clear()
            self._engine.clear()
            return []
        processes = self._reader.read(mps=policy.mode is NodeMode.MPS)
        # Read after NVML: an instance is created before its processes start,
        # so every listed process's instance is in this snapshot.
        instances, _ = self._service.holdings()
        identities = self._mapper.identify(sorted({p.pid for p in processes}), instances) if processes else {}
        compute = self._compute_views(instances, policy, now)
        violations = self._decide(instances, processes, identities, compute, replace(self._settings, isolating=True))
        events: list[BypassEvent] = []
        ongoing = set()
        for v in violations:
            ongoing.add(v.key)
            seen = self._seen.setdefault(v.key, _Seen(first=now))
            event = self._act(v, seen, identities, instances, now)
            if event is not None:
                events.append(event)
                self._events.add(event)
                self._log_event(event)
        for key in set(self._seen) - ongoing:
            del self._seen[key]
        return events

    def _act(
        self,
        v: Violation,
        seen: _Seen,
        identities: Mapping[int, ProcessIdentity],
        instances: Sequence[Instance],
        now: float,
    ) -> BypassEvent | None:
        # Kill mode kills an instance's offenders every round they are there;
        # a process of no instance is only reported (it may be the node's own)
        # unless the node says its own are all on the allow list.
        if self._action is BypassAction.KILL and (v.instance_id or self._settings.kill_unknown):
            return self._kill_all(v, identities, instances, now)
        if seen.reported is not None and now - seen.reported < self._repeat_s:
            return None
        seen.reported = now
        return BypassEvent(now, v, EventAction.REPORTED)

    def _kill_all(
        self, v: Violation, identities: Mapping[int, ProcessIdentity], instances: Sequence[Instance], now: float
    ) -> BypassEvent:
        """The event's detail says what happened to each pid (the
        violation's own detail says what was wrong)."""
        killed: list[int] = []
        outcomes: list[str] = []
        failed = False
        for pid in v.pids:
            identity = identities.get(pid)
            if identity is None:
                ok, detail = False, f"pid {pid} not killed: not identified"
            else:
                try:
                    ok, detail = self._kill(
                        identity, self._mapper, instances, allow=self._settings.allow, unknown=not v.instance_id
                    )
                except (CgpuError, OSError) as e:
                    ok, detail = False, f"pid {pid} not killed: {e}"
            if ok:
                killed.append(pid)
            failed |= not ok
            outcomes.append(detail)
        action = EventAction.KILL_FAILED if failed else EventAction.KILLED
        return BypassEvent(now, v, action, killed=tuple(killed), detail="; ".join(outcomes))

    def _compute_views(self, instances: Sequence[Instance], policy: NodePolicy, now: float) -> list[ComputeView]:
        """Each instance's share of each GPU it holds, and what the
        scheduler charged it on average over the compute window."""
        engine = self._engine_means(now) if limits_compute(policy.mode) else {}
        views = []
        for inst in instances:
            for g in inst.grants:
                caps = (
                    limits_compute(policy.mode)
                    and g.core_percent > 0
                    and policy.policy_for(g.gpu_index) in CAPPING_POLICIES
                )
                views.append(
                    ComputeView(inst.id, g.gpu_index, g.core_percent, caps, engine.get((inst.id, g.gpu_index)))
                )
        return views

    def _engine_means(self, now: float) -> dict[tuple[str, int], float]:
        window = self._reader.window_s
        current = self._service.compute_metrics()
        for iid, per_gpu in current.items():
            for m in per_gpu:
                if m.window_ns:
                    self._engine.setdefault((iid, m.gpu), deque()).append((now, m.achieved_percent))
        out = {}
        for key, samples in list(self._engine.items()):
            while samples and samples[0][0] <= now - window:
                samples.popleft()
            if not samples or key[0] not in current:
                del self._engine[key]
                continue
            out[key] = sum(p for _, p in samples) / len(samples)
        return out

    def _log_event(self, e: BypassEvent) -> None:
        v = e.violation
        fields: dict[str, Any] = dict(
            kind=v.kind.value,
            instance=v.instance_id,
            gpu=v.gpu_index,
            pids=list(v.pids),
            used=v.used_bytes,
            limit=v.limit_bytes,
            action=e.action.value,
        )
        if v.kind is ViolationKind.COMPUTE_OVER_SHARE:
            fields.update(measured_percent=round(v.measured_percent, 1), allowed_percent=round(v.allowed_percent, 1))
        if e.killed:
            fields["killed"] = list(e.killed)
        fields["detail"] = v.detail
        if e.detail:
            fields["outcome"] = e.detail
        self._log.warning("bypass", **fields)

    def watching(self) -> tuple[bool, str]:
        """Whether rounds look at the GPUs now, and why not (for people)."""
        mode = self._service.policy().mode
        if not isolates(mode):
            return False, f"mode {mode.value} does not isolate"
        if not getattr(self._reader, "up", True):
            return False, "NVML does not start"
        return True, ""

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            try:
                if self._stats is not None:
                    self._stats.timed("bypass", self.tick)
                else:
                    self.tick()
            except Exception as e:  # any error: the watchdog keeps watching; the next round may succeed
                self._log.error("bypass round failed", error=f"{type(e).__name__}: {e}")

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(stop,), name="cgpud-bypass", daemon=True)
        thread.start()
        return thread
