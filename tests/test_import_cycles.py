"""No import circle between our modules (issue 14): a module-level import graph over every
package, lazy imports inside functions included (imports for type checking only left out), must
be acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("helix", "planner", "profiler", "router", "node_agent", "simulator")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    modules = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                       for n in ast.walk(block)}  # fmt: skip
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                if target in modules and target != name and "." in target:
                    graph.add_edge(name, target)
    return graph


def test_no_module_imports_itself_through_others() -> None:
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join([*c, c[0]]) for c in cycles[:10])


def test_the_cycle_check_sees_a_circle() -> None:
    graph = import_graph()
    assert graph.has_edge("router.core", "router.policy")  # the scan reads real imports
    graph.add_edge("router.policy", "router.core")
    assert list(nx.simple_cycles(graph))
