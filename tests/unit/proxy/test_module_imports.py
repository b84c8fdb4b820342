"""No import circles inside the proxy and the upstream client (docs/architecture.md, "Modules").

tests/unit/test_layering.py checks the direction between parts; this checks the modules inside
two of them. The graph is read with `ast` from the files, imports under `TYPE_CHECKING`
included: a circle that only type checking closes still ties the two modules together (the
upstream connection used to name the pool's `Origin` that way).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(package: str) -> dict[str, set[str]]:
    """Module -> the other modules of `package` it imports (`from package import name` counts
    as importing `package.name` when that is a module)."""
    files = sorted((ROOT / package.replace(".", "/")).glob("*.py"))
    modules = {_module(path) for path in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        source = _module(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[source] = (found & modules) - {source, package}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("package", ["stargate.upstream", "stargate.proxy"])
def test_no_module_imports_another_in_a_circle(package: str) -> None:
    graph = _graph(package)
    assert len(graph) > 3  # the files were found
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_checker_sees_a_circle_closed_under_type_checking() -> None:
    """The check itself: the old circle (the connection naming the pool's `Origin` under
    `TYPE_CHECKING`, the pool importing the connection) is one."""
    graph = _graph("stargate.upstream")
    graph["stargate.upstream.connection"].add("stargate.upstream.connection_pool")
    assert _cycle(graph) is not None
    assert "stargate.upstream.connection" in graph["stargate.upstream.connection_pool"]
