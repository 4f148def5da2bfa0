"""Sizes of GPU memory as people write and read them. One parser for every
entry point, so a bare number means one thing everywhere: GiB, as in ACK's
`aliyun.com/gpu-mem`."""

from __future__ import annotations

import re
from fractions import Fraction

from cgpud.errors import UsageError

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40
# Stored in SQLite INTEGER columns and in the region's 64-bit fields.
MAX_BYTES = (1 << 63) - 1

_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)?$", re.IGNORECASE)
_UNITS = {"b": 1, "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB}
_HINT = "a bare number is GiB as in aliyun.com/gpu-mem (4); else add B, KiB, MiB, GiB or TiB (512MiB, 1.5GiB)"


def parse_memory(text: str) -> int:
    """A GPU memory size in bytes. A bare number is GiB, as in ACK's
    `aliyun.com/gpu-mem`; otherwise a number with B, KiB, MiB, GiB or TiB
    ("512MiB", "1.5GiB", "1073741824B")."""
    m = _MEMORY.match(text.strip())
    if not m:
        raise UsageError(f"bad memory size {text!r}: {_HINT}")
    unit = (m.group(2) or "gib").lower()
    if unit == "b" and "." in m.group(1):
        raise UsageError(f"bad memory size {text!r}: bytes come whole; {_HINT}")
    # Fraction, not float: "1.5GiB" is exact and large byte counts keep
    # every digit. A size that is not whole bytes ("1.1GiB") is rounded
    # down, so a limit is never more than what was asked.
    value = int(Fraction(m.group(1)) * _UNITS[unit])
    if value > MAX_BYTES:
        raise UsageError(f"bad memory size {text!r}: it is larger than any GPU; {_HINT}")
    return value


def format_memory(size: int) -> str:
    """Bytes as a person reads them: "4 GiB" when whole, else MiB with up to
    two decimals ("1536 MiB", "0.5 MiB"); sizes too small for that in bytes."""
    if size % GIB == 0:
        return f"{size // GIB} GiB"
    mib = f"{size / MIB:.2f}".rstrip("0").rstrip(".")
    if mib in ("0", "-0"):
        return f"{size} bytes"
    return f"{mib} MiB"
