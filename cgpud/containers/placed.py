"""Where the runtime really put cgpu's mounts, checked at the bind.

The rootfs and volume checks (bundle.py) run at prepare; runc mounts a few
milliseconds later, following whatever links are there by then. runc runs
the createRuntime (and prestart) hooks after every mount is in place and
before pivot_root, so the container's init process then shows each mount
in /proc/<pid>/mountinfo at `<rootfs><destination>`. The shim binds once
`create` has returned, after pivot_root: the init's table then holds the
container's mounts only, at `<destination>` (rootfs ""). A cgpu mount that is
not at its place, or anything but a tmpfs over one of its parent
directories, means a link or a volume changed after the check: the
container does not start.

parse_mountinfo and check_placed are pure; read_mountinfo reads /proc."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from cgpud.boundedread import read_at_most
from cgpud.errors import UsageError

MAX_MOUNTINFO = 16 << 20
_ESCAPE = re.compile(rb"\\([0-7]{3})")


@dataclass(frozen=True)
class MountPoint:
    path: str
    fstype: str


def _unescape(field: bytes) -> str:
    if b"\\" in field:
        field = _ESCAPE.sub(lambda m: bytes([int(m.group(1), 8) & 0xFF]), field)
    return os.fsdecode(field)


def _escape(path: str) -> bytes:
    """A path as mountinfo writes it (the kernel's mangle: space, tab,
    newline and backslash in octal)."""
    return b"".join(b"\\%03o" % c if c in b" \t\n\\" else bytes([c]) for c in os.fsencode(path))


def parse_mountinfo(data: bytes, under: str | None = None) -> list[MountPoint]:
    """Mount points and filesystem types, in mount order (proc(5): the
    fifth field, and the first after the " - " separator). `under`: only
    the mount points at or below that path (a cheap test skips the other
    lines before they are split)."""
    out = []
    root = under.rstrip("/") if under is not None else None
    prefix = _escape(root) if root is not None else None
    for line in data.split(b"\n"):
        if prefix is not None and prefix not in line:
            continue
        fields = line.split(b" ")
        if len(fields) < 7 or b"-" not in fields[6:]:
            continue
        sep = fields.index(b"-", 6)
        if sep + 1 >= len(fields) or not fields[sep + 1]:
            continue
        point = _unescape(fields[4])
        if root is None or point == root or point.startswith(root + "/"):
            out.append(MountPoint(point, _unescape(fields[sep + 1])))
    return out


def read_mountinfo(pid: int, under: str | None = None) -> list[MountPoint]:
    try:
        fd = os.open(f"/proc/{pid}/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = read_at_most(fd, MAX_MOUNTINFO)
        finally:
            os.close(fd)
    except OSError as e:
        raise UsageError(f"cannot read the mounts of the container's init process {pid}: {e.strerror}") from e
    if len(data) > MAX_MOUNTINFO:
        raise UsageError(f"the mount table of process {pid} is larger than {MAX_MOUNTINFO >> 20} MiB")
    return parse_mountinfo(data, under)


def _ancestors(targets: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for t in targets:
        parts = [p for p in t.split("/") if p]
        out.update("/" + "/".join(parts[:i]) for i in range(1, len(parts)))
    return out


def check_placed(mounts: list[MountPoint], rootfs: str, targets: Iterable[str]) -> bool:
    """Raises UsageError naming what is wrong; False when the runtime had
    not mounted anything yet (no /proc in the rootfs: a runtime that runs
    this hook earlier than runc), True when checked."""
    rootfs = rootfs.rstrip("/")
    at = {m.path for m in mounts}
    if f"{rootfs}/proc" not in at:
        return False
    targets = list(targets)
    for target in targets:
        # Exactly one: the spec's own mounts there were dropped for cgpu's,
        # so a second one came through a link.
        found = sum(1 for m in mounts if m.path == rootfs + target)
        if found == 0:
            raise UsageError(
                f"cgpu's mount at {target} is not in place: a link in the image or in a volume sent it elsewhere "
                f"after cgpud checked the bundle; the container does not start"
            )
        if found > 1:
            raise UsageError(
                f"{found} mounts lie at {target}, where only cgpu's belongs: a link in the image or in a volume "
                f"put one there after cgpud checked the bundle; the container does not start"
            )
    covering = _ancestors(targets) - set(targets)
    for m in mounts:
        inside = m.path[len(rootfs) :] if m.path.startswith(rootfs + "/") else None
        if inside in covering and m.fstype != "tmpfs":
            raise UsageError(
                f"a {m.fstype} mount lies over {inside}, above where cgpu mounts its files: a link in the image "
                f"or in a volume put it there after cgpud checked the bundle; the container does not start"
            )
    return True
