"""Pictures of a plan: the flow graph, layer ranges, utilization, and method comparisons.

Shared by ``notebooks/`` and available to ``helix show``. matplotlib is imported inside the
functions (``import planner`` stays light); each ``draw_*`` function draws on a given axes,
and :func:`plan_figure` puts the three plan views on one figure.

* :func:`draw_flow_graph` — the cluster graph as networkx draws it: the coordinator on the
  left (token ids out) and on the right (sampled tokens in), every node placed at the middle
  of the layer range it holds, an arrow per edge carrying flow (width ~ tok/s, labelled), and
  the min cut in red: bottleneck links as red arrows, bottleneck nodes with a red rim.
* :func:`draw_layer_ranges` — each node's ``[start, end)`` as a bar over the model's layers.
* :func:`draw_utilization` — flow through each node / its capacity for the layers it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx

from helix.plan import Plan, node_inflow
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner.graph import SINK, SOURCE, CapacityModel, build_graph

COORD_IN = "coordinator ▶"
COORD_OUT = "▶ coordinator"


@dataclass(slots=True)
class PlanView:
    """What the pictures need, computed once: flows through nodes, capacities, the min cut."""

    plan: Plan
    cap: CapacityModel
    gpu: dict[str, str]
    through: dict[str, float]
    capacity: dict[str, float]
    cut_nodes: set[str]
    cut_links: set[tuple[str, str]]  # (src, dst) with the coordinator as COORD_IN / COORD_OUT
    cut_nic: bool

    @property
    def utilization(self) -> dict[str, float]:
        return {n: (self.through.get(n, 0.0) / c if c > 0 else 0.0) for n, c in self.capacity.items()}


def plan_view(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet) -> PlanView:
    """Flows per node, capacities and the min cut of ``plan`` (which should carry its flows)."""
    cap = CapacityModel.build(cluster, profiles)
    coord = cluster.coordinator.id
    through = node_inflow(plan.flows, coord)
    capacity = {n: cap.node_capacity(n, e - s) for n, (s, e) in plan.placement.items()}
    cut_nodes: set[str] = set()
    cut_links: set[tuple[str, str]] = set()
    cut_nic = False
    g = build_graph(cap, dict(plan.placement), partial_handoffs=plan.partial_handoffs)
    if plan.max_flow_tok_s > 0:
        _, (reach, _) = nx.minimum_cut(g, SOURCE, SINK)
        for u in reach:
            for v in g[u]:
                if v in reach:
                    continue
                if u.endswith("/in") and v.endswith("/out"):
                    cut_nodes.add(u[:-3])
                elif "/" not in u and "/" not in v:
                    cut_nic = True
                else:
                    src = u.rsplit("/", 1)[0] if "/" in u else COORD_IN
                    dst = v.rsplit("/", 1)[0] if "/" in v else COORD_OUT
                    cut_links.add((src, dst))
    gpu = {n.id: n.gpu for n in cluster.nodes}
    return PlanView(plan, cap, gpu, through, capacity, cut_nodes, cut_links, cut_nic)


def _gpu_colors(gpus: set[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {g: cmap(i % 10) for i, g in enumerate(sorted(gpus))}


def flow_digraph(view: PlanView, coordinator: str) -> nx.DiGraph:
    """Nodes and flow-carrying edges, the coordinator split into COORD_IN and COORD_OUT."""
    g = nx.DiGraph()
    g.add_node(COORD_IN)
    g.add_node(COORD_OUT)
    for node in view.plan.placement:
        g.add_node(node)
    for e in view.plan.flows:
        if e.tok_s <= 1e-9:
            continue
        src = COORD_IN if e.src == coordinator else e.src
        dst = COORD_OUT if e.dst == coordinator else e.dst
        g.add_edge(src, dst, tok_s=e.tok_s)
    return g


def _positions(view: PlanView) -> dict[str, tuple[float, float]]:
    """x: the middle of a node's layer range; y: its rank by start layer, cycling over a few rows."""
    num_layers = view.cap.num_layers
    stages = view.plan.stages()
    rows = max(1, min(4, len(stages)))
    pos: dict[str, tuple[float, float]] = {}
    for rank, (node, s, e) in enumerate(stages):
        pos[node] = ((s + e) / 2, -float(rank % rows))
    mid = -(rows - 1) / 2
    pos[COORD_IN] = (-0.12 * num_layers, mid)
    pos[COORD_OUT] = (1.12 * num_layers, mid)
    return pos


def draw_flow_graph(ax: Any, view: PlanView, coordinator: str = "coordinator", *, labels: bool = True) -> None:
    """The flow graph on ``ax`` (see the module docstring)."""
    g = flow_digraph(view, coordinator)
    pos = _positions(view)
    colors = _gpu_colors(set(view.gpu[n] for n in view.plan.placement))
    nodes = list(view.plan.placement)
    coord_color = "#d62728" if view.cut_nic else "#444444"
    nx.draw_networkx_nodes(g, pos, nodelist=[COORD_IN, COORD_OUT], node_shape="s", node_color=coord_color,
                           node_size=500, ax=ax)  # fmt: skip
    nx.draw_networkx_nodes(
        g, pos, nodelist=nodes, node_color=[colors[view.gpu[n]] for n in nodes], node_size=320, ax=ax,
        edgecolors=["#d62728" if n in view.cut_nodes else "black" for n in nodes],
        linewidths=[3.0 if n in view.cut_nodes else 0.8 for n in nodes],
    )  # fmt: skip
    edges = list(g.edges(data="tok_s"))
    top = max((f for _, _, f in edges), default=1.0) or 1.0
    nx.draw_networkx_edges(
        g, pos, edgelist=[(u, v) for u, v, _ in edges], ax=ax, arrows=True, arrowsize=8, node_size=320,
        width=[0.4 + 3.6 * f / top for _, _, f in edges], alpha=0.8,
        edge_color=["#d62728" if (u, v) in view.cut_links else "#1f77b4" for u, v, _ in edges],
        connectionstyle="arc3,rad=0.08",
    )  # fmt: skip
    font = 7 if len(nodes) <= 12 else 5
    nx.draw_networkx_labels(g, {k: (x, y + 0.22) for k, (x, y) in pos.items()}, font_size=font, ax=ax)
    if labels and edges:
        nx.draw_networkx_edge_labels(g, pos, edge_labels={(u, v): f"{f:.0f}" for u, v, f in edges},
                                     font_size=max(4, font - 2), ax=ax, rotate=False, alpha=0.8)  # fmt: skip
    ax.set_title(f"flow graph: {view.plan.max_flow_tok_s:.1f} tok/s (edge labels tok/s; red = min cut)")
    ax.set_xlabel("layer (node at the middle of its range)")
    ax.tick_params(left=False, labelleft=False, bottom=True, labelbottom=True)
    ax.axis("on")
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)


def draw_layer_ranges(ax: Any, view: PlanView) -> None:
    """Each node's layer range as a bar over the model's layers (opacity = utilization)."""
    import matplotlib.patches as mpatches

    stages = view.plan.stages()
    colors = _gpu_colors(set(view.gpu[n] for n, _, _ in stages))
    util = view.utilization
    for row, (node, s, e) in enumerate(stages):
        edge = "#d62728" if node in view.cut_nodes else "black"
        ax.barh(row, e - s, left=s, color=colors[view.gpu[node]], alpha=0.35 + 0.65 * min(1.0, util[node]),
                edgecolor=edge, linewidth=2.0 if node in view.cut_nodes else 0.8)  # fmt: skip
        ax.text(e + 0.2, row, f"[{s}, {e})", va="center", fontsize=6)
    ax.set_yticks(range(len(stages)), [f"{n} ({view.gpu[n]})" for n, _, _ in stages], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlim(0, view.cap.num_layers * 1.12)
    ax.set_xlabel("layer")
    ax.set_title("layer ranges (opacity = utilization, red rim = bottleneck)")
    ax.legend(handles=[mpatches.Patch(color=c, label=g) for g, c in colors.items()], loc="lower right", fontsize=6)


def draw_utilization(ax: Any, view: PlanView) -> None:
    """Flow through each node over its capacity for the layers it holds."""
    stages = view.plan.stages()
    names = [n for n, _, _ in stages]
    util = view.utilization
    colors = ["#d62728" if n in view.cut_nodes else "#2ca02c" for n in names]
    ax.bar(range(len(names)), [100 * util[n] for n in names], color=colors)
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
    ax.set_ylim(0, 110)
    ax.axhline(100, color="grey", lw=0.6, ls="--")
    ax.set_ylabel("utilization %")
    ax.set_title("node utilization (flow / capacity; red = in the min cut)")


def plan_figure(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet) -> Any:
    """A figure with the flow graph, the layer ranges and the utilization of ``plan``."""
    import matplotlib.pyplot as plt

    view = plan_view(plan, cluster, profiles)
    n = len(plan.placement)
    fig = plt.figure(figsize=(13, 5 + 0.28 * n))
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 1.3], width_ratios=[1.6, 1])
    draw_flow_graph(fig.add_subplot(grid[0, 0]), view, cluster.coordinator.id)
    draw_layer_ranges(fig.add_subplot(grid[0, 1]), view)
    draw_utilization(fig.add_subplot(grid[1, :]), view)
    fig.suptitle(f"{plan.cluster} · {plan.model} · {plan.method}: max flow {plan.max_flow_tok_s:.1f} tok/s")
    fig.tight_layout()
    return fig


def save_plan_png(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet, out: str | Path, dpi: int = 120) -> Path:
    """Render :func:`plan_figure` to a PNG (Agg backend, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plan_figure(plan, cluster, profiles)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return Path(out)


def draw_bars(ax: Any, values: dict[str, float], *, ylabel: str, title: str, highlight: str | None = None) -> None:
    """One bar per method (or any label), the value printed on top."""
    names = list(values)
    colors = ["#d62728" if n == highlight else "#1f77b4" for n in names]
    bars = ax.bar(range(len(names)), [values[n] for n in names], color=colors)
    for bar, n in zip(bars, names, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{values[n]:.1f}", ha="center",
                va="bottom", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)


def draw_grouped_bars(ax: Any, table: dict[str, dict[str, float]], *, ylabel: str, title: str) -> None:
    """Groups (e.g. placements) of bars (e.g. routers): ``table[group][series] = value``."""
    groups = list(table)
    series = sorted({s for row in table.values() for s in row})
    width = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [table[g].get(s, 0.0) for g in groups], width=width, label=s)
    ax.set_xticks(range(len(groups)), groups, rotation=20, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
