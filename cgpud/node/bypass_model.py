"""The bypass watchdog's vocabulary: what NVML says runs on a GPU, whose it
is, what counts as going around libcgpu, and what was done about it.

Plain frozen data shared by the pure decision (bypass_policy.py), the
/proc side (procmap.py), the loop (watchdog.py) and the surfaces (API,
cgpuctl, metrics). The event ring is the one mutable piece; it is owned by
the daemon and passed around, never global."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class BypassAction(str, Enum):
    """What cgpud does about a violation (setting bypass_action)."""

    REPORT = "report"  # a structured event, a metric, a line in cgpuctl
    KILL = "kill"  # the same, and SIGKILL to the instance's offending processes


class ViolationKind(str, Enum):
    # An instance's processes hold more device memory on a GPU than its limit
    # there (0 on a GPU it has no grant on) plus the per-process slack.
    MEMORY_OVER_LIMIT = "memory_over_limit"
    # A process on a GPU that belongs to no instance, on a node whose mode
    # isolates, and not on the allow list.
    UNKNOWN_PROCESS = "unknown_process"
    # An instance's measured compute over the window is well above what its
    # capping policy (fixed, soft) let it have.
    COMPUTE_OVER_SHARE = "compute_over_share"


@dataclass(frozen=True)
class GpuProcess:
    """One process NVML lists on one GPU (host PID, as the driver gives a
    caller in the host PID namespace)."""

    gpu_index: int
    pid: int
    used_bytes: int | None  # None: NVML_VALUE_NOT_AVAILABLE
    sm_percent: float | None = None  # mean smUtil over the compute window; None: no samples


@dataclass(frozen=True)
class ProcessIdentity:
    """What cgpud read about a process from /proc, and the instance it maps
    to. `starttime` pins the process against PID reuse."""

    pid: int
    starttime: int  # /proc/<pid>/stat field 22 (clock ticks after boot)
    exe: str  # readlink of /proc/<pid>/exe as cgpud reads it; "" when unreadable
    cgroup: str  # the cgroup path the mapping compared; "" when unknown
    instance_id: str | None  # None: it belongs to no active instance
    # It runs in cgpud's root filesystem. A container's /proc/<pid>/exe names
    # a path in the container's own root, which its image chooses: exe
    # allow rules hold only for host processes.
    host_root: bool = True


@dataclass(frozen=True)
class AllowRule:
    """Processes that may use a GPU without an instance (nvidia-persistenced,
    the MPS server, DCGM...): an fnmatch pattern on the cgroup path or on
    the executable's path."""

    kind: str  # "cgroup" | "exe"
    pattern: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.pattern}"


@dataclass(frozen=True)
class WatchSettings:
    memory_slack_bytes: int  # per process of the instance on the GPU (driver context memory)
    compute_excess_percent: float  # points above the allowed share before it counts
    allow: tuple[AllowRule, ...]
    isolating: bool  # the node's mode isolates (cgpu, core_mem, mps): unknown processes count
    # The slack is given for at most this many of an instance's processes on
    # a GPU: a tenant that forks more gains nothing from it.
    memory_slack_processes: int = 4
    # Kill mode also kills processes of no instance (not allow-listed): a
    # container that got a GPU around cgpu (NVIDIA_VISIBLE_DEVICES=all through
    # the NVIDIA toolkit). Off by default: a node's own GPU users must all be
    # on the allow list first.
    kill_unknown: bool = False


@dataclass(frozen=True)
class ComputeView:
    """What an instance may use of one GPU's compute, for the compute rule."""

    instance_id: str
    gpu_index: int
    share_percent: int  # its core_percent there
    caps: bool  # the GPU's policy caps it (fixed, soft)
    engine_percent: float | None  # what the scheduler itself charged it over the window; None: unknown


@dataclass(frozen=True)
class Violation:
    kind: ViolationKind
    gpu_index: int
    instance_id: str  # "" for UNKNOWN_PROCESS
    pids: tuple[int, ...]  # the offending processes on that GPU, sorted
    used_bytes: int = 0  # memory: what they hold together; unknown process: what it holds
    limit_bytes: int = 0  # memory: the instance's limit on that GPU (slack not included)
    measured_percent: float = 0.0  # compute
    allowed_percent: float = 0.0  # compute: the share (or the engine's charge, if higher), slack not included
    detail: str = ""  # one line for people

    @property
    def key(self) -> tuple[str, str, int]:
        """Identifies one ongoing violation across ticks."""
        who = self.instance_id or ",".join(map(str, self.pids))
        return (self.kind.value, who, self.gpu_index)


class EventAction(str, Enum):
    REPORTED = "reported"
    KILLED = "killed"  # every pid in `killed` got SIGKILL
    KILL_FAILED = "kill_failed"  # some pid could not be killed safely (gone, remapped, refused): see detail


@dataclass(frozen=True)
class BypassEvent:
    time: float  # Unix seconds
    violation: Violation
    action: EventAction
    killed: tuple[int, ...] = ()
    detail: str = ""


class BypassEvents:
    """The most recent events (bounded) and counts per instance and kind
    since cgpud started. Thread-safe: the watchdog adds, the API and the
    metrics read."""

    def __init__(self, capacity: int = 1000, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._recent: deque[BypassEvent] = deque(maxlen=capacity)
        self._per_instance: Counter[str] = Counter()
        self._per_kind: Counter[tuple[str, str]] = Counter()  # (kind, action)
        self._kills = 0
        self.clock = clock

    def add(self, event: BypassEvent) -> None:
        with self._lock:
            self._recent.append(event)
            if event.violation.instance_id:
                self._per_instance[event.violation.instance_id] += 1
            self._per_kind[(event.violation.kind.value, event.action.value)] += 1
            self._kills += len(event.killed)

    def recent(self, instance_id: str | None = None, limit: int = 100) -> list[BypassEvent]:
        """Newest last; only that instance's when given."""
        with self._lock:
            events = [e for e in self._recent if instance_id is None or e.violation.instance_id == instance_id]
        return events[-limit:] if limit > 0 else events

    def count(self, instance_id: str) -> int:
        with self._lock:
            return self._per_instance[instance_id]

    def totals(self) -> tuple[dict[tuple[str, str], int], int]:
        """Events by (kind, action), and processes killed, since start."""
        with self._lock:
            return dict(self._per_kind), self._kills
