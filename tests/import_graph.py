"""The package's import graph read from the source (AST), imports inside functions included.

Used by tests/test_layers.py (dependencies point one way) and runnable on its own to print the
graph: `python tests/import_graph.py` lists every module with the package modules it imports,
then the import cycles (strongly connected components), so a change can be compared before/after.

An import under `if TYPE_CHECKING:` never runs; it is kept as an edge marked type-only, which the
cycle search ignores (it cannot make an import cycle) but the layer check does not (a type is
still a dependency).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folder -> import name, as pyproject's package-dir maps them.
PACKAGES = {
    "audit": "splitaudit",
    "attacks": "splitaudit.attacks",
    "estimators": "splitaudit.estimators",
    "reports": "splitaudit.reports",
    "sample_models": "splitaudit.sample_models",
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    type_only: bool


def package_modules() -> dict[str, Path]:
    """Import name -> source file for every module of the package."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            modules[".".join((package, *parts)).removesuffix(".__init__")] = path
    return modules


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imported_names(node: ast.AST, known: set[str]) -> list[str]:
    """The package modules an Import/ImportFrom node uses: `from pkg import sub` naming a
    submodule is an import of that submodule (the package's own __init__ runs for every import of
    one of its modules, so it is not counted as a dependency); `from mod import name` of mod."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
        return []
    names = {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names}
    return sorted(names & known)


def module_edges(name: str, path: Path, known: set[str]) -> list[Edge]:
    """Every import of a package module in one file, wherever it stands in the file."""
    edges: list[Edge] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        for target in _imported_names(node, known):
            if target != name:
                edges.append(Edge(name, target, node.lineno, type_only))
        if _is_type_checking_block(node):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return edges


def import_graph() -> list[Edge]:
    modules = package_modules()
    known = set(modules)
    return [edge for name, path in modules.items() for edge in module_edges(name, path, known)]


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module over run-time edges (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.target, set())
        if not edge.type_only:
            graph.setdefault(edge.source, set()).add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def main() -> None:
    edges = import_graph()
    modules = package_modules()
    targets: dict[str, set[str]] = {name: set() for name in modules}
    for edge in edges:
        targets[edge.source].add(edge.target + (" (type-only)" if edge.type_only else ""))
    unique = {(e.source, e.target) for e in edges}
    print(f"{len(modules)} modules, {len(unique)} imports between them")
    for name in sorted(modules):
        print(f"{name}: {', '.join(sorted(targets[name])) or '-'}")
    found = cycles(edges)
    print(f"{len(found)} import cycles")
    for component in found:
        print("  cycle: " + " <-> ".join(component))


if __name__ == "__main__":
    main()
