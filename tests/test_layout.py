"""The package's layout: no module imports itself back, directly or through others, and
neither does any package (graph, strategies, costmodel, search, solvers, planfile, execute,
...) nor any top-level module, imports under ``if TYPE_CHECKING:`` included (a cycle hidden
there is still a cycle to a reader); at most one module over 500 lines; no two modules and no
two classes of one name."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autoplan"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
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
        for imported in _imports(ast.parse(path.read_text(), str(path))):
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
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import autoplan.b\n", True),
        ("import autoplan.c\n", False),
    ],
)
def test_the_check_sees_cycles(tmp_path: Path, source: str, cycle: bool) -> None:
    tree_a, tree_b = ast.parse(source), ast.parse("import autoplan.a\n")
    graph = nx.DiGraph()
    for name, tree in (("autoplan.a", tree_a), ("autoplan.b", tree_b)):
        for imported in _imports(tree):
            graph.add_edge(name, imported.removesuffix(".g"))
    assert (not nx.is_directed_acyclic_graph(graph)) is cycle


def test_at_most_one_module_is_long() -> None:
    sizes = {p.relative_to(PACKAGE): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    long = sorted(str(p) for p, n in sizes.items() if n > 500)
    assert len(long) <= 1, long


def test_no_two_modules_or_classes_share_a_name() -> None:
    files = list(PACKAGE.rglob("*.py"))
    modules = Counter(p.name for p in files if p.name not in ("__init__.py", "__main__.py"))
    classes = Counter(
        node.name
        for p in files
        for node in ast.parse(p.read_text()).body
        if isinstance(node, ast.ClassDef)
    )
    assert [n for n, k in modules.items() if k > 1] == []
    assert [n for n, k in classes.items() if k > 1] == []
