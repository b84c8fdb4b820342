"""The import rules of docs/architecture.md ("Dependency direction"), checked on the source.

Dependencies point inward: the CLI builds config, the runtime wires parts, and parts never import
the CLI or the runtime; the routing state imports nothing of ours; the mock backend, the Pylon and
the benchmarks stand beside the replica, not on top of it. The graph is read with `ast` from the
files (every `import` and `from ... import`, including those under `TYPE_CHECKING`), so a test
fails the moment a new import breaks a rule, whether or not the code path runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "stargate"
# The composition roots: only they may import everything.
ROOTS = {"stargate.cli", "stargate.runtime", "stargate.__main__"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every absolute `stargate...` module this file imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "stargate":
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "stargate")
    return found


def _part(module: str) -> str:
    """The part a module belongs to: `stargate.proxy.app` -> `stargate.proxy`."""
    return ".".join(module.split(".")[:2])


def _graph(files: list[Path]) -> dict[str, set[str]]:
    """Part -> the other parts it imports (only parts that exist as files or packages)."""
    known = {_part(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in files:
        source = _part(_module_name(path))
        targets = {_part(m) for m in _imports(path)} & known
        graph.setdefault(source, set()).update(targets - {source, "stargate"})
    return graph


GRAPH = _graph(sorted(PACKAGE.rglob("*.py")))


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


def test_the_parts_import_each_other_without_cycles() -> None:
    assert _cycle(GRAPH) is None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("part", sorted(set(GRAPH) - ROOTS))
def test_no_part_imports_the_cli_or_the_runtime(part: str) -> None:
    assert GRAPH[part] & ROOTS == set()


def test_the_routing_state_imports_nothing_of_ours() -> None:
    assert GRAPH.get("stargate.routing", set()) == set()


def test_the_document_helpers_import_nothing_of_ours() -> None:
    assert GRAPH["stargate.documents"] == set()


@pytest.mark.parametrize("part", ["stargate.mock", "stargate.pylon", "stargate.demo"])
def test_the_processes_beside_the_replica_do_not_stand_on_it(part: str) -> None:
    assert GRAPH[part] & {"stargate.runtime", "stargate.control_plane", "stargate.proxy"} == set()


def test_the_benchmarks_do_not_import_the_replica_runtime_or_control_plane() -> None:
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        bad = {
            m for m in _imports(path) if _part(m) in {"stargate.runtime", "stargate.control_plane"}
        }
        assert bad == set(), path.name


def test_pure_decision_modules_do_no_io() -> None:
    """The pure cores import no event loop, socket or HTTP library (docs/architecture.md)."""
    pure = [
        "warmup.py",
        "proxy/retry.py",
        "proxy/contract.py",
        "activator/state.py",
        "activator/lease.py",
        "load_balancing/balancers.py",
        "control_plane/admission.py",
        "hypercorn_patches/table.py",
        "mock/scheduler.py",
        "pylon/stats/sse.py",
        "pylon/stats/tokens.py",
        "pylon/stats/engine_stream.py",
        "pylon/stats/kv_cache.py",
        "pylon/stats/engine_metrics.py",
        "pylon/stats/observer.py",
        "pylon/stats/throughput.py",
        "pylon/stats/live.py",
        "pylon/stats/aggregator.py",
        "pylon/stats/admission.py",
        "pylon/stats/problems.py",
        "routing/state.py",
    ]
    io_modules = {"trio", "socket", "httpx", "h11", "h2", "hypercorn", "quart", "grpc", "asyncio"}
    for name in pure:
        tree = ast.parse((PACKAGE / name).read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
        }
        assert imported & io_modules == set(), name
