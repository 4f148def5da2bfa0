"""Reading and rewriting an OCI bundle's config.json, atomically.

The bundle directory comes from the runtime's caller (containerd, dockerd:
root); config.json inside it is still opened without following links, and
the rewrite is a temp file renamed over it, so the runtime reads either the
old spec or the whole new one, never a torn one. No fsync: the spec only
matters to this start, and a host crash ends the container with it."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cgpud.atomicfile import write_atomic
from cgpud.boundedread import read_at_most
from cgpud.errors import UsageError

MAX_SPEC = 8 << 20  # the shim reads at most this much too


def spec_path(bundle: Path) -> Path:
    if not bundle.is_absolute():
        raise UsageError(f"bundle path {str(bundle)!r} is not absolute")
    return bundle / "config.json"


def read_spec(bundle: Path, opened: int | None = None) -> dict[str, Any]:
    """`opened`: the spec as an fd its caller opened (the shim's, whose
    config.json path holds a FIFO by now); read from its start, not closed."""
    path = spec_path(bundle)
    if opened is not None:
        return _spec_from(opened, path, rewind=True)
    try:
        # O_NONBLOCK: opening a FIFO must not hold the relay (and every start behind it) until a writer comes.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from e
    try:
        return _spec_from(fd, path)
    finally:
        os.close(fd)


def _spec_from(fd: int, path: Path, rewind: bool = False) -> dict[str, Any]:
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{path} is not a regular file")
        if rewind:
            os.lseek(fd, 0, os.SEEK_SET)
        data = read_at_most(fd, MAX_SPEC)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from e
    if len(data) > MAX_SPEC:
        raise UsageError(f"{path} is larger than {MAX_SPEC >> 20} MiB")
    try:
        spec = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # deep nesting recurses
        raise UsageError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(spec, dict):
        raise UsageError(f"{path} is not a JSON object")
    # UTF-8 JSON holds a NUL only as the escape \u0000 (json.loads refuses raw
    # control characters in strings), so a spec with neither needs no walk;
    # UTF-16 or -32 text has NUL bytes and is walked.
    if (b"\0" in data or b"\\u0000" in data) and _holds_nul(spec):
        raise UsageError(f"{path} has a NUL character in a string: no path, argument or variable can hold one")
    return spec


def _holds_nul(value: Any) -> bool:
    """Any string in the spec with a NUL: os.open() of such a path raises
    ValueError, not OSError, wherever the spec names a path."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str) and "\0" in v:
            return True
        if isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return False


def rootfs_path(bundle: Path, spec: dict[str, Any]) -> Path:
    root = spec.get("root")
    path = root.get("path") if isinstance(root, dict) else None
    if not isinstance(path, str) or not path:
        raise UsageError(f"{spec_path(bundle)}: root.path is missing")
    return bundle / path  # an absolute path stays as it is


def check_targets(rootfs: Path, targets: Iterable[str]) -> None:
    """Refuse a rootfs where a mount target or any directory above it is a
    symbolic link. The runtime would resolve it inside the root, but a link
    into /proc or a relative one means something else once the container
    runs: the mount would land where libcgpu.so never looks, and the
    container would start without its limit. Walks with O_NOFOLLOW from a
    directory fd, so the walk itself never leaves the root."""
    try:
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"cannot open the container rootfs {rootfs}: {e.strerror}") from e
    try:
        for target in targets:
            _check_target(root_fd, target)
    finally:
        os.close(root_fd)


def _check_target(root_fd: int, target: str) -> None:
    parts = [p for p in target.split("/") if p]
    found = _first_problem(root_fd, parts)
    if found is None:
        return
    i, link = found
    walked = "/" + "/".join(parts[: i + 1])
    if link is None:
        raise UsageError(f"the image has a file at {walked} where cgpu needs a directory for {target}")
    raise UsageError(
        f"the image makes {walked} a symbolic link (to {link}): cgpu mounts its files at {target} "
        f"and never follows links in a container's rootfs; use an image where {walked} is a real "
        f"{'file' if i == len(parts) - 1 else 'directory'}"
    )


def _first_problem(base_fd: int, parts: list[str]) -> tuple[int, str | None] | None:
    """Walks `parts` below `base_fd` without following links: the index of
    the first symbolic link (with its text) or of a non-directory with more
    parts below it (None for the text); None if the walk is clean or stops
    at a missing name (the runtime creates the rest as directories)."""
    fd = os.dup(base_fd)
    try:
        for i, name in enumerate(parts):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            if stat.S_ISLNK(st.st_mode):
                return i, os.readlink(name, dir_fd=fd)
            if i == len(parts) - 1:
                return None
            if not stat.S_ISDIR(st.st_mode):
                return i, None
            nxt = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return None
    finally:
        os.close(fd)


# Mount types that come up empty, so nothing in them can redirect a target.
_EMPTY_TYPES = ("tmpfs", "ramfs")


def _is_bind(mount: Mapping[str, Any]) -> bool:
    options = mount.get("options")
    return mount.get("type") == "bind" or (isinstance(options, list) and any(o in ("bind", "rbind") for o in options))


def check_volumes(rootfs: Path, mounts: Any, targets: Iterable[str], ours: Iterable[str] = ()) -> None:
    """The rootfs check for the spec's own mounts (volumes). The runtime
    resolves a target through every earlier mount above it, so a bind mount
    at /run, /etc or /usr/local whose host source holds a link where cgpu
    mounts redirects it as a link in the image would: that is refused
    naming the link (walked in the host source without following links).
    A bind mount there is refused even without a link: whoever else can
    write its source (a sidecar sharing an emptyDir, another container)
    can rmdir or unlink cgpu's mount points in it, which detaches cgpu's
    mounts in this container too, and put their own files there. A tmpfs
    comes up empty and private, and passes; other kinds of mount (overlay,
    proc, ...) cannot be checked and are refused. Mounts at exactly one of
    `ours` are replaced by cgpu's and skipped.

    A destination counts where the runtime will put it: resolved like
    runc's securejoin, following links inside the rootfs and inside the
    earlier mounts (so `/var/run` in an image with `/var/run -> /run` is
    `/run`)."""
    if not isinstance(mounts, list):
        return  # read_request already refused it
    replaced = {d.rstrip("/") for d in ours}
    targets = list(targets)
    placed: list[tuple[list[str], Mapping[str, Any]]] = []
    for mount in mounts:
        if not isinstance(mount, Mapping) or str(mount.get("destination", "")).rstrip("/") in replaced:
            continue
        written = str(mount.get("destination", ""))
        where = _resolve(rootfs, placed, written)
        placed.append((where, mount))
        dest = "/" + "/".join(where)
        covered = [(t, below) for t in targets if (below := _below(t, dest)) is not None]
        if covered:
            shown = dest if _lexical(written) == dest else f"{dest} (written as {written})"
            _check_volume(mount, shown, covered)


def _lexical(path: str) -> str:
    return "/" + os.path.normpath("/" + path).lstrip("/")


_MAX_LINKS = 40  # as the kernel allows in one path walk


def _resolve(rootfs: Path, placed: list[tuple[list[str], Mapping[str, Any]]], dest: str) -> list[str]:
    """The parts of the path a mount written at `dest` lands on: every link
    on the way is followed and kept inside the root, looking at the rootfs
    or at the latest earlier mount that covers each step. Stops at the first
    name that does not exist (the runtime creates the rest as directories)."""
    todo = [p for p in dest.split("/") if p]
    done: list[str] = []
    links = 0
    while todo:
        name = todo.pop(0)
        if name == ".":
            continue
        if name == "..":
            if done:
                done.pop()
            continue
        link = _readlink_at(rootfs, placed, [*done, name])
        if link is None:
            done.append(name)
            continue
        links += 1
        if links > _MAX_LINKS:
            raise UsageError(f"the mount destination {dest} goes through more than {_MAX_LINKS} symbolic links")
        if link.startswith("/"):
            done = []
        todo = [p for p in link.split("/") if p] + todo
    return done


def _readlink_at(rootfs: Path, placed: list[tuple[list[str], Mapping[str, Any]]], parts: list[str]) -> str | None:
    """The link text at `parts` (whose parents are real directories), None
    if it is anything else or missing."""
    host: str | None = str(rootfs)
    below = parts
    for dest, mount in reversed(placed):  # the latest mount covering the path is the one seen there
        if parts[: len(dest)] == dest:
            if len(parts) == len(dest):
                return None  # a mount's root: a directory
            below = parts[len(dest) :]
            host = str(mount.get("source", "")) if _is_bind(mount) else None
            break
    if host is None:  # a tmpfs (or a kind of mount cgpu refuses over its targets) holds no links yet
        return None
    path = os.path.join(host, *below)
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            return os.readlink(path)
    except OSError:
        return None
    return None


def _below(target: str, dest: str) -> list[str] | None:
    t = [p for p in target.split("/") if p]
    d = [p for p in dest.split("/") if p]
    return t[len(d) :] if t[: len(d)] == d else None


def _check_volume(mount: Mapping[str, Any], dest: str, covered: list[tuple[str, list[str]]]) -> None:
    kind = str(mount.get("type") or "bind")
    target = covered[0][0]
    if not _is_bind(mount):
        if kind in _EMPTY_TYPES:
            return
        raise UsageError(
            f"a {kind} mount at {dest} covers {target}, where cgpu mounts its files, and cgpu cannot check "
            f"what is in it for links: mount it elsewhere or use a tmpfs"
        )
    source = str(mount.get("source", ""))
    try:
        fd = os.open(source, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        fd = -1
    try:
        for walked, below in covered if fd >= 0 else ():
            found = _first_problem(fd, below)
            if found is not None:
                _refuse_link(dest, source, walked, below, *found)
    finally:
        if fd >= 0:
            os.close(fd)
    raise UsageError(
        f"the volume at {dest} (from {source}) covers {target}, where cgpu mounts its files: anyone else who "
        f"can write {source} could remove cgpu's mount points there and so strip this container of its limits; "
        f"mount the volume elsewhere, or use a tmpfs at {dest}"
    )


def _refuse_link(dest: str, source: str, target: str, below: list[str], i: int, link: str | None) -> None:
    inside = os.path.join(dest, *below[: i + 1])
    host = os.path.join(source, *below[: i + 1])
    if link is None:
        raise UsageError(
            f"the volume at {dest} (from {source}) has a file at {inside} ({host}) where cgpu "
            f"needs a directory for {target}"
        )
    raise UsageError(
        f"the volume at {dest} (from {source}) makes {inside} a symbolic link ({host} -> {link}): cgpu mounts "
        f"its files at {target} and never follows links; remove the link from the volume or mount it elsewhere"
    )


def write_spec(bundle: Path, spec: dict[str, Any]) -> None:
    path = spec_path(bundle)
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    write_atomic(path, json.dumps(spec).encode(), mode, durable=False)
