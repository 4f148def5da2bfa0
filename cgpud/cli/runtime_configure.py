"""`cgpuctl runtime configure`: register the cgpu-runtime shim with containerd
or Docker, the way `nvidia-ctk runtime configure` does for NVIDIA, keeping
every other setting and every byte of the operator's files we do not need to
touch.

The planning functions (`containerd_config.containerd_changes`,
`docker_config.docker_changes`) are pure: they take file texts and return
`FileChange`s, so they can be tested without I/O and a dry run is the same
plan, printed instead of written. This module checks the arguments, reads
the files, and writes the plan (or prints it).
"""

from __future__ import annotations

import enum
import errno
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from cgpud.atomicfile import write_atomic
from cgpud.contract import RUNTIME_GPU_PROGRAM
from cgpud.cli.config_change import FileChange, RuntimeSpec
from cgpud.cli.containerd_config import CONTAINERD_CONFIG, containerd_changes, containerd_major_version
from cgpud.cli.containerd_config import containerd_warnings, dropin_path
from cgpud.cli.docker_config import DOCKER_CONFIG, docker_changes
from cgpud.cli.toolkit_config import TOOLKIT_CONFIG, toolkit_changes
from cgpud.errors import CgpuError, UsageError

BACKUP_SUFFIX = ".cgpu.bak"

_NAME = re.compile(r"[a-z0-9_-]+")


class Engine(enum.Enum):
    CONTAINERD = "containerd"
    DOCKER = "docker"
    NVIDIA_TOOLKIT = "nvidia-toolkit"  # not an engine: the NVIDIA toolkit's own config (toolkit_config.py)


# ---------------------------------------------------------------- arguments


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise UsageError(f"runtime name {name!r} is not valid: use lowercase letters, digits, '_' and '-'")
    if name == "runc":
        raise UsageError("runtime name 'runc' would replace the default runtime: choose another --name")
    return name


def check_runtime_path(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_absolute():
        raise UsageError(f"--runtime-path {str(path)!r} is not an absolute path: give the full path of cgpu-runtime")
    if not p.is_file():
        raise UsageError(f"--runtime-path {p} is not an existing file: give the path of the installed cgpu-runtime")
    if not os.access(p, os.X_OK):
        raise UsageError(f"--runtime-path {p} is not executable: chmod +x it or give the installed cgpu-runtime")
    # cgpu-runtime hands GPU starts to the shim proper beside its real file.
    gpu = p.resolve().parent / RUNTIME_GPU_PROGRAM
    if not (gpu.is_file() and os.access(gpu, os.X_OK)):
        raise UsageError(
            f"--runtime-path {p}: there is no executable {RUNTIME_GPU_PROGRAM} beside {p.resolve()}, "
            f"and GPU containers would fail to start without it: give the installed cgpu-runtime"
        )
    return p


def default_runtime_path(stable: Path = Path("/usr/bin/cgpu-runtime")) -> Path:
    from cgpud.native import native_path

    native = native_path("bin/cgpu-runtime")
    # The deb and rpm keep each version's files under /opt/cgpu/<version>/
    # and link /usr/bin/cgpu-runtime to the current one: containerd's and
    # Docker's config must name the link, or an upgrade leaves it pointing at
    # a removed version.
    if stable.is_symlink() and stable.resolve() == native.resolve():
        return stable
    return native


# ---------------------------------------------------------------- I/O


def _read(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CgpuError(f"cannot read {path}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path} is not UTF-8 text (byte {e.start}): fix it first, nothing was changed") from None


@dataclass(frozen=True)
class Plan:
    changes: list[FileChange]
    warnings: list[str]


def plan(engine: Engine, config: Path, spec: RuntimeSpec, containerd_major: int | None = None) -> Plan:
    config = Path(os.path.abspath(config))
    if engine is Engine.DOCKER:
        return Plan(docker_changes(config, _read(config), spec), [])
    if engine is Engine.NVIDIA_TOOLKIT:
        return Plan(toolkit_changes(config, _read(config)), [])
    dropin = dropin_path(config)
    main_text = _read(config)
    changes = containerd_changes(config, main_text, _read(dropin), spec, containerd_major)
    try:
        # The drop-in may hold a copy of config.toml's settings (registry
        # credentials included): it is no more readable than config.toml.
        mode = config.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o644
    except OSError as e:
        raise CgpuError(f"cannot read {config}: {e.strerror}") from None
    changes = [replace(c, mode=mode) if c.path == dropin else c for c in changes]
    return Plan(changes, containerd_warnings(config, main_text))


def apply(changes: Sequence[FileChange]) -> list[str]:
    """Write the changed files in order; one line per file written."""
    done: list[str] = []
    for change in changes:
        if not change.changed:
            continue
        target = Path(os.path.realpath(change.path))
        try:
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            st = target.stat() if change.old is not None else None
            mode = change.mode if change.mode is not None else st.st_mode & 0o7777 if st else 0o644
            owner = (st.st_uid, st.st_gid) if st else None
            note = ""
            if st and change.backup:
                backup = target.with_name(target.name + BACKUP_SUFFIX)
                if not backup.exists():
                    write_atomic(backup, (change.old or "").encode(), mode, owner=owner, suffix=".tmp")
                    note = f" (original kept as {backup})"
            write_atomic(target, change.new.encode(), mode, owner=owner, suffix=".tmp")
        except OSError as e:
            hint = " (run as root)" if e.errno in (errno.EPERM, errno.EACCES) else ""
            raise CgpuError(f"cannot write {e.filename or target}: {e.strerror}{hint}") from None
        done.append(f"{'updated' if change.old is not None else 'created'} {change.path}{note}")
    return done


def configure(
    engine: Engine,
    spec: RuntimeSpec,
    *,
    config: Path | None = None,
    dry_run: bool = False,
    containerd_major: int | None = None,
) -> str:
    """Plan, then print the diff (dry run) or write; returns the text to show."""
    defaults = {
        Engine.CONTAINERD: CONTAINERD_CONFIG,
        Engine.DOCKER: DOCKER_CONFIG,
        Engine.NVIDIA_TOOLKIT: TOOLKIT_CONFIG,
    }
    path = config if config is not None else defaults[engine]
    planned = plan(engine, path, spec, containerd_major)
    changes = [c for c in planned.changes if c.changed]
    warnings = "".join(w + "\n" for w in planned.warnings)
    if dry_run:
        return ("".join(c.diff() for c in changes) if changes else "no changes\n") + warnings
    if engine is Engine.NVIDIA_TOOLKIT:
        if not changes:
            return f"already configured: {path} gives GPUs only from device lists, never from env\n"
        # The toolkit reads its config at every container start: nothing to restart.
        return (
            "\n".join(
                [*apply(changes), "the NVIDIA toolkit now ignores NVIDIA_VISIBLE_DEVICES in unprivileged containers"]
            )
            + "\n"
        )
    if not changes:
        return f'already configured: {engine.value} runs the runtime "{spec.name}" as {spec.path}\n' + warnings
    lines = apply(changes)
    if engine is Engine.DOCKER:
        # dockerd reloads runtimes on SIGHUP; a restart stops every running
        # container unless live-restore is on.
        lines.append(f'reload docker (systemctl reload docker) to load the runtime "{spec.name}"')
    else:
        lines.append(f'restart containerd (systemctl restart containerd) to load the runtime "{spec.name}"')
    return "\n".join(lines) + "\n" + warnings


def configure_from_cli(
    engine: str,
    *,
    config: str | None,
    runtime_path: str | None,
    name: str,
    set_as_default: bool,
    dry_run: bool,
) -> str:
    which = Engine(engine)
    if which is Engine.NVIDIA_TOOLKIT:
        if runtime_path is not None or set_as_default or name != "cgpu":
            raise UsageError(
                "--nvidia-toolkit changes the toolkit's own settings: --runtime-path, --name and "
                "--set-as-default are for --containerd and --docker"
            )
        return configure(which, RuntimeSpec(name, Path("/")), config=Path(config) if config else None, dry_run=dry_run)
    spec = RuntimeSpec(
        name=check_name(name),
        path=check_runtime_path(runtime_path) if runtime_path is not None else default_runtime_path(),
        set_as_default=set_as_default,
    )
    major = containerd_major_version() if which is Engine.CONTAINERD else None
    return configure(which, spec, config=Path(config) if config else None, dry_run=dry_run, containerd_major=major)
