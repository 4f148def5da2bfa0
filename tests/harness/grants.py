"""An instance region seen from cgpud's scheduler, for tests that play the
scheduler's part: gate words, grants files, and a live view of grants and
usage that opens and closes gates as cgpud's engine does."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import struct
from pathlib import Path
from typing import Any

from cgpud._region import ffi, lib

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
        self._files = [open(directory / name, "r+b") for name in ("grants", "usage")]
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


def closed(seq: int) -> int:
    return seq * GATE_SEQ_STEP


def opened(seq: int) -> int:
    return seq * GATE_SEQ_STEP | GATE_OPEN


def is_gated(region: Path) -> bool:
    """Whether cgpud wrote the region's grants file gated (compute-controlled)."""
    grants = ffi.from_buffer("struct cgpu_grants *", bytearray((region / "grants").read_bytes()))
    return not grants.device[0].gate & lib.CGPU_GATE_UNGATED
