"""Reading a file of unknown length up to a limit, a piece at a time.

A single read asked for `limit` bytes makes Python allocate them first (an
8 MiB spec, a 16 MiB mount table): a fresh mapping, its page faults and its
unmapping on every call, the unmapping a TLB shootdown across a threaded
daemon's CPUs. Pieces under glibc's mmap threshold come from the heap."""

from __future__ import annotations

import os

PIECE = 64 << 10


def read_at_most(fd: int, limit: int) -> bytes:
    """Up to limit + 1 bytes from fd's position: a result longer than
    `limit` says the file is too long, without reading the rest."""
    pieces: list[bytes] = []
    size = 0
    while size <= limit:
        more = os.read(fd, min(PIECE, limit + 1 - size))
        if not more:
            break
        pieces.append(more)
        size += len(more)
    return b"".join(pieces)
