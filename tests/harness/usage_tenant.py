"""A tenant's side of an instance's usage file, for tests: what a process
under libcgpu.so does to it (claim a ledger, charge it) and what a test
reads back (the device counters, the live ledgers). cgpud only creates,
repairs and reaps the file (cgpud/node/region.py).

Claims and charges run libcgpu.so's own C steps (csrc/region/region.c,
reached through cgpud._region). Counters are read as cffi fields: plain
aligned loads, whole on the hosts the tests run on; tests read them once the
tenants said where they are, so the pipe orders them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cgpud._region import lib
from cgpud.node.region import MAX_DEVICES, MAX_PROCS, RegionError, UsageRegion

_U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class Ledger:
    """One live process's share of the instance's usage."""

    index: int
    pid: int  # as the process sees itself (its own pid namespace)
    used: tuple[int, ...]  # bytes per device slot, MAX_DEVICES entries


def _check_range(what: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise RegionError(f"{what} is {value}; it must be between {low} and {high}")


class TenantUsage(UsageRegion):
    """The usage file mapped as a tenant maps it, plus cgpud's reap.

    Each claimed ledger holds its lock on its own open file description:
    OFD locks never conflict within one description, so sharing the
    region's descriptor would let a second claim take over (and zero) the
    first ledger, and let reap() reap the ledgers this object holds."""

    def __init__(self, directory: Path) -> None:
        self._claims: dict[int, int] = {}  # ledger index -> fd holding its lock
        super().__init__(directory)

    def device_used(self, index: int) -> int:
        """Bytes all processes of the instance hold on device slot `index`."""
        _check_range("device index", index, 0, MAX_DEVICES - 1)
        return int(self._mapped().device[index].used)

    def ledgers(self) -> list[Ledger]:
        """The live ledgers, including those of processes that died and were
        not reaped yet. Each is read field by field, not as one snapshot."""
        u = self._mapped()
        return [
            Ledger(i, int(p.pid), tuple(p.used))
            for i in range(MAX_PROCS)
            if (p := u.proc[i]).state == lib.CGPU_LEDGER_LIVE
        ]

    def claim(self, pid: int) -> int:
        """Claims a ledger for `pid`, held until close(); returns its index."""
        u = self._mapped()
        _check_range("pid", pid, 1, 2**31 - 1)
        with self._lock:
            # A new open file description of the mapped inode itself:
            # reopening by name could reach a file replaced since.
            fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR | os.O_CLOEXEC)
            index = lib.cgpu_ledger_claim(u, fd, pid)
            if index < 0:
                os.close(fd)
                raise RegionError(f"{self.path}: all {MAX_PROCS} process ledgers are in use")
            self._claims[index] = fd
            return int(index)

    def charge(self, ledger: int, device: int, limit: int, nbytes: int) -> bool:
        """Reserves `nbytes` on `device` within `limit` for a ledger this
        object claimed, as libcgpu.so does for an allocation; False if it
        would exceed the limit (nothing is charged then)."""
        u = self._mapped()
        if ledger not in self._claims:
            raise RegionError(f"{self.path}: ledger {ledger} was not claimed through this region")
        _check_range("device index", device, 0, MAX_DEVICES - 1)
        _check_range("limit", limit, 0, _U64_MAX)
        _check_range("charge", nbytes, 0, _U64_MAX)
        return bool(lib.cgpu_ledger_charge(u, ledger, device, limit, nbytes))

    def reserve_unrecorded(self, device: int, limit: int, nbytes: int) -> bool:
        """The device half of a charge alone: what a process killed between
        reserving on the device and recording in its ledger leaves behind."""
        _check_range("device index", device, 0, MAX_DEVICES - 1)
        _check_range("limit", limit, 0, _U64_MAX)
        _check_range("charge", nbytes, 0, _U64_MAX)
        return bool(lib.cgpu_usage_reserve(self._mapped(), device, limit, nbytes))

    def close(self) -> None:
        """Drops this object's ledger locks too: its claimed ledgers become
        reapable, as when a process exits."""
        for fd in getattr(self, "_claims", {}).values():
            os.close(fd)
        self._claims = {}
        super().close()
