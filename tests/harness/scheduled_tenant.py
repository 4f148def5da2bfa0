"""An instance's region seen as its processes see it, for tests that play
the tenant's side of the compute protocol (cgpu/region.h) against cgpud's
scheduler engine: demand, fence acknowledgements, gates read back."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cgpud._region import ffi as rffi
from cgpud._region import lib as rlib
from cgpud.node.model import ComputeTiming, Grant, Instance, InstanceState, Owner, OwnerKind
from cgpud.node.region import GRANTS_FILE, DeviceLimit, InstanceLimits, write_region
from tests.harness.usage_tenant import TenantUsage

OPEN, UNGATED, SEQ, SEQ_STEP = (
    rlib.CGPU_GATE_OPEN,
    rlib.CGPU_GATE_UNGATED,
    rlib.CGPU_GATE_SEQ_MASK,
    rlib.CGPU_GATE_SEQ_STEP,
)


@contextmanager
def promptly() -> Iterator[None]:
    """Runs the calling thread at a real-time priority while the tenant it
    plays must act within the engine's idle grace (100 us): a C program takes
    nanoseconds between an idle report and its withdrawal, this Python thread
    microseconds, and on a loaded machine a preemption in between is taken
    for idleness. Other threads and the engine's keep their priority. Where
    that priority is refused (not root), the thread runs as it is."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


FAST = ComputeTiming(period_ns=20_000_000, max_slice_ns=2_000_000, high_priority_percent=80)


class Tenant:
    """One instance's region, seen as its processes see it."""

    def __init__(self, root: Path, name: str, core: int) -> None:
        self.dir = root / name
        write_region(self.dir, InstanceLimits(name, (DeviceLimit("GPU-x", 1 << 30, 0, core),)), gated=True)
        self.instance = Instance(
            name, Owner(OwnerKind.PROCESS, name), (Grant(0, "GPU-x", 1 << 30, core),), InstanceState.RESERVED, True
        )
        fd = os.open(self.dir / GRANTS_FILE, os.O_RDONLY)
        self._gmap = mmap.mmap(fd, rffi.sizeof("struct cgpu_grants"), mmap.MAP_SHARED, mmap.PROT_READ)
        os.close(fd)
        self.grants = rffi.from_buffer("struct cgpu_grants *", self._gmap)
        self.usage = TenantUsage(self.dir)
        self.u = self.usage._mapped()

    @property
    def gate(self) -> int:
        return int(self.grants.device[0].gate)

    def want(self, waiting: int) -> None:
        self.u.device[0].waiting = waiting

    def watch(self) -> int:
        ledger = self.usage.claim(os.getpid())
        self.u.proc[ledger].watching = 1
        return ledger

    def ack(self, ledger: int, launched: bool = True) -> None:
        self.u.proc[ledger].fence_ack[0] = (self.gate & SEQ) | (rlib.CGPU_ACK_LAUNCHED if launched else 0)
        self.u.device[0].bell += 1

    def close(self) -> None:
        self.usage.close()
        del self.grants
        self._gmap.close()
