"""Docker's daemon.json as cgpuctl reads it: one reading, one error for a
file that is not a JSON object, for `runtime configure` and `doctor` alike."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
        raise UsageError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}; "
                         "fix it first, nothing was changed") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} does not hold a JSON object: fix it first, nothing was changed")
    return data
