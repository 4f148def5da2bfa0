"""cgpud's compute scheduler: one C loop per GPU (csrc/scheduler/engine.c)
that opens and closes the instances' gates, run in threads that hold no GIL.

The policy decisions are pure functions in compute_policy.py; this module is
wiring between instances and the engine.

Ownership: ComputeScheduler owns the engine and its threads from start() to
stop(). Thread-safety: every method may be called from any thread; the
engine serialises them."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from cgpud._scheduler import ffi, lib
from cgpud.node.model import ComputePolicy, ComputeTiming, Instance, NodePolicy
from cgpud.errors import CgpuError

MAX_GPUS: int = lib.CGPU_SCHED_MAX_GPUS
MAX_TENANTS: int = lib.CGPU_SCHED_MAX_TENANTS
_ERRLEN = 512
_STATUS = {
    lib.CGPU_SCHED_ENOENT: "no such tenant",
    lib.CGPU_SCHED_ENODEV: "no such GPU",
    lib.CGPU_SCHED_EINVAL: "invalid argument",
    lib.CGPU_SCHED_ENOSPC: f"the GPU already schedules {MAX_TENANTS} instances",
    lib.CGPU_SCHED_EDQUOT: "the compute shares on the GPU would add up to more than 100 %",
}


class ComputeError(CgpuError):
    """The compute scheduler refused a change."""


@dataclass(frozen=True)
class GpuSchedule:
    """What one GPU's loop is doing, for `cgpuctl` and tests."""

    gpu: int
    policy: ComputePolicy
    tenants: int
    holder: int
    decisions: int
    grants: int
    fences: int
    fence_timeouts: int
    fence_wait_ns: int
    fences_late: int = 0
    idle_handovers: int = 0  # grants ended early: the holder was idle and another instance waited
    paced: bool = False  # every instance keeps to its window by itself (ComputeTiming.fixed_windows, busy_windows)
    pace_refused: bool = False  # threads waited at a paced gate (an older libcgpu): slices until a change
    busy_ended: int = 0  # busy windows ended because an instance left its window idle


@dataclass(frozen=True)
class TenantMetrics:
    """One instance's accounting on one GPU, as the engine counted it."""

    gpu: int
    charged_ns: int  # device time charged since it was scheduled
    throttled_ns: int  # time its threads waited at its closed gate
    grants: int  # gate openings
    window_ns: int  # the last completed share window (0: none yet)
    window_charged_ns: int  # device time charged in it
    idle_grace_ns: int  # how long it may hold the GPU idle while another waits (learned per tenant)

    @property
    def achieved_percent(self) -> float:
        return 100.0 * self.window_charged_ns / self.window_ns if self.window_ns else 0.0


def _check(rc: int, what: str, err: Any = None) -> None:
    if rc == 0:
        return
    detail = ffi.string(err).decode(errors="replace") if err is not None and err[0] != b"\0" else ""
    raise ComputeError(f"{what}: {detail or _STATUS.get(rc, f'status {rc}')}")


class ComputeScheduler:
    def __init__(self, gpu_count: int, timing: ComputeTiming = ComputeTiming()) -> None:
        if not 1 <= gpu_count <= MAX_GPUS:
            raise ComputeError(f"the compute scheduler handles 1 to {MAX_GPUS} GPUs, not {gpu_count}")
        self._engine = ffi.gc(lib.cgpu_engine_create(gpu_count), lib.cgpu_engine_destroy)
        if self._engine == ffi.NULL:
            raise ComputeError("cannot create the compute scheduler (out of memory)")
        self._gpu_count = gpu_count
        self._timing = timing
        self._keys: dict[str, list[tuple[int, int]]] = {}  # instance id -> [(gpu, key)]
        self._next_key = 1
        self._applied: dict[int, ComputePolicy] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._log = structlog.get_logger("cgpud.compute")
        windows = (lib.CGPU_ENGINE_WINDOWS_FIXED if timing.fixed_windows else 0) | (
            lib.CGPU_ENGINE_WINDOWS_BUSY if timing.busy_windows else 0
        )
        for gpu in range(gpu_count):
            _check(lib.cgpu_engine_set_windows(self._engine, gpu, windows), "cannot set windows")

    def start(self) -> ComputeScheduler:
        for gpu in range(self._gpu_count):
            t = threading.Thread(target=self._run, args=(gpu,), name=f"compute-gpu{gpu}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _run(self, gpu: int) -> None:
        rc = lib.cgpu_engine_run(self._engine, gpu)  # cffi releases the GIL for the call
        if rc != 0:
            self._log.error("scheduler loop refused to run", gpu=gpu, status=rc)

    def stop(self) -> None:
        """Ends every loop; the gates are left open so no process waits for
        a grant nobody will give."""
        lib.cgpu_engine_stop(self._engine)
        for t in self._threads:
            t.join()
        self._threads.clear()

    def configure(self, node: NodePolicy) -> None:
        """Applies the node's policies to every GPU; a GPU whose policy did
        not change keeps its accounting."""
        t = self._timing
        for gpu in range(self._gpu_count):
            policy = node.policy_for(gpu)
            if self._applied.get(gpu) is policy:
                continue
            _check(
                lib.cgpu_engine_configure(
                    self._engine, gpu, int(policy), t.period_ns, t.max_slice_ns, t.high_priority_percent
                ),
                f"cannot set policy {policy.name} on GPU {gpu}",
            )
            self._applied[gpu] = policy

    def attach(self, instance: Instance, region: Path) -> None:
        """Schedules every GPU of the instance; all or nothing."""
        err = ffi.new("char[]", _ERRLEN)
        with self._lock:
            if instance.id in self._keys:
                return
            done: list[tuple[int, int]] = []
            try:
                for slot, grant in enumerate(instance.grants):
                    key = self._next_key
                    self._next_key += 1
                    self._engine_attach(instance, slot, key, str(region).encode(), err)
                    done.append((grant.gpu_index, key))
            except ComputeError:
                for gpu, key in done:
                    lib.cgpu_engine_detach(self._engine, gpu, key)
                raise
            self._keys[instance.id] = done

    def reshare(self, instance: Instance) -> None:
        """A resized instance's compute share, weight and priority, on the GPUs
        it is scheduled on; its accounting goes on."""
        err = ffi.new("char[]", _ERRLEN)
        with self._lock:
            keys = self._keys.get(instance.id)
            if keys is None:
                raise ComputeError(f"instance {instance.id} is not scheduled")
            for slot, (_, key) in enumerate(keys):
                self._engine_attach(instance, slot, key, b"", err)  # a known key: its share only

    def _engine_attach(self, instance: Instance, slot: int, key: int, region: bytes, err: Any) -> None:
        grant = instance.grants[slot]
        _check(
            lib.cgpu_engine_attach(
                self._engine,
                grant.gpu_index,
                key,
                region,
                slot,
                grant.core_percent,
                instance.weight,
                int(instance.priority > 0),
                err,
                _ERRLEN,
            ),
            f"cannot give instance {instance.id} {grant.core_percent}% of GPU {grant.gpu_index}",
            err,
        )

    def detach(self, instance_id: str) -> None:
        with self._lock:
            for gpu, key in self._keys.pop(instance_id, []):
                lib.cgpu_engine_detach(self._engine, gpu, key)

    def damaged(self, instance_id: str) -> bool:
        """Whether the instance's usage file was truncated under the
        engine's mapping: the engine then sees no demand and no process of
        it until it is re-attached."""
        with self._lock:
            return any(
                lib.cgpu_engine_tenant_damaged(self._engine, gpu, key) == 1
                for gpu, key in self._keys.get(instance_id, [])
            )

    def reattach(self, instance: Instance, region: Path) -> None:
        """Maps the instance's files afresh once cgpud repaired them; its
        scheduling history starts over."""
        self.detach(instance.id)
        self.attach(instance, region)

    def schedule(self, gpu: int) -> GpuSchedule:
        s = ffi.new("struct cgpu_engine_stats *")
        _check(lib.cgpu_engine_stats_get(self._engine, gpu, s), f"no schedule for GPU {gpu}")
        return GpuSchedule(
            gpu,
            ComputePolicy(s.policy),
            s.tenants,
            s.holder,
            s.decisions,
            s.grants,
            s.fences,
            s.fence_timeouts,
            s.fence_wait_ns,
            s.fences_late,
            s.idle_handovers,
            bool(s.paced),
            bool(s.pace_refused),
            s.busy_ended,
        )

    def schedules(self) -> dict[int, GpuSchedule]:
        """Every GPU's schedule, by index."""
        return {gpu: self.schedule(gpu) for gpu in range(self._gpu_count)}

    def tenant_metrics(self) -> dict[str, list[TenantMetrics]]:
        """Every scheduled instance's accounting, by instance id."""
        m = ffi.new("struct cgpu_engine_tenant_metrics *")
        out: dict[str, list[TenantMetrics]] = {}
        with self._lock:
            for instance_id, keys in self._keys.items():
                for gpu, key in keys:
                    if lib.cgpu_engine_tenant_metrics_get(self._engine, gpu, key, m) == 0:
                        out.setdefault(instance_id, []).append(
                            TenantMetrics(
                                gpu,
                                m.charged_ns,
                                m.throttled_ns,
                                m.grants,
                                m.window_ns,
                                m.window_charged_ns,
                                m.idle_grace_ns,
                            )
                        )
        return out
