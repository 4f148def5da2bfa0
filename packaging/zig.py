"""The C compiler the packages are built with: zig's clang, from PyPI's
`ziglang` wheel (pinned), aimed at glibc 2.17, the manylinux2014 floor, so
every ELF file it links runs on CentOS 7 and everything newer. zig carries
the headers and link stubs of every glibc version: nothing of this
machine's newer glibc leaks in.

Installed once into a cache outside the clone, by version
($XDG_CACHE_HOME or ~/.cache, then cgpu/package/zig-<version>/), with
cc, ar and ranlib scripts that configure scripts and Makefiles can call.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ZIG_VERSION = "0.17.1"
GLIBC_FLOOR = "2.17"
TARGET = f"x86_64-linux-gnu.{GLIBC_FLOOR}"


class ZigError(RuntimeError):
    pass


def cache_root() -> Path:
    """Where the packaging toolchain and the interpreter it builds live."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cgpu" / "package"


@dataclass(frozen=True)
class Zig:
    """An installed zig: `bin/` holds cc, ar and ranlib for TARGET."""

    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def cc(self) -> Path:
        return self.bin / "cc"

    def environment(self) -> dict[str, str]:
        """Variables that point autoconf and make at this compiler."""
        return {
            "CC": str(self.cc),
            "AR": str(self.bin / "ar"),
            "RANLIB": str(self.bin / "ranlib"),
            "PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            # zig's own cache: beside it, not in the invoking user's home.
            "ZIG_GLOBAL_CACHE_DIR": str(self.root / "zig-cache"),
        }


def pip_install(target: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """`pip install --target target --no-deps ARGS` with this interpreter's
    pip, quietly: what the packaging scripts fetch from PyPI."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    return subprocess.run([*command, "--target", str(target), *args], capture_output=True, text=True, timeout=timeout)


def _scripts(bin_dir: Path, zig: Path) -> None:
    bin_dir.mkdir()
    for name, command in (("cc", f"cc -target {TARGET}"), ("ar", "ar"), ("ranlib", "ranlib")):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec {zig} {command} "$@"\n')
        script.chmod(0o755)


def install() -> Zig:
    """The cached zig, installing it first if it is not there."""
    cache = cache_root()
    root = cache / f"zig-{ZIG_VERSION}"
    if (root / ".complete").is_file():
        return Zig(root)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock-zig", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a parallel build may be installing it
        if (root / ".complete").is_file():
            return Zig(root)
        staging = Path(tempfile.mkdtemp(prefix=".zig-", dir=cache))
        try:
            pip = pip_install(staging / "wheel", f"ziglang=={ZIG_VERSION}", timeout=600)
            if pip.returncode != 0:
                raise ZigError(f"installing ziglang=={ZIG_VERSION} from PyPI failed:\n{pip.stderr[-2000:]}")
            _scripts(staging / "bin", root / "wheel" / "ziglang" / "zig")
            (staging / ".complete").write_text(f"ziglang=={ZIG_VERSION}\n")
            if root.exists():
                shutil.rmtree(root)
            staging.rename(root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return Zig(root)
