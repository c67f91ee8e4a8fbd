"""Draw docs/architecture.svg: the packages with the imports between them (read from the source),
and one request's route through the modules.

    .venv/bin/python docs/architecture_figure.py [OUT.svg]

The package arrows are found by scanning every module's imports (so the picture cannot drift from
the code); the route is :data:`ROUTE`, the modules a request passes through in order.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("helix", "planner", "profiler", "router", "node_agent", "simulator")
# where each package's box sits (x, y), helix (the shared vocabulary) at the bottom
POSITIONS = {"router": (1.0, 3.0), "simulator": (3.0, 3.0), "profiler": (5.0, 3.0),
             "planner": (2.0, 1.8), "node_agent": (4.0, 1.8), "helix": (3.0, 0.6)}  # fmt: skip
# imports allowed only for the named modules (tests/test_dependencies.py ALLOWED_MODULES): drawn dashed
NARROW = {("simulator", "node_agent"): "scheduler,\nkv_account only"}
ROUTE = (
    ("client", "HTTP (openai client)"),
    ("router/app.py", "validate, tokenize"),
    ("router/coordinator.py", "asyncio bridge"),
    ("router/driver.py", "lock, step the core"),
    ("router/core.py", "admit, route, ADMIT"),
    ("router/agents_io.py", "ZeroMQ out"),
    ("node_agent/agent.py", "first stage: I/O loop"),
    ("node_agent/engine.py", "schedule, run layers"),
    ("node_agent/agent.py", "next stages ... last: TOKENS"),
    ("router/agents_io.py", "sink in"),
    ("router/core.py", "stop? else STEP"),
    ("router/coordinator.py", "text to the stream"),
    ("router/app.py", "SSE chunk"),
)


def package_imports(root: Path = ROOT) -> set[tuple[str, str]]:
    """(importer, imported) package pairs found in the source, lazy imports included."""
    edges: set[tuple[str, str]] = set()
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top in PACKAGES and top != package and not (package == "helix" and path.name == "cli.py"):
                        edges.add((package, top))
    return edges


def draw(out: Path) -> set[tuple[str, str]]:
    """Write the figure to ``out``; returns the package arrows drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "helix"  # ids stable from run to run
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 6.5), gridspec_kw={"width_ratios": [1, 1.1]})
    edges = package_imports()
    left.set_title("packages: an arrow is an import (helix/cli.py's lazy dispatch left out)", fontsize=10)
    for a, b in sorted(edges):
        (x0, y0), (x1, y1) = POSITIONS[a], POSITIONS[b]
        few = NARROW.get((a, b))  # only the modules named may be imported: dashed, labelled
        style = {"arrowstyle": "->", "color": "#555", "lw": 1.2, "shrinkA": 4, "shrinkB": 4,
                 "linestyle": "--" if few else "-"}  # fmt: skip
        if y0 == y1:  # side by side: from one box's side to the other's
            side = 0.5 if x1 > x0 else -0.5
            start, end = (x0 + side, y0), (x1 - side, y1)
        else:
            start, end = (x0, y0 - 0.18), (x1, y1 + 0.18)
        left.annotate("", xy=end, xytext=start, arrowprops=style)
        if few:
            left.text((start[0] + end[0]) / 2 + 0.1, (start[1] + end[1]) / 2, few, fontsize=8, color="#555")
    for name, (x, y) in POSITIONS.items():
        left.text(x, y, name, ha="center", va="center", fontsize=11,
                  bbox={"boxstyle": "round,pad=0.5", "fc": "#dde8f5" if name != "helix" else "#f5ecd6", "ec": "#333"})
    left.set_xlim(0, 6)
    left.set_ylim(0, 3.6)
    left.axis("off")

    right.set_title("one request's route (tokens loop: core -> STEP -> agents -> TOKENS -> core)", fontsize=10)
    n = len(ROUTE)
    for i, (module, what) in enumerate(ROUTE):
        y = n - i
        colour = "#dde8f5" if module.startswith("router") else "#e3f1df" if module.startswith("node") else "#eee"
        right.text(0.05, y, f"{i + 1:2d}", ha="left", va="center", fontsize=9, color="#777")
        right.text(0.15, y, module, ha="left", va="center", fontsize=10, family="monospace",
                   bbox={"boxstyle": "round,pad=0.3", "fc": colour, "ec": "#999"})
        right.text(0.62, y, what, ha="left", va="center", fontsize=9)
        if i < n - 1:
            right.annotate("", xy=(0.1, y - 0.7), xytext=(0.1, y - 0.3), arrowprops={"arrowstyle": "->", "color": "#888"})
    right.set_xlim(0, 1.2)
    right.set_ylim(0.3, n + 0.7)
    right.axis("off")
    fig.tight_layout()
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)
    return edges


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "architecture.svg"
    drawn = draw(target)
    print(f"wrote {target} ({len(drawn)} package imports)")
