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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cgpud.atomicfile import write_atomic
from cgpud.errors import UsageError

MAX_SPEC = 8 << 20  # the shim reads at most this much too


def spec_path(bundle: Path) -> Path:
    if not bundle.is_absolute():
        raise UsageError(f"bundle path {str(bundle)!r} is not absolute")
    return bundle / "config.json"


def read_spec(bundle: Path) -> dict[str, Any]:
    path = spec_path(bundle)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path} is not a regular file")
        data = f.read(MAX_SPEC + 1)
    if len(data) > MAX_SPEC:
        raise UsageError(f"{path} is larger than {MAX_SPEC >> 20} MiB")
    try:
        spec = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(spec, dict):
        raise UsageError(f"{path} is not a JSON object")
    return spec


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
    fd = os.dup(root_fd)
    try:
        for i, name in enumerate(parts):
            walked = "/" + "/".join(parts[: i + 1])
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return  # the runtime creates the rest as plain directories
            if stat.S_ISLNK(st.st_mode):
                link = os.readlink(name, dir_fd=fd)
                raise UsageError(
                    f"the image makes {walked} a symbolic link (to {link}): cgpu mounts its files at {target} "
                    f"and never follows links in a container's rootfs; use an image where {walked} is a real "
                    f"{'file' if i == len(parts) - 1 else 'directory'}"
                )
            if i == len(parts) - 1:
                return
            if not stat.S_ISDIR(st.st_mode):
                raise UsageError(f"the image has a file at {walked} where cgpu needs a directory for {target}")
            nxt = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)


def write_spec(bundle: Path, spec: dict[str, Any]) -> None:
    path = spec_path(bundle)
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    write_atomic(path, json.dumps(spec).encode(), mode, durable=False)
