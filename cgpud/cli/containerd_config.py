"""containerd's side of `cgpuctl runtime configure`: the drop-in with the
cgpu runtime and the `imports` entry in config.toml that loads it. Read with
tomllib, edited with tomlkit so the operator's comments, key order and layout
are kept. Pure: file texts in, `FileChange`s out.

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
import fnmatch
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import tomlkit

from cgpud.cli.config_change import FileChange, RuntimeSpec
from cgpud.errors import CgpuError, UsageError

log = structlog.get_logger("cgpud.runtime_configure")

RUNC_V2 = "io.containerd.runc.v2"
CONTAINERD_CONFIG = Path("/etc/containerd/config.toml")
DROPIN_NAME = "cgpu.toml"

# The CRI plugin that owns `containerd.runtimes`, by config version.
CRI_PLUGIN = {1: "cri", 2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}


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
        return [
            (
                f"warning: {config} disables the CRI plugin (disabled_plugins): Kubernetes cannot use containerd "
                "or this runtime until it is enabled; for Docker, use --docker"
            )
        ]
    return []


def _containerd_version(config: Path, doc: dict[str, Any] | None, major: int | None) -> int:
    if doc is None:
        # containerd's own default when it has no config file.
        return 3 if major is not None and major >= 2 else 2
    version = doc.get("version", 1)
    if isinstance(version, bool) or version not in CRI_PLUGIN:
        raise UsageError(f"{config}: version = {version!r} is not a containerd config version cgpu knows (1, 2 or 3)")
    if version == 3 and major is not None and major < 2:
        raise UsageError(
            f"{config} is config version 3, which the installed containerd {major}.x cannot read: "
            "use version 2 or upgrade containerd"
        )
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
    # tomlkit (0.15.2 still) appends to a multi-line array ending in a comment without
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
