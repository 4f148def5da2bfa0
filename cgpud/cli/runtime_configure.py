"""`cgpuctl runtime configure`: register the cgpu-runtime shim with containerd
or Docker, the way `nvidia-ctk runtime configure` does for NVIDIA, keeping
every other setting and every byte of the operator's files we do not need to
touch.

The planning functions (`containerd_changes`, `docker_changes`) are pure: they
take file texts and return `FileChange`s, so they can be tested without I/O and
a dry run is the same plan, printed instead of written.

containerd merges an imported file into the main config, but containerd 1.x
replaces a whole plugin section with the imported one (containerd issue 5837;
2.0 merges them key by key, containerd PR 9982). A drop-in that only adds a
runtime would therefore reset every CRI setting of config.toml to its default
and drop the built-in `runc` runtime that `default_runtime_name` names. So for
containerd 1.x the drop-in carries a copy of config.toml's section for that
plugin, as nvidia-ctk's drop-ins do; running the command again refreshes it.
"""
from __future__ import annotations

import copy
import difflib
import enum
import errno
import fnmatch
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog
import tomlkit

from cgpud.atomicfile import write_atomic
from cgpud.cli.docker_config import DOCKER_CONFIG, parse_daemon_json
from cgpud.errors import CgpuError, UsageError

log = structlog.get_logger("cgpud.runtime_configure")

RUNC_V2 = "io.containerd.runc.v2"
DEFAULT_NAME = "cgpu"
CONTAINERD_CONFIG = Path("/etc/containerd/config.toml")
DROPIN_NAME = "cgpu.toml"
BACKUP_SUFFIX = ".cgpu.bak"

# The CRI plugin that owns `containerd.runtimes`, by config version.
CRI_PLUGIN = {1: "cri", 2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}

_NAME = re.compile(r"[a-z0-9_-]+")


class Engine(enum.Enum):
    CONTAINERD = "containerd"
    DOCKER = "docker"


@dataclass(frozen=True)
class RuntimeSpec:
    """The runtime to register: its name in the engine and the shim it runs."""

    name: str
    path: Path
    set_as_default: bool = False


@dataclass(frozen=True)
class FileChange:
    """One file's text before (None: it does not exist) and after."""

    path: Path
    old: str | None
    new: str
    backup: bool = True
    mode: int | None = None  # None: keep an existing file's mode, 0644 for a new one

    @property
    def changed(self) -> bool:
        return self.old != self.new

    def diff(self) -> str:
        lines = difflib.unified_diff(
            (self.old or "").splitlines(keepends=True),
            self.new.splitlines(keepends=True),
            fromfile=str(self.path),
            tofile=f"{self.path} (cgpu)",
        )
        # A last line without a newline would run into the next file's header.
        return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


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
    return p


def default_runtime_path() -> Path:
    from cgpud.native import native_path

    return native_path("bin/cgpu-runtime")


def containerd_major_version(binary: str = "containerd") -> int | None:
    """The installed containerd's major version, or None if it cannot be run."""
    exe = shutil.which(binary)
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    # "containerd github.com/containerd/containerd 1.6.20~ds1 ..." or "... /v2 v2.0.0 ...":
    # the version is the first whitespace-separated word that looks like one.
    m = re.search(r"(?:^|\s)v?(\d+)\.\d+", proc.stdout)
    return int(m.group(1)) if proc.returncode == 0 and m else None


# ---------------------------------------------------------------- containerd


def dropin_path(config: Path) -> Path:
    return config.parent / "conf.d" / DROPIN_NAME


def containerd_changes(
    config: Path,
    main_text: str | None,
    dropin_text: str | None,
    spec: RuntimeSpec,
    containerd_major: int | None,
) -> list[FileChange]:
    """The drop-in to write and config.toml with the drop-in imported, in the
    order to write them. `containerd_major` None means unknown: plan for 1.x,
    whose rules also give a config that 2.x reads the same way."""
    main_doc = _parse_toml(config, main_text) if main_text is not None else None
    version = _containerd_version(config, main_doc, containerd_major)
    plugin = CRI_PLUGIN[version]
    main_section = _table(config, main_doc or {}, "plugins", plugin)
    replaces_sections = version < 3 and (containerd_major is None or containerd_major < 2)

    header = [
        "Written by `cgpuctl runtime configure --containerd`, which rewrites it on every run.",
        f'Registers the runtime "{spec.name}" (cgpu-runtime) with containerd; imported from {config}.',
    ]
    if replaces_sections:
        header += [
            f'containerd 1.x replaces a whole plugin section with an imported one, so the [plugins."{plugin}"]',
            f"settings of {config} are copied here: after changing them there, run the command again.",
        ]
    entry = _runtime_entry(main_section, spec)
    dropin = dropin_path(config)
    # The copy of config.toml's section keeps the operator's comments
    # (tomlkit's table), unless tomlkit cannot write it back as it read it.
    commented = _commented_section(main_text, plugin) if replaces_sections else None
    new_dropin: str | None = None
    if commented is not None:
        try:
            new_dropin = _dropin_text(config, commented, version, plugin, entry, spec, header, keeps_runc=True)
        except CgpuError:
            log.warning("runtime_configure.comments_dropped", config=str(config), plugin=plugin)
    if new_dropin is None:
        section = copy.deepcopy(main_section) if replaces_sections else {}
        new_dropin = _dropin_text(config, section, version, plugin, entry, spec, header, keeps_runc=replaces_sections)

    pattern = dropin.parent / "*.toml"
    wanted = str(dropin if _has_glob_chars(str(dropin.parent)) else pattern)
    if main_text is None:
        new_main = tomlkit.dumps({"version": version, "imports": [wanted]})
    else:
        new_main = add_import(config, main_text, wanted, covers=dropin)
    return [
        FileChange(dropin, dropin_text, new_dropin, backup=False),
        FileChange(config, main_text, new_main),
    ]


def _commented_section(main_text: str | None, plugin: str) -> Any:
    """config.toml's section for `plugin` as tomlkit reads it, comments
    included; None where there is none."""
    if main_text is None:
        return None
    plugins = tomlkit.parse(main_text).get("plugins")
    found = plugins.get(plugin) if isinstance(plugins, dict) else None
    return copy.deepcopy(found) if isinstance(found, dict) else None


def _dropin_text(
    config: Path,
    section: dict[str, Any],
    version: int,
    plugin: str,
    entry: dict[str, Any],
    spec: RuntimeSpec,
    header: Sequence[str],
    *,
    keeps_runc: bool,
) -> str:
    """The drop-in: `section` (config.toml's copy, or empty where containerd
    merges key by key) with our runtime added."""
    containerd = _table(config, section, "containerd", create=True)
    if keeps_runc and "runtimes" not in containerd:
        # Our runtimes table replaces containerd's built-in one, so the
        # built-in runc runtime has to be spelled out to survive.
        containerd["runtimes"] = {"runc": {"runtime_type": RUNC_V2}}
    _table(config, containerd, "runtimes", create=True)[spec.name] = entry
    if spec.set_as_default:
        containerd["default_runtime_name"] = spec.name
    return dump_toml({"version": version, "plugins": {plugin: section}}, header)


def containerd_warnings(config: Path, main_text: str | None) -> list[str]:
    """What would keep containerd from using the runtime even once configured."""
    doc = _parse_toml(config, main_text) if main_text is not None else {}
    disabled = doc.get("disabled_plugins", [])
    cri = {"cri", CRI_PLUGIN[2], CRI_PLUGIN[3]}
    if isinstance(disabled, list) and cri.intersection(d for d in disabled if isinstance(d, str)):
        return [(f"warning: {config} disables the CRI plugin (disabled_plugins): Kubernetes cannot use containerd "
                 "or this runtime until it is enabled; for Docker, use --docker")]
    return []


def _containerd_version(config: Path, doc: dict[str, Any] | None, major: int | None) -> int:
    if doc is None:
        # containerd's own default when it has no config file.
        return 3 if major is not None and major >= 2 else 2
    version = doc.get("version", 1)
    if isinstance(version, bool) or version not in CRI_PLUGIN:
        raise UsageError(f"{config}: version = {version!r} is not a containerd config version cgpu knows (1, 2 or 3)")
    if version == 3 and major is not None and major < 2:
        raise UsageError(f"{config} is config version 3, which the installed containerd {major}.x cannot read: "
                         "use version 2 or upgrade containerd")
    return version


def _runtime_entry(main_section: dict[str, Any], spec: RuntimeSpec) -> dict[str, Any]:
    """Our runtime, modelled on the runc runtime containers use now so that its
    options (SystemdCgroup above all: the kubelet's cgroup driver must match)
    carry over; only the shim binary differs."""
    containerd = main_section.get("containerd", {})
    runtimes = containerd.get("runtimes", {}) if isinstance(containerd, dict) else {}
    runtimes = runtimes if isinstance(runtimes, dict) else {}
    default = containerd.get("default_runtime_name", "runc") if isinstance(containerd, dict) else "runc"
    default = default if isinstance(default, str) else "runc"
    base: dict[str, Any] = {}
    for candidate in (spec.name, default, "runc"):
        found = runtimes.get(candidate)
        if isinstance(found, dict) and found.get("runtime_type") == RUNC_V2:
            base = found
            break
    entry = copy.deepcopy(base)
    entry["runtime_type"] = RUNC_V2
    options = entry.get("options")
    entry["options"] = dict(options) if isinstance(options, dict) else {}
    entry["options"]["BinaryName"] = str(spec.path)
    return entry


def _table(config: Path, doc: dict[str, Any], *keys: str, create: bool = False) -> dict[str, Any]:
    table = doc
    for i, key in enumerate(keys):
        if key not in table:
            if not create:
                return {}
            table[key] = {}
        table = table[key]
        if not isinstance(table, dict):
            dotted = ".".join(tomlkit.key(k).as_string() for k in keys[: i + 1])
            raise UsageError(f"{config}: {dotted} is not a table: fix the file first")
    return table


def _parse_toml(path: Path, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path} is not valid TOML: {e}; fix it first, nothing was changed") from None


def _has_glob_chars(text: str) -> bool:
    return any(c in text for c in "*?[\\")


def _import_covers(entry: str, base: Path, target: Path) -> bool:
    """Whether an `imports` entry loads `target`. containerd resolves relative
    entries against the main config's directory and globs only entries with a
    `*` (filepath.Glob, whose patterns match one path element each)."""
    resolved = os.path.normpath(base / entry)
    if "*" not in entry:
        return resolved == os.path.normpath(target)
    pattern, parts = Path(resolved).parts, Path(os.path.normpath(target)).parts
    return len(pattern) == len(parts) and all(fnmatch.fnmatchcase(p, g) for p, g in zip(parts, pattern, strict=True))


def add_import(config: Path, text: str, entry: str, covers: Path) -> str:
    """`text` with `entry` appended to its top-level `imports` array, unless an
    import already loads `covers`. tomlkit edits the document in place, so the
    operator's comments, key order and layout are kept."""
    doc = _parse_toml(config, text)
    imports = doc.get("imports", [])
    if not isinstance(imports, list) or not all(isinstance(i, str) for i in imports):
        raise UsageError(f"{config}: imports is not an array of strings: fix the file first")
    if any(_import_covers(i, config.parent, covers) for i in imports):
        return text
    wanted = {**doc, "imports": [*imports, entry]}
    new = _with_import(text, entry, rewrite=False)
    if _reads_as(new, wanted):
        return new
    # tomlkit 0.13 appends to a multi-line array ending in a comment without
    # the comma it needs; writing the array anew loses only comments inside it.
    log.warning("runtime_configure.imports_rewritten", config=str(config))
    new = _with_import(text, entry, rewrite=True)
    if not _reads_as(new, wanted):
        raise UsageError(f"{config}: cannot add {entry!r} to its imports safely: add it by hand, then run again")
    return new


def _with_import(text: str, entry: str, *, rewrite: bool) -> str:
    edited = tomlkit.parse(text)
    if "imports" in edited and not rewrite:
        edited["imports"].append(entry)
    else:
        edited["imports"] = [*edited.get("imports", []), entry]
    new = tomlkit.dumps(edited)
    if "\r\n" in text:
        # tomlkit writes "\n" for what it adds; keep the file's line ends.
        new = re.sub(r"(?<!\r)\n", "\r\n", new)
    return new


def _reads_as(text: str, wanted: dict[str, Any]) -> bool:
    try:
        return tomllib.loads(text) == wanted
    except tomllib.TOMLDecodeError:
        return False


# ---------------------------------------------------------------- TOML writer


def dump_toml(doc: dict[str, Any], header: Sequence[str] = ()) -> str:
    """A TOML document for `doc` (what tomllib returns, or a table tomlkit
    parsed, whose comments are kept), `header` as comment lines on top;
    checked by reading it back."""
    out = tomlkit.document()
    for line in header:
        out.add(tomlkit.comment(line))
    if header:
        out.add(tomlkit.nl())
    for key, value in doc.items():
        out[key] = value
    text = tomlkit.dumps(out)
    if tomllib.loads(text) != _plain(doc):
        raise CgpuError("internal error: the generated TOML does not read back as written")
    return text


def _plain(value: Any) -> Any:
    """A value holding tomlkit items as the plain Python value tomllib returns."""
    if hasattr(value, "unwrap"):
        return value.unwrap()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- docker


def docker_changes(config: Path, text: str | None, spec: RuntimeSpec) -> list[FileChange]:
    """daemon.json with the runtime registered, every other key kept in order."""
    data = parse_daemon_json(config, text)
    new = copy.deepcopy(data)
    runtimes = new.setdefault("runtimes", {})
    if not isinstance(runtimes, dict):
        raise UsageError(f"{config}: \"runtimes\" is not a JSON object: fix it first, nothing was changed")
    old_entry = runtimes.get(spec.name)
    entry: dict[str, Any] = {"path": str(spec.path)}
    # runtimeArgs is the one other key that goes with "path"; keep the operator's.
    if isinstance(old_entry, dict) and "runtimeArgs" in old_entry:
        entry["runtimeArgs"] = old_entry["runtimeArgs"]
    runtimes[spec.name] = entry
    if spec.set_as_default:
        new["default-runtime"] = spec.name
    if new == data and text is not None:
        return [FileChange(config, text, text)]
    return [FileChange(config, text, json.dumps(new, indent=4, ensure_ascii=False) + "\n")]


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
    path = config if config is not None else (CONTAINERD_CONFIG if engine is Engine.CONTAINERD else DOCKER_CONFIG)
    planned = plan(engine, path, spec, containerd_major)
    changes = [c for c in planned.changes if c.changed]
    warnings = "".join(w + "\n" for w in planned.warnings)
    if dry_run:
        return ("".join(c.diff() for c in changes) if changes else "no changes\n") + warnings
    if not changes:
        return f'already configured: {engine.value} runs the runtime "{spec.name}" as {spec.path}\n' + warnings
    lines = apply(changes)
    lines.append(f"restart {engine.value} (systemctl restart {engine.value}) to load the runtime \"{spec.name}\"")
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
    spec = RuntimeSpec(
        name=check_name(name),
        path=check_runtime_path(runtime_path) if runtime_path is not None else default_runtime_path(),
        set_as_default=set_as_default,
    )
    which = Engine(engine)
    major = containerd_major_version() if which is Engine.CONTAINERD else None
    return configure(which, spec, config=Path(config) if config else None, dry_run=dry_run, containerd_major=major)
