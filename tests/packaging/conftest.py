"""The deb and rpm, built once per test run by packaging/build.py from
one staged tree: an "old" and a "new" deb (for upgrades) and the new rpm."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.builds import built

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
    out = subprocess.run(
        [sys.executable, str(REPO / "packaging" / "build.py"), *args], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr
    return [Path(line) for line in out.stdout.split()]


def _build_all(tmp: Path) -> None:
    out, work = tmp / "dist", tmp / "work"
    build("--version", OLD, "--version", NEW, "--formats", "deb", "--out", str(out), "--work", str(work))
    build("--version", NEW, "--formats", "rpm", "--out", str(out), "--work", str(work), "--reuse")


@pytest.fixture(scope="session")
def packages(tmp_path_factory: pytest.TempPathFactory) -> Packages:
    """Built once per run (tests/harness/builds.py): the host-global install
    tests run in ./dev test's second pass and take the first pass's."""
    tmp = built(tmp_path_factory, "packages", _build_all)
    dist = tmp / "dist"
    [old_deb] = dist.glob(f"*{OLD}*.deb")
    [new_deb] = dist.glob(f"*{NEW}*.deb")
    [new_rpm] = dist.glob("*.rpm")
    return Packages(old_deb, new_deb, new_rpm, tmp / "work")
