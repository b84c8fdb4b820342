"""No import circles inside the proxy and the upstream client (docs/architecture.md, "Modules").

tests/unit/test_layering.py checks the direction between parts; this checks the modules inside
two of them. The graph is read with `ast` from the files, imports under `TYPE_CHECKING`
included: a circle that only type checking closes still ties the two modules together (the
upstream connection used to name the pool's `Origin` that way).
"""

from __future__ import annotations

import pytest

from tests.unit.test_layering import PACKAGE, _cycle, _imports, _module_name


def _graph(package: str) -> dict[str, set[str]]:
    """Module -> the other modules of `package` it imports (`from package import name` counts
    as importing `package.name` when that is a module)."""
    files = sorted((PACKAGE.parent / package.replace(".", "/")).glob("*.py"))
    modules = {_module_name(path) for path in files}
    return {
        _module_name(path): (_imports(path) & modules) - {_module_name(path), package}
        for path in files
    }


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
