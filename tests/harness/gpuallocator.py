"""NVIDIA's go-gpuallocator (its best-effort policy, what NVIDIA's device
plugin prefers GPUs by), built from the Go module proxy once and cached
outside the clone by version and by the hash of gpuallocator/ (main.go,
go.mod, go.sum). The program reads the GPUs and their links from whatever
libnvidia-ml.so.1 its environment finds (the simulated one here), then
answers one JSON request a line: {"available": [...], "required": [...],
"size": n} -> the GPU indexes it chooses, sorted."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

VERSION = "v0.6.0"  # gpuallocator/go.mod requires this; change both together
SOURCE = Path(__file__).parent / "gpuallocator"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cgpu" / "go"


def binary() -> Path:
    digest = hashlib.sha256(b"".join((SOURCE / f).read_bytes() for f in ("main.go", "go.mod", "go.sum")))
    out = CACHE / f"gpuallocator-{VERSION}-{digest.hexdigest()[:12]}" / "gpuallocator"
    if out.is_file():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return out
        with tempfile.TemporaryDirectory(prefix="gpuallocator-") as tmp:
            shutil.copytree(SOURCE, tmp, dirs_exist_ok=True)
            # cgo: go-nvml dlopens libnvidia-ml.so.1 at run time.
            env = dict(os.environ, CGO_ENABLED="1", GOFLAGS="-mod=mod")
            built = subprocess.run(
                ["go", "build", "-o", str(Path(tmp) / "gpuallocator"), "."],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            if built.returncode != 0:
                raise RuntimeError(f"building go-gpuallocator {VERSION} failed:\n{built.stderr[-3000:]}")
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(Path(tmp) / "gpuallocator"), out)
    return out


def choices(env: dict[str, str], requests: Iterable[tuple[Sequence[int], Sequence[int], int]]) -> list[tuple[int, ...]]:
    """go-gpuallocator's choice for each (available, required, size)."""
    lines = "".join(json.dumps({"available": list(a), "required": list(r), "size": n}) + "\n" for a, r, n in requests)
    out = subprocess.run([str(binary())], input=lines, env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"go-gpuallocator failed ({out.returncode}): {out.stderr[-2000:]}")
    return [tuple(json.loads(line)) for line in out.stdout.splitlines()]
