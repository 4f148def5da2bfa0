"""The tree passes ruff (lint and format) and mypy with the settings in
pyproject.toml ([tool.ruff], [tool.mypy]); a finding fails here with the
tool's own output."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What ruff checks and formats.
LINTED = ("cgpud", "bench", "packaging", "csrc", "tests", "setup.py")
TIMEOUT_S = 300


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(f"{tool} is not installed: it comes with the test extras (pip install -e '.[test]')")
    return subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def test_ruff_check() -> None:
    proc = _run("ruff", "check", "--output-format", "concise", *LINTED)
    assert proc.returncode == 0, f"ruff check found problems:\n{proc.stdout}{proc.stderr}"


def test_ruff_format() -> None:
    proc = _run("ruff", "format", "--check", "--diff", *LINTED)
    assert proc.returncode == 0, f"ruff format would change (run ruff format):\n{proc.stdout}{proc.stderr}"


def test_mypy() -> None:
    # Files, strictness and exclusions come from [tool.mypy].
    proc = _run("mypy")
    assert proc.returncode == 0, f"mypy found problems:\n{proc.stdout}{proc.stderr}"
