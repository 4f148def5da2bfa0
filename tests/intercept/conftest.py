"""Fixtures for libcgpu.so tests: instance regions written by the daemon's
own writer, and environments that preload the library on the simulated GPUs.
No compute scheduler runs in these tests: a test that gates launches plays
its part on the grants file (GrantsView)."""
from __future__ import annotations

import ctypes
import fcntl
import itertools
import mmap
import os
import platform
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cgpud._region import ffi, lib
from cgpud.node.region import DeviceLimit, InstanceLimits, write_region

GIB = 1 << 30

GATE_OPEN = int(lib.CGPU_GATE_OPEN)
GATE_UNGATED = int(lib.CGPU_GATE_UNGATED)
GATE_SEQ_STEP = int(lib.CGPU_GATE_SEQ_STEP)

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}[platform.machine()]
_FUTEX_WAKE = 1
_libc = ctypes.CDLL(None, use_errno=True)


def lock_grants(fd: int, lock: bool) -> None:
    """Takes (or drops) the OFD locks cgpud's engine holds on a grants file
    for every device it drives (CGPU_GRANTS_LOCK_OFFSET): without them a
    process waiting at a closed gate concludes that cgpud is gone."""
    base = ffi.sizeof("struct cgpu_grants")
    kind = fcntl.F_WRLCK if lock else fcntl.F_UNLCK
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (x86_64 and aarch64 alike).
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", kind, os.SEEK_SET, base, lib.CGPU_MAX_DEVICES, 0))


def grants_bytes(gates: list[int]) -> bytes:
    """A grants file with these gate words for slots 0, 1, ... (closed past them)."""
    raw = ffi.new("struct cgpu_grants *")
    raw.magic = lib.CGPU_GRANTS_MAGIC
    raw.version = lib.CGPU_REGION_VERSION
    raw.size = ffi.sizeof("struct cgpu_grants")
    for slot, word in enumerate(gates):
        raw.device[slot].gate = word
    return bytes(ffi.buffer(raw))


def write_grants(region: Path, content: bytes | None) -> None:
    """Replaces the grants file cgpud wrote (None: no grants file at all)."""
    grants = region / "grants"
    grants.unlink(missing_ok=True)
    if content is not None:
        grants.write_bytes(content)


class GrantsView:
    """An instance region seen from cgpud's scheduler: the test opens and
    closes gates in `grants` and reads the processes' answers in `usage`."""

    def __init__(self, directory: Path) -> None:
        self._files = [open(directory / name, "r+b") for name in ("grants", "usage")]  # noqa: SIM115 (closed in close())
        self._maps = [mmap.mmap(f.fileno(), 0) for f in self._files]
        self.grants = ffi.from_buffer("struct cgpu_grants *", self._maps[0], require_writable=True)
        self.usage = ffi.from_buffer("struct cgpu_usage *", self._maps[1])
        self.drive(True)

    def drive(self, alive: bool) -> None:
        """Holds cgpud's locks on the grants file, or lets go of them as a
        cgpud that died would."""
        lock_grants(self._files[0].fileno(), alive)

    def close(self) -> None:
        for view in (self.grants, self.usage):
            ffi.release(view)
        for m in self._maps:
            m.close()
        for f in self._files:
            f.close()

    def set_gate(self, slot: int, word: int) -> None:
        """As the scheduler does: store the word, then wake every waiter."""
        self.grants.device[slot].gate = word  # one aligned 32-bit store
        address = int(ffi.cast("uintptr_t", ffi.addressof(self.grants.device[slot], "gate")))
        if _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0) < 0:
            raise OSError(ctypes.get_errno(), "FUTEX_WAKE")

    def waiting(self, slot: int = 0) -> int:
        return int(self.usage.device[slot].waiting)

    def bell(self, slot: int = 0) -> int:
        return int(self.usage.device[slot].bell)

    def ledger(self, pid: int) -> Any:
        """The live ledger of `pid` (a cffi view), or None."""
        for i in range(self.usage.ledgers_used):
            p = self.usage.proc[i]
            if p.state == lib.CGPU_LEDGER_LIVE and p.pid == pid:
                return p
        return None

    def watching(self, pid: int) -> int:
        p = self.ledger(pid)
        return int(p.watching) if p is not None else -1

    def fence_ack(self, pid: int, slot: int = 0) -> int | None:
        p = self.ledger(pid)
        return int(p.fence_ack[slot]) if p is not None else None


def sim_uuid(index: int) -> str:
    """UUID of simulated GPU `index` under the default config lines."""
    return f"GPU-5c1a0000-0000-4000-8000-{0xC90000 + index:012x}"


Instance = Callable[..., dict[str, str]]


@pytest.fixture
def libcgpu(native: Path) -> Path:
    return native / "lib" / "libcgpu.so"


@pytest.fixture
def instance(tmp_path: Path, sim_env: dict[str, str], libcgpu: Path) -> Instance:
    """instance({0: 4 * GIB}) -> environment of a process in an instance
    holding 4 GiB of simulated GPU 0, with no compute control (ungated)."""
    made = 0

    def make(limits: dict[int, int], log_level: int = 0) -> dict[str, str]:
        nonlocal made
        made += 1
        region = tmp_path / f"region{made}"
        devices = tuple(DeviceLimit(sim_uuid(g), mem, g) for g, mem in limits.items())
        write_region(region, InstanceLimits(f"test-{made}", devices, log_level=log_level))
        env = dict(sim_env, LD_PRELOAD=str(libcgpu), CGPU_REGION_DIR=str(region))
        env.pop("CGPU_LOG_LEVEL", None)
        return env

    return make


def build_c(tmp_path: Path, source: str, name: str, *flags: str) -> Path:
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / name
    subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-o", str(out), str(src), *flags], check=True)
    return out


def closed(seq: int) -> int:
    return seq * GATE_SEQ_STEP


def opened(seq: int) -> int:
    return seq * GATE_SEQ_STEP | GATE_OPEN


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def gated(tmp_path: Path, sim_env: dict[str, str], libcgpu: Path) -> Iterator[Callable[..., tuple[dict, GrantsView]]]:
    """gated([word, ...], gpus=[g, ...]) -> (environment, GrantsView) of an
    instance holding 4 GiB of each simulated GPU g (slot i for gpus[i]),
    with the given gate words; None for no grants file, bytes for a
    damaged one."""
    made: list[GrantsView] = []
    count = itertools.count()

    def make(gates: list[int] | bytes | None, gpus: tuple[int, ...] = (0,),
             env: dict[str, str] | None = None) -> tuple[dict[str, str], GrantsView | None]:
        region = tmp_path / f"gated{next(count)}"
        devices = tuple(DeviceLimit(sim_uuid(g), 4 * GIB, g) for g in gpus)
        write_region(region, InstanceLimits(region.name, devices))
        write_grants(region, grants_bytes(gates) if isinstance(gates, list) else gates)
        env = dict(env or sim_env, LD_PRELOAD=str(libcgpu), CGPU_REGION_DIR=str(region))
        env.pop("CGPU_LOG_LEVEL", None)
        view = GrantsView(region) if isinstance(gates, list) else None
        if view:
            made.append(view)
        return env, view

    yield make
    for view in made:
        view.close()
