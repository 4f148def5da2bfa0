"""A newer build of cgpu for upgrade tests, without pip: the tracked tree
(with uncommitted edits, as tests/integration/test_install.py copies it) in
a directory of its own, its version bumped, its C parts and cffi modules
built in place, and run with this venv's Python and PYTHONPATH at the copy.
About 8 s on the CI machines."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Build:
    root: Path
    version: str

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with this build's cgpud first on the import path (the venv's
        own install is an editable one of the work tree)."""
        return dict(base, PYTHONPATH=f"{self.root}:{base['PYTHONPATH']}" if base.get("PYTHONPATH") else str(self.root))

    def native(self, rel: str) -> Path:
        return self.root / "cgpud" / "_native" / rel


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def newer_build(dest: Path) -> Build:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    for rel in filter(None, listed.stdout.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    pyproject = dest / "pyproject.toml"
    old = tomllib.loads(pyproject.read_text())["project"]["version"]
    major, minor, patch = (int(x) for x in old.split(".")[:3])
    version = f"{major}.{minor}.{patch + 1}"
    text = pyproject.read_text()
    assert f'version = "{old}"' in text
    pyproject.write_text(text.replace(f'version = "{old}"', f'version = "{version}"', 1))
    _run([sys.executable, "csrc/build_native.py", "cgpud/_native"], dest)
    _run([sys.executable, "setup.py", "build_ext", "--inplace"], dest)
    # The gRPC modules are generated, never committed; the proto files are
    # the same, so the work tree's generated ones are this build's too.
    for gen in (ROOT / "cgpud").rglob("*_pb2*.py"):
        target = dest / gen.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(gen, target)
    # cgpud.__version__ is the installed distribution's version: the
    # metadata an install would write, first on PYTHONPATH.
    info = dest / f"cgpud-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: cgpud\nVersion: {version}\n")
    return Build(dest, version)
