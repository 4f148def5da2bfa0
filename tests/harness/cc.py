"""Small C programs tests write and compile on the spot."""

from __future__ import annotations

import subprocess
from pathlib import Path


# What every C file a test compiles is held to: a warning there is a bug too.
STRICT_C = ("-std=c11", "-Wall", "-Wextra", "-Werror")


def compile_strict(out: Path, *args: str) -> Path:
    """`cc STRICT_C -o out ARGS` (sources, flags and libraries in cc's
    order); the compiler's complaints are the failure's message."""
    proc = subprocess.run(["cc", *STRICT_C, "-o", str(out), *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out


def build_c(tmp_path: Path, source: str, name: str, *flags: str) -> Path:
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / name
    return compile_strict(out, str(src), *flags)
