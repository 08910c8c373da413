"""The package's import graph: no module imports itself back, directly or through others,
and neither does any package (graph, strategies, cluster, solve, planfile, execute, profile)
nor any top-level module. Imports under ``if TYPE_CHECKING:`` are left out: they never run."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autoplan"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
            found.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name.split(".")[0] == "autoplan"}


def _import_graph() -> nx.DiGraph:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for imported in _runtime_imports(ast.parse(path.read_text(), str(path))):
            # "from autoplan.x import y" names a module y or an attribute y of module x
            target = imported if imported in modules else imported.rpartition(".")[0]
            if target in modules and target != name:
                graph.add_edge(name, target)
    return graph


def _unit(module: str) -> str:
    """The package a module belongs to (autoplan.graph.ir -> autoplan.graph), or the module
    itself at the top level."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_modules_import_without_cycles() -> None:
    graph = _import_graph()
    # the root package re-exports the API: it may import anything, and nothing imports it
    assert not list(graph.predecessors("autoplan")), "a module imports autoplan itself"
    assert nx.is_directed_acyclic_graph(graph), nx.find_cycle(graph)


def test_packages_import_without_cycles() -> None:
    graph = _import_graph()
    packages = nx.DiGraph()
    for a, b in graph.edges:
        if "autoplan" not in (a, b) and _unit(a) != _unit(b):
            packages.add_edge(_unit(a), _unit(b))
    assert nx.is_directed_acyclic_graph(packages), nx.find_cycle(packages)


@pytest.mark.parametrize(
    ("source", "cycle"),
    [
        ("import autoplan.b\n", True),
        ("from autoplan import b\n", True),
        ("def f():\n    from autoplan.b import g\n", True),  # a lazy import still runs
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import autoplan.b\n", False),
    ],
)
def test_the_check_sees_cycles(tmp_path: Path, source: str, cycle: bool) -> None:
    tree_a, tree_b = ast.parse(source), ast.parse("import autoplan.a\n")
    graph = nx.DiGraph()
    for name, tree in (("autoplan.a", tree_a), ("autoplan.b", tree_b)):
        for imported in _runtime_imports(tree):
            graph.add_edge(name, imported.removesuffix(".g"))
    assert (not nx.is_directed_acyclic_graph(graph)) is cycle
