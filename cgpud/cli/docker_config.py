"""Docker's side of `cgpuctl runtime configure` (daemon.json's `runtimes`), and
the one reading of daemon.json, with one error for a file that is not a JSON
object, for `runtime configure` and `doctor` alike."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from cgpud.cli.config_change import FileChange, RuntimeSpec
from cgpud.errors import UsageError

DOCKER_CONFIG = Path("/etc/docker/daemon.json")


def parse_daemon_json(path: Path, text: str | None) -> dict[str, Any]:
    """daemon.json's settings; {} for a missing or blank file (Docker's own
    reading). A file that is not a JSON object is an error naming it."""
    if text is None or not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(
            f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}; fix it first, nothing was changed"
        ) from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} does not hold a JSON object: fix it first, nothing was changed")
    return data


def docker_changes(config: Path, text: str | None, spec: RuntimeSpec) -> list[FileChange]:
    """daemon.json with the runtime registered, every other key kept in order."""
    data = parse_daemon_json(config, text)
    new = copy.deepcopy(data)
    runtimes = new.setdefault("runtimes", {})
    if not isinstance(runtimes, dict):
        raise UsageError(f'{config}: "runtimes" is not a JSON object: fix it first, nothing was changed')
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
