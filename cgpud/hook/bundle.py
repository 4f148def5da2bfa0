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
import tempfile
from pathlib import Path
from typing import Any

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


def write_spec(bundle: Path, spec: dict[str, Any]) -> None:
    path = spec_path(bundle)
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    fd, tmp = tempfile.mkstemp(prefix=".config.json.cgpu-", dir=bundle)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
            f.flush()
            os.fchmod(f.fileno(), mode)
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
