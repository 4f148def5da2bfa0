"""The tests' own layout: what is shared lives in tests/harness/ and reaches
test modules by import or as a fixture from a conftest.py. A test module
imported by another runs its module-scoped fixtures and builds once per
importer and couples two suites by accident, so no module imports one."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from tests.unit import test_x` imports the test module too
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
            found.append((node.lineno, node.module))
    return found


def test_no_module_imports_a_test_module() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for top in ("tests", "bench")
        for path in sorted((ROOT / top).rglob("*.py"))
        for line, name in _imported_modules(path)
        if name.startswith("tests.") and any(part.startswith("test_") for part in name.split("."))
    ]
    assert not offenders, "import from tests/harness/ (fixtures: a conftest.py) instead:\n" + "\n".join(offenders)


def test_the_harness_imports_no_conftest() -> None:
    """conftest.py files expose the harness; the harness never reaches back."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted((ROOT / "tests/harness").glob("*.py"))
        for line, name in _imported_modules(path)
        if "conftest" in name.split(".")
    ]
    assert not offenders, "\n".join(offenders)


def _pytest_on(tmp_path: Path, modules: dict[str, int], call: str, *args: str) -> str:
    """pytest run in tmp_path on modules of that many trivial tests, with
    a conftest that groups them as tests/conftest.py does (`call`)."""
    (tmp_path / "conftest.py").write_text(
        "import pytest\nfrom tests.harness.xdist_groups import group_by_module\n\n"
        "@pytest.hookimpl(tryfirst=True)\ndef pytest_collection_modifyitems(config, items):\n"
        f"    {call}\n"
    )
    for name, count in modules.items():
        (tmp_path / name).write_text("".join(f"def test_{i}():\n    pass\n" for i in range(count)))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "."],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_a_module_runs_on_one_xdist_worker(tmp_path: Path) -> None:
    """./dev test's parallel pass keeps each module on one worker through
    the xdist_group marks of tests/harness/xdist_groups.py; a pytest or
    xdist release that stops honouring them (pytest-xdist#1386, pytest 9.2)
    would spread modules over workers silently."""
    out = _pytest_on(
        tmp_path, {"test_a.py": 6, "test_b.py": 6}, "group_by_module(items)", "-n", "2", "--dist", "loadgroup", "-v"
    )
    ran = re.findall(r"\[(gw\d+)\].*PASSED (test_[ab])\.py::test_\d+", out)
    assert len(ran) == 12, out
    assert all(len({w for w, m in ran if m == module}) == 1 for module in ("test_a", "test_b")), out


def test_the_long_groups_start_first_then_the_largest(tmp_path: Path) -> None:
    """The order ./dev test's parallel pass hands groups out in
    (--no-loadscope-reorder keeps it): LONG_FIRST's, then by size."""
    modules = {"test_a.py": 1, "test_b.py": 3, "test_c.py": 2}
    out = _pytest_on(tmp_path, modules, "group_by_module(items, long_first=('test_c.py',))", "--collect-only", "-q")
    collected = [line.split("::")[0] for line in out.splitlines() if "::" in line]
    assert collected == ["test_c.py"] * 2 + ["test_b.py"] * 3 + ["test_a.py"], out
