"""node_agent depends only on helix (+ its engine libraries): never on planner, router, simulator."""

from __future__ import annotations

import ast
from pathlib import Path

import node_agent

FORBIDDEN = {"planner", "router", "simulator", "profiler"}


def test_node_agent_never_imports_planner_router_simulator() -> None:
    for path in Path(node_agent.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
