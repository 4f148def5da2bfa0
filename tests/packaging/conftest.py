"""The deb and rpm, built once per test session by packaging/build.py from
one staged tree: an "old" and a "new" deb (for upgrades) and the new rpm."""
from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OLD = "0.1.0+test1"
NEW = "0.1.0+test2"


@dataclass(frozen=True)
class Packages:
    old_deb: Path
    new_deb: Path
    new_rpm: Path
    work: Path


def build(*args: str) -> list[Path]:
    out = subprocess.run([sys.executable, str(REPO / "packaging" / "build.py"), *args],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    return [Path(line) for line in out.stdout.split()]


@pytest.fixture(scope="session")
def packages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Packages]:
    tmp = tmp_path_factory.mktemp("packages")
    out, work = tmp / "dist", tmp / "work"
    old_deb, new_deb = build("--version", OLD, "--version", NEW, "--formats", "deb", "--out", str(out),
                             "--work", str(work))
    [new_rpm] = build("--version", NEW, "--formats", "rpm", "--out", str(out), "--work", str(work), "--reuse")
    yield Packages(old_deb, new_deb, new_rpm, work)
    shutil.rmtree(tmp, ignore_errors=True)  # some 600 MB
