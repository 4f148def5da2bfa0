"""cgpud's packages form layers (docs/architecture.md, "Layers"): each
imports only its own layer and those below, and the package graph has no
cycle. Every import counts: function-level ones and those under
TYPE_CHECKING too, since a cycle hidden in a function is still a cycle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A unit is a subpackage of cgpud or a top-level module.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset(
        {
            "cgpud",
            "errors",
            "units",
            "contract",
            "native",
            "atomicfile",
            "boundedhttp",
            "boundedread",
            "logs",
            "signals",
            "sockets",
        }
    ),  # the shared vocabulary and plumbing
    frozenset({"node"}),  # the node core
    frozenset({"containers", "api", "kube"}),  # the node's faces
    frozenset({"extender"}),
    frozenset({"config"}),  # cgpud.toml: read by cgpud and cgpuctl
    frozenset({"cli"}),
    frozenset({"daemon"}),  # the composition root: nothing imports it
)


def _layer(unit: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"cgpud.{unit} is in no layer: add it to LAYERS and to docs/architecture.md")


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "cgpud":
        return None
    if len(parts) == 1 or not any((ROOT / "cgpud" / parts[1]).with_suffix(s).exists() for s in ("", ".py")):
        return "cgpud"  # cgpud itself, or a name from its __init__ (__version__)
    return parts[1]


def _imports(source: str, package: str) -> Iterator[str]:
    """Every module `source` (a module of `package`) imports, wherever the
    import statement stands."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)  # `from cgpud import config` imports cgpud.config


def _edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted((ROOT / "cgpud").rglob("*.py")):
        if "_native" in path.parts or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        source = _unit(".".join(path.relative_to(ROOT).with_suffix("").parts))
        assert source is not None
        package = ".".join(path.relative_to(ROOT).parts[:-1])
        for module in _imports(path.read_text(), package):
            target = _unit(module)
            if target is None or target == source:
                continue
            edges.setdefault((source, target), []).append(str(path.relative_to(ROOT)))
    return edges


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if v not in state and (found := visit(v)) is not None:
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)) is not None:
            return found
    return None


def test_every_import_goes_down_or_sideways() -> None:
    upward = [
        f"cgpud.{s} imports cgpud.{t} ({', '.join(sorted(set(where)))})"
        for (s, t), where in _edges().items()
        if _layer(t) > _layer(s)
    ]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_nothing_imports_the_composition_root() -> None:
    assert [s for (s, t) in _edges() if t == "daemon"] == []


def test_the_package_graph_has_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for s, t in _edges():
        graph.setdefault(s, set()).add(t)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_the_walk_sees_function_level_and_relative_imports() -> None:
    source = "def f():\n    from cgpud.daemon import main\n    import cgpud.kube.agent\n    from ..node import model\n"
    assert {"cgpud.daemon.main", "cgpud.kube.agent", "cgpud.node.model"} <= set(_imports(source, "cgpud.api"))


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
