"""The tests' own layout: what is shared lives in tests/harness/ and reaches
test modules by import or as a fixture from a conftest.py. A test module
imported by another runs its module-scoped fixtures and builds once per
importer and couples two suites by accident, so no module imports one."""

from __future__ import annotations

import ast
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
