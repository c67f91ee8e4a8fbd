"""DESIGN.md's one-way dependency table, enforced.

1. ``import helix, planner, router`` in a fresh interpreter must not import torch or zmq.
2. A static scan of every package's imports (AST, including lazy imports inside functions)
   against the table. Packages that do not exist yet are skipped, not failed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"helix", "planner", "profiler", "router", "node_agent", "simulator", "notebooks", "bench", "tests"}

# package -> (packages of ours it must never import, third-party names it must never import).
# The "never imports" column of DESIGN.md is enforced as written; helix may import nothing of ours.
TABLE: dict[str, tuple[set[str], set[str]]] = {
    "helix": (OURS - {"helix"}, {"torch", "zmq", "networkx", "pulp", "highspy", "vllm"}),
    "planner": ({"router", "node_agent", "profiler", "simulator"}, {"torch", "zmq", "vllm"}),
    "profiler": ({"planner", "router", "simulator"}, set()),
    "router": ({"node_agent", "profiler", "simulator"}, {"torch", "vllm"}),
    "node_agent": ({"planner", "router", "simulator", "profiler"}, set()),
    "simulator": ({"node_agent", "profiler"}, {"torch", "zmq", "vllm"}),
}
# The few modules of a "never" package that a package may import all the same, by full name (DESIGN.md): the
# simulator's nodes run node_agent's pure scheduling modules (no torch, no sockets), and nothing else of it.
ALLOWED_MODULES: dict[str, set[str]] = {"simulator": {"node_agent.scheduler", "node_agent.kv_account"}}
# The few modules of a package that may import a library the table forbids it, by path: helix/zmq_io.py is the
# ZeroMQ I/O loop and CURVE sockets that the node agent and the coordinator's transport both run; node_agent may
# import only helix and router may not import node_agent, so their shared zmq code can live nowhere else. Nothing
# else in helix imports it, so ``import helix`` still loads no zmq (test_light_packages_do_not_import_torch_or_zmq).
THIRD_PARTY_OK: dict[Path, set[str]] = {ROOT / "helix" / "zmq_io.py": {"zmq"}}
# helix/cli.py may import the other packages lazily (it dispatches commands to them); the
# CLI wrappers ``<package>/commands.py`` may import other packages' entry points lazily
# (e.g. ``helix demo`` plans the demo cluster before it serves it).
LAZY_OK = {ROOT / "helix" / "cli.py"}
SINGLE_IMPORTER = {"pulp": ("planner",), "vllm": ("node_agent",), "llguidance": ("router", "node_agent")}
"""Libraries imported by at most one module of each package named (and by no other package)."""


def _imports(path: Path) -> list[tuple[str, bool, str]]:
    """Top-level module names imported by a file, with whether the import is at module level and the
    module's full name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(n) for n in tree.body}
    found: list[tuple[str, bool, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name.split(".")[0], id(node) in top_level, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module.split(".")[0], id(node) in top_level, node.module))
    return found


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(TABLE))
def test_package_imports_follow_the_table(package: str) -> None:
    assert (ROOT / package).is_dir(), f"{package}/ is in the table but not in the checkout"
    never_ours, forbidden = TABLE[package]
    allowed = ALLOWED_MODULES.get(package, set())
    problems: list[str] = []
    for path in _files(package):
        for name, _, module in _imports(path):
            if name in never_ours | {"bench", "tests", "notebooks"} and path not in LAZY_OK and module not in allowed:
                problems.append(f"{path.relative_to(ROOT)} imports {name}")
            if name in forbidden and name not in THIRD_PARTY_OK.get(path, set()):
                problems.append(f"{path.relative_to(ROOT)} imports {name} (never allowed in {package})")
    assert not problems, "\n".join(problems)


def test_router_uses_only_planner_graph() -> None:
    """The router's modules use planner's flow graph only (``planner.graph`` and the capacities it is built
    from, ``planner.capacity``); its CLI wrapper may plan lazily, and live membership's driver may re-plan
    lazily (``planner.replan``, in ``router/replan_call.py``, which its worker process runs when nodes join,
    leave or die)."""
    assert (ROOT / "router").is_dir()
    bad = []
    for path in _files("router"):
        tree = ast.parse(path.read_text())
        lazy_ok = path.name == "commands.py"
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.split(".")[0] != "planner" or name in ("planner", "planner.graph", "planner.capacity"):
                    continue
                if lazy_ok and id(node) not in top_level:
                    continue
                if path.name == "replan_call.py" and name == "planner.replan" and id(node) not in top_level:
                    continue
                bad.append(f"{path.relative_to(ROOT)}: imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("library", sorted(SINGLE_IMPORTER))
def test_single_importer(library: str) -> None:
    packages = SINGLE_IMPORTER[library]
    importers = set()
    for pkg in TABLE:
        if not (ROOT / pkg).is_dir():
            continue
        for path in _files(pkg):
            if any(name == library for name, _, _ in _imports(path)):
                importers.add(path.relative_to(ROOT))
    for package in packages:
        inside = sorted(str(p) for p in importers if p.parts[0] == package)
        assert len(inside) <= 1, f"{library} is imported by {inside}"
    assert all(p.parts[0] in packages for p in importers), f"{library} is imported by {sorted(map(str, importers))}"


def test_light_packages_do_not_import_torch_or_zmq() -> None:
    present = [p for p in ("helix", "planner", "router") if (ROOT / p).is_dir()]
    code = (
        "import sys\n"
        + "".join(f"import {p}\n" for p in present)
        + "import helix.spec, helix.profile, helix.plan, helix.cli, helix.handshake\n"
        + "import planner.graph, planner.api, planner.baselines\n"
        + "import simulator.engine\n"  # its nodes import node_agent's scheduler and KV account: light too
        + "heavy = sorted(m for m in ('torch', 'zmq', 'vllm') if m in sys.modules)\n"
        + "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"imported: {proc.stdout.strip()}"
