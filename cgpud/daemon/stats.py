"""What cgpud's parts report as they work: requests by kind and outcome,
and how long upkeep takes. Kept apart from the Prometheus endpoint
(metrics.py), which reads them at scrape time and is imported only when
metrics_listen is set.

Thread-safety: DaemonStats is called from every API thread (its own lock)."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from cgpud.kube.model import Allocator, ContainerAllocation, Resource

_T = TypeVar("_T")

# Seconds; sweeps of a few instances take milliseconds, a slow disk seconds.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
OK = "OK"


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*(f"{b:g}" for b in DURATION_BUCKETS), "+Inf"), self.counts):
            running += n
            out.append((bound, running))
        return out


class DaemonStats:
    """Requests by kind and outcome, and how long upkeep takes: what the
    daemon's parts report as they work."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}
        self._errors: dict[tuple[str, str, str], int] = {}
        self._durations: dict[str, _Histogram] = {}
        self._clock = clock
        self.started = time.time()

    def request(self, kind: str, method: str, code: str = OK) -> None:
        """One request of `kind` (admin, relay, device_plugin) answered with
        `code` (OK, or the error's name: a gRPC status, "error")."""
        with self._lock:
            self._requests[(kind, method)] = self._requests.get((kind, method), 0) + 1
            if code != OK:
                self._errors[(kind, method, code)] = self._errors.get((kind, method, code), 0) + 1

    def timed(self, what: str, fn: Callable[[], _T]) -> _T:
        """Runs fn and records its duration under `what` (reconcile, sweep),
        failed runs included."""
        start = self._clock()
        try:
            return fn()
        finally:
            elapsed = self._clock() - start
            with self._lock:
                self._durations.setdefault(what, _Histogram()).observe(elapsed)

    def snapshot(
        self,
    ) -> tuple[
        dict[tuple[str, str], int], dict[tuple[str, str, str], int], dict[str, tuple[list[tuple[str, int]], float]]
    ]:
        with self._lock:
            return (
                dict(self._requests),
                dict(self._errors),
                {k: (h.buckets(), h.total) for k, h in self._durations.items()},
            )


class CountedAllocator:
    """The device plugin's allocator with each container's Allocate counted
    (kind device_plugin; the error's class name as its code)."""

    def __init__(self, allocator: Allocator, stats: DaemonStats) -> None:
        self._allocator = allocator
        self._stats = stats

    def allocate(self, resource: Resource | str, device_ids: Sequence[str]) -> ContainerAllocation:
        try:
            allocation = self._allocator.allocate(resource, device_ids)
        except Exception as e:
            self._stats.request("device_plugin", "Allocate", type(e).__name__)
            raise
        self._stats.request("device_plugin", "Allocate")
        return allocation
