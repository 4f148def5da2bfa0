"""The host files cgpud mounts into containers or names in their hooks,
copied at start from the installed package into the daemon's own
directory. Containers then depend on a root-owned directory only the
daemon writes, not on wherever pip put the package (a venv, a home
directory), and an upgrade replaces files by rename: running containers
keep the copy they mapped."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from cgpud.atomicfile import write_atomic
from cgpud.errors import CgpuError
from cgpud.containers.edits import CONTAINER_LIBRARY, RuntimeFiles
from cgpud.native import native_path


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


def _install(data: bytes, path: Path, mode: int) -> None:
    try:
        if path.read_bytes() == data and stat.S_IMODE(path.stat().st_mode) == mode:
            return
    except OSError:
        pass
    write_atomic(path, data, mode)


def install_runtime_files(state_dir: Path, relay_socket: Path) -> RuntimeFiles:
    """Copy libcgpu.so and cgpu-hook and write the preload list. Raises
    CgpuError if the state directory is not the daemon's alone."""
    runtime = state_dir / "runtime"
    try:
        state_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        _check_private(state_dir)
        runtime.mkdir(mode=0o755, exist_ok=True)
        os.chmod(runtime, 0o755)
        _check_private(runtime)
        files = RuntimeFiles(runtime / "libcgpu.so", runtime / "ld.so.preload", runtime / "cgpu-hook", relay_socket)
        _install(native_path("lib/libcgpu.so").read_bytes(), files.library, 0o755)
        _install(native_path("bin/cgpu-hook").read_bytes(), files.hook, 0o755)
        _install(f"{CONTAINER_LIBRARY}\n".encode(), files.preload, 0o644)
    except OSError as e:
        raise CgpuError(f"cannot install runtime files in {runtime}: {e}") from e
    return files

