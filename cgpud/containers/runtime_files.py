"""The host files cgpud mounts into containers or names in their hooks,
copied at start from the installed package into the daemon's own
directory: `<state_dir>/runtime/<version>/` (libcgpu.so, cgpu-hook,
ld.so.preload). Containers then depend on a root-owned directory only the
daemon writes, not on wherever pip put the package (a venv, a home
directory).

One directory per cgpud version, so an upgrade never rewrites a file that a
running container has mapped, or that its hooks name: the poststop hook of a
container started before the upgrade still runs the copy its spec names.
Every edit cgpud hands out (bundle, CDI spec, device plugin answer) is first
recorded against its instance (InstanceService.use_runtime, in the store);
the sweep removes an old version's directory once no active instance is
recorded against it. Files from before versioning, in `runtime/` itself, are
the version LEGACY_RUNTIME ("") and go the same way."""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Set
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from cgpud.atomicfile import write_atomic
from cgpud.errors import CgpuError
from cgpud.containers.edits import CONTAINER_LIBRARY, RuntimeFiles
from cgpud.node.store import LEGACY_RUNTIME
from cgpud.native import native_path

if TYPE_CHECKING:
    from cgpud.node.service import InstanceService

FILE_NAMES = ("libcgpu.so", "ld.so.preload", "cgpu-hook")
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")


def version_dir_name(version: str) -> str:
    """A package version as one safe path component: "0.1.0" stays, anything
    but letters, digits and . _ + - becomes "_", and a name that could mean
    something else to a path ("", ".", "..", ".hidden") gets a "v" first."""
    name = _UNSAFE.sub("_", version)[:64]
    return name if name and not name.startswith(".") else f"v{name}"


def _check_private(directory: Path) -> None:
    st = directory.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise CgpuError(f"{directory} is not a directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        # Another user who can write here could swap the library that every
        # GPU container preloads.
        raise CgpuError(
            f"{directory} must be owned by the user cgpud runs as and writable by nobody else "
            f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"
        )


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o755, exist_ok=True)
    os.chmod(path, 0o755)
    _check_private(path)


def _install(data: bytes, path: Path, mode: int) -> None:
    try:
        if path.read_bytes() == data and stat.S_IMODE(path.stat().st_mode) == mode:
            return
    except OSError:
        pass
    write_atomic(path, data, mode)


def runtime_root(state_dir: Path) -> Path:
    return state_dir / "runtime"


def install_runtime_files(state_dir: Path, relay_socket: Path, version: str | None = None) -> RuntimeFiles:
    """Copy libcgpu.so and cgpu-hook and write the preload list into this
    version's directory (cgpud.__version__ unless given). Files already there
    with the same bytes are left alone: a restart of the same version
    rewrites nothing. Raises CgpuError if the state directory is not the
    daemon's alone."""
    if version is None:
        from cgpud import __version__

        version = __version__
    name = version_dir_name(version)
    root = runtime_root(state_dir)
    target = root / name
    try:
        state_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        _check_private(state_dir)
        _private_dir(root)
        _private_dir(target)
        files = RuntimeFiles(target / "libcgpu.so", target / "ld.so.preload", target / "cgpu-hook", relay_socket, name)
        _install(native_path("lib/libcgpu.so").read_bytes(), files.library, 0o755)
        _install(native_path("bin/cgpu-hook").read_bytes(), files.hook, 0o755)
        _install(f"{CONTAINER_LIBRARY}\n".encode(), files.preload, 0o644)
    except OSError as e:
        raise CgpuError(f"cannot install runtime files in {target}: {e}") from e
    return files


def installed_versions(root: Path) -> set[str]:
    """The versions with files under `root`: its subdirectories, and
    LEGACY_RUNTIME if any unversioned file is left in it."""
    found: set[str] = set()
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return found
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            found.add(entry.name)
        elif entry.name in FILE_NAMES:
            found.add(LEGACY_RUNTIME)
    return found


def unused_versions(installed: Set[str], in_use: Set[str], current: str) -> set[str]:
    """The versions whose files may go: installed, not the current one, and
    no active instance's edits name them. Pure: the whole decision."""
    return set(installed) - set(in_use) - {current}


def _remove(root: Path, version: str) -> None:
    if version == LEGACY_RUNTIME:
        for name in FILE_NAMES:
            (root / name).unlink(missing_ok=True)
        return
    path = root / version
    if path.is_symlink() or not path.is_dir():  # not ours to follow
        raise CgpuError(f"{path} is not a directory cgpud made")
    shutil.rmtree(path)


def collect(service: InstanceService, files: RuntimeFiles, root: Path) -> list[str]:
    """Removes the runtime directories of old versions no active instance
    uses (a sweep). The in-use set is read after the listing, so a version
    recorded in between is kept; the current version is never removed and is
    the only one new edits name. Returns the versions removed."""
    log = structlog.get_logger("cgpud.runtime")
    installed = installed_versions(root)
    if not installed - {files.version}:  # only the current one: nothing may go, no need to ask the table
        return []
    doomed = unused_versions(installed, service.runtime_versions_in_use(), files.version)
    removed: list[str] = []
    for version in sorted(doomed):
        try:
            _remove(root, version)
        except (OSError, CgpuError) as e:  # the next sweep tries again
            log.error("cannot remove old runtime files", version=version or "(unversioned)", error=str(e))
            continue
        log.info("removed old runtime files", version=version or "(unversioned)")
        removed.append(version)
    return removed
