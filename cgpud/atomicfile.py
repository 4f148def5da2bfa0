"""Replacing a file so that readers see the old one or the new one, never a
partial write: a temp file in the same directory, renamed over the target.
The one implementation behind regions, runtime files, specs and configs."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: Path,
    data: bytes,
    mode: int,
    *,
    durable: bool = True,
    sync_dir: bool | None = None,
    owner: tuple[int, int] | None = None,
    suffix: str = "",
) -> None:
    """`durable` also survives a power loss (fsync of the file, then of the
    directory unless `sync_dir` is False because the caller syncs it once
    after several files); without it the rename is atomic but may be lost
    with the host, enough for files that live no longer than its processes.
    `owner` is applied where we may (as root). `suffix` names the temp file,
    e.g. `.tmp` for directories whose readers skip it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # explicit: the umask must not narrow it
            if owner is not None:
                with contextlib.suppress(PermissionError):  # not root: the file stays ours
                    os.fchown(f.fileno(), *owner)
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable if sync_dir is None else sync_dir:
        fsync_dir(path.parent)
