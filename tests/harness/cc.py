"""Small C programs tests write and compile on the spot."""

from __future__ import annotations

import subprocess
from pathlib import Path


def build_c(tmp_path: Path, source: str, name: str, *flags: str) -> Path:
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / name
    subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-o", str(out), str(src), *flags], check=True)
    return out
