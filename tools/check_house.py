"""The package's house rules that a linter does not check, as issue 32 states them: no import
cycle among its modules (imports under TYPE_CHECKING and inside functions included), at most
one module over 500 lines, and no two modules or classes of one name.

    python tools/check_house.py      # exit status 1, and what breaks them, if any does
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autoplan"
MAX_LINES, MAX_LONG = 500, 1


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(graph: nx.DiGraph, name: str, tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autoplan"):
            targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("autoplan")]
        else:
            continue
        for target in targets:
            if target in graph and target != name:
                graph.add_edge(name, target)


def problems() -> list[str]:
    files = sorted(PACKAGE.rglob("*.py"))
    graph = nx.DiGraph()
    graph.add_nodes_from(_module(f) for f in files)
    for f in files:
        _imports(graph, _module(f), ast.parse(f.read_text()))
    # a package's __init__ importing its own modules is how a package exports: not a cycle
    for f in files:
        if f.name == "__init__.py":
            package = _module(f)
            graph.remove_edges_from([(package, m) for m in list(graph.successors(package))])
    found = [f"import cycle: {' -> '.join([*c, c[0]])}" for c in nx.simple_cycles(graph)]
    long = sorted(
        (n, f.relative_to(ROOT))
        for f in files
        if (n := len(f.read_text().splitlines())) > MAX_LINES
    )
    if len(long) > MAX_LONG:
        found.append(f"{len(long)} modules over {MAX_LINES} lines: {long}")
    names = Counter(f.name for f in files if f.name not in ("__init__.py", "__main__.py"))
    found += [f"two modules named {n}" for n, count in names.items() if count > 1]
    classes = Counter(
        node.name
        for f in files
        for node in ast.parse(f.read_text()).body
        if isinstance(node, ast.ClassDef)
    )
    found += [f"two classes named {n}" for n, count in classes.items() if count > 1]
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    print(f"{len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
