"""docs/architecture.md names every module: a new file that is not on the map
fails here, so the map cannot fall behind the tree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")


def _map_text() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("## What exists")
    return text[start : text.index("## ", start + 3)]


def _modules() -> list[Path]:
    python = [
        p
        for p in (ROOT / "cgpud").rglob("*.py")
        if p.name != "__init__.py" and not GENERATED.search(p.name) and "_native" not in p.parts
    ]
    native = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".c", ".h", ".def", ".py")]
    protos = [*(ROOT / "proto").rglob("*.proto"), *(ROOT / "third_party" / "proto").rglob("*.proto")]
    return sorted(python + native + protos)


def test_every_module_is_on_the_map() -> None:
    text = _map_text()
    missing = [str(p.relative_to(ROOT)) for p in _modules() if not re.search(rf"\b{re.escape(p.name)}\b", text)]
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def test_the_map_names_no_module_that_is_gone() -> None:
    text = _map_text()
    files = {p.name for p in ROOT.rglob("*") if ".git" not in p.parts}
    named = set(re.findall(r"\b([\w-]+\.(?:py|c|h|def|proto))\b", text))
    assert named - files == set()
