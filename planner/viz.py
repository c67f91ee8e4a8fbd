"""Pictures of a plan: the flow graph, layer ranges, utilization, and method comparisons.

Shared by ``notebooks/`` and ``helix show``. matplotlib is imported inside the functions
(``import planner`` stays light); each ``draw_*`` function draws on a given axes, and
:func:`plan_figure` puts the plan views on one figure sized to the cluster. What is drawn (flows,
capacities, the min cut) is :func:`planner.plan_view.plan_view` and where it goes
:func:`planner.viz_layout.plan_layout` (both pure, tested); this module only draws.

* :func:`draw_flow_graph` — every region a grey box with its name; in it, every node at the
  middle of the layer range it holds (the pipeline reads left to right), coloured by GPU type
  (:func:`planner.viz_layout.gpu_color`: the same colour for a type in every picture); nodes
  that hold no layers hollow; the coordinator at both ends (token ids out on the left,
  sampled tokens in on the right). An arrow per edge carrying flow, its width ~ tok/s,
  labelled with tok/s when there are at most :data:`MAX_EDGE_LABELS` such edges. The min
  cut in red: bottleneck links as red arrows, bottleneck nodes with a red rim.
* :func:`draw_layer_ranges` — each node's ``[start, end)`` as a bar over the model's layers,
  one row per node, grouped by region (opacity = utilization).
* :func:`draw_utilization` — flow through each node / its capacity, in the same rows.
* :func:`draw_bars`, :func:`draw_grouped_bars` — method comparisons (notebooks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import networkx as nx

from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner.plan_view import PlanView, flow_digraph, flow_table, plan_view
from planner.viz_layout import (
    COORD_IN,
    COORD_OUT,
    EDGE_RAD,
    INCHES_PER_UNIT,
    LABEL_LIFT,
    PlanLayout,
    edge_label_boxes,
    gpu_color,
)

__all__ = ["MAX_EDGE_LABELS", "draw_bars", "draw_flow_graph", "draw_flow_table", "draw_grouped_bars",
           "draw_layer_ranges", "draw_utilization", "flow_graph_size", "legend_handles", "plan_figure",
           "save_plan_png"]  # fmt: skip

MAX_EDGE_LABELS = 16  # more flow-carrying edges than this: widths only, no numbers
CUT_RED = "#d62728"
FLOW_BLUE = "#4a7fb0"
NODE_SIZE = 230  # points²
ROW_INCHES = 0.18  # one node's row in the layer-range and utilization views


def legend_handles(view: PlanView) -> list[Any]:
    """The key: one entry per GPU type of the cluster, then the marks (hollow, coordinator, min cut)."""
    from matplotlib.lines import Line2D

    def dot(label: str, face: str, edge: str = "black", marker: str = "o", width: float = 0.8) -> Any:
        return Line2D([], [], ls="", marker=marker, markersize=8, markerfacecolor=face, markeredgecolor=edge,
                      markeredgewidth=width, label=label)  # fmt: skip

    handles = [dot(g, c) for g, c in view.layout.gpu_colors.items()]
    if view.layout.unused:
        handles.append(dot("holds no layers", "white", "#777777", width=1.5))
    handles.append(dot("coordinator", "#444444", marker="s"))
    handles.append(dot("bottleneck node", "white", CUT_RED, width=2.5))
    handles.append(Line2D([], [], color=CUT_RED, lw=2, label="bottleneck link"))
    return handles


def flow_graph_size(view: PlanView) -> tuple[float, float]:
    """Inches the flow graph needs (its layout at :data:`INCHES_PER_UNIT`, plus the title)."""
    x0, y0, x1, y1 = view.layout.extent
    return (x1 - x0) * INCHES_PER_UNIT, (y1 - y0) * INCHES_PER_UNIT + 0.7


def _draw_regions(ax: Any, layout: PlanLayout) -> None:
    from matplotlib.patches import FancyBboxPatch

    for box in layout.regions:
        ax.add_patch(FancyBboxPatch((box.x0, box.y0), box.x1 - box.x0, box.y1 - box.y0,
                                    boxstyle="round,pad=0,rounding_size=0.3", facecolor="#f2f2f2",
                                    edgecolor="#9a9a9a", lw=0.8, zorder=0))  # fmt: skip
        ax.text(box.x0 + 0.25, box.y1 - 0.15, box.name, ha="left", va="top", fontsize=8, fontweight="bold",
                color="#555555", zorder=1)  # fmt: skip


def draw_flow_graph(ax: Any, view: PlanView, coordinator: str = "coordinator", *, labels: bool = True,
                    legend: bool = True, headline: bool = False) -> None:  # fmt: skip
    """The flow graph on ``ax`` (see the module docstring); ``legend``: the key outside the axes, right;
    ``headline``: the plan's cluster, model, method and max flow on the title's first line."""
    lay = view.layout
    g = flow_digraph(view, coordinator)
    for node in lay.unused:
        g.add_node(node)
    pos = lay.positions
    _draw_regions(ax, lay)
    coord_color = CUT_RED if view.cut_nic else "#444444"
    nx.draw_networkx_nodes(g, pos, nodelist=[COORD_IN, COORD_OUT], node_shape="s", node_color=coord_color,
                           node_size=NODE_SIZE * 1.4, ax=ax)  # fmt: skip
    used = list(view.plan.placement)
    nx.draw_networkx_nodes(
        g, pos, nodelist=used, node_color=[gpu_color(view.gpu[n]) for n in used], node_size=NODE_SIZE, ax=ax,
        edgecolors=[CUT_RED if n in view.cut_nodes else "black" for n in used],
        linewidths=[2.5 if n in view.cut_nodes else 0.8 for n in used],
    )  # fmt: skip
    if lay.unused:
        nx.draw_networkx_nodes(g, pos, nodelist=lay.unused, node_color="white", node_size=NODE_SIZE, ax=ax,
                               edgecolors=[gpu_color(view.gpu[n]) for n in lay.unused], linewidths=1.5)  # fmt: skip
    edges = list(g.edges(data="tok_s"))
    top = max((f for _, _, f in edges), default=1.0) or 1.0
    style = f"arc3,rad={EDGE_RAD}"
    nx.draw_networkx_edges(
        g, pos, edgelist=[(u, v) for u, v, _ in edges], ax=ax, arrows=True, arrowsize=8, node_size=NODE_SIZE,
        width=[0.5 + 4.0 * f / top for _, _, f in edges], alpha=0.75,
        edge_color=[CUT_RED if (u, v) in view.cut_links else FLOW_BLUE for u, v, _ in edges],
        connectionstyle=style,
    )  # fmt: skip
    for name, (x, y) in pos.items():
        ax.text(x, y + LABEL_LIFT, name, ha="center", va="bottom", fontsize=6.5, zorder=5,
                bbox={"boxstyle": "round,pad=0.1", "fc": "#f2f2f2", "ec": "none", "alpha": 0.8})  # fmt: skip
    numbered = labels and 0 < len(edges) <= MAX_EDGE_LABELS
    if numbered:
        boxes = edge_label_boxes(lay, {(u, v): f"{f:.0f}" for u, v, f in edges})
        for u, v, f in edges:
            x0, y0, x1, y1 = boxes[(u, v)]
            ax.text((x0 + x1) / 2, (y0 + y1) / 2, f"{f:.0f}", ha="center", va="center", fontsize=6.5, zorder=6,
                    color=CUT_RED if (u, v) in view.cut_links else "black",
                    bbox={"boxstyle": "round,pad=0.12", "fc": "white", "ec": "none", "alpha": 0.9})  # fmt: skip
    how = "labels and widths: tok/s" if numbered else "width ~ tok/s"
    plan = view.plan
    title = f"flow graph: {len(edges)} edges carry flow ({how}; red = min cut)"
    if headline:
        title = f"{plan.cluster} · {plan.model} · {plan.method}: max flow {plan.max_flow_tok_s:.1f} tok/s\n{title}"
    else:
        title = f"max flow {plan.max_flow_tok_s:.1f} tok/s; {title}"
    ax.set_title(title, fontsize=9)
    x0, y0, x1, y1 = lay.extent
    ax.update_datalim([(x0, y0), (x1, y1)])  # labels included; equal aspect widens what is short
    ax.margins(0)
    ax.autoscale_view()
    ax.set_aspect("equal", adjustable="box")
    step = _layer_step(lay.num_layers)
    ticks = list(range(0, lay.num_layers + 1, step))
    ax.set_xticks([lay.layer_x(t) for t in ticks], [str(t) for t in ticks], fontsize=7)
    ax.set_xlabel("layer (a node sits at the middle of the range it holds)", fontsize=8)
    ax.tick_params(left=False, labelleft=False, bottom=True, labelbottom=True)
    ax.axis("on")
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.spines["bottom"].set_bounds(lay.layer_x(0), lay.layer_x(lay.num_layers))
    if legend:
        ax.legend(handles=legend_handles(view), loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                  fontsize=7, frameon=False)  # fmt: skip


def draw_flow_table(ax: Any, view: PlanView, coordinator: str = "coordinator") -> None:
    """:func:`flow_table` and the bottleneck as text on ``ax`` (no frame), beside a graph too busy for labels."""
    tables = flow_table(view, coordinator)
    width = max((len(what) for rows in tables.values() for what, _ in rows), default=10)
    lines: list[str] = []
    for title, rows in tables.items():
        if rows:
            lines += [f"{title} (tok/s)", *(f"{what:<{width}} {f:>7.0f}" for what, f in rows), ""]
    if view.plan.bottleneck:
        shown = view.plan.bottleneck[:8]
        more = len(view.plan.bottleneck) - len(shown)
        lines += ["bottleneck (min cut)", *shown, *([f"… and {more} more"] if more else [])]
    ax.text(0.0, 1.0, "\n".join(lines).rstrip(), transform=ax.transAxes, ha="left", va="top", fontsize=7,
            family="monospace", linespacing=1.35)  # fmt: skip
    ax.axis("off")


def _layer_step(num_layers: int) -> int:
    for step in (1, 2, 5, 10, 20, 50, 100):
        if num_layers / step <= 10:
            return step
    return 200


def _mark_regions(ax: Any, view: PlanView, rows: list[tuple[str, str]], *, names: bool) -> None:
    """Shade every other region's rows; with ``names``, the region's name right of the axes."""
    start = 0
    for i in range(1, len(rows) + 1):
        if i < len(rows) and rows[i][0] == rows[start][0]:
            continue
        k = sum(1 for _ in {r for r, _ in rows[:start]})
        if k % 2 == 1:
            ax.axhspan(start - 0.5, i - 0.5, color="#efefef", zorder=0, lw=0)
        if start > 0:
            ax.axhline(start - 0.5, color="#9a9a9a", lw=0.6)
        if names:
            ax.annotate(rows[start][0], xy=(1.0, start - 0.4), xycoords=("axes fraction", "data"), xytext=(4, 0),
                        textcoords="offset points", ha="left", va="top", fontsize=7, fontweight="bold",
                        color="#555555", annotation_clip=False)  # fmt: skip
        start = i


def _row_labels(view: PlanView, rows: list[tuple[str, str]]) -> list[str]:
    return [f"{n} ({view.gpu[n]})" for _, n in rows]


def draw_layer_ranges(ax: Any, view: PlanView, *, legend: bool = True, region_names: bool = True) -> None:
    """Each node's layer range as a bar (opacity = utilization), one row per node, grouped by region."""
    rows = view.rows()
    util = view.utilization
    num_layers = view.cap.num_layers
    for row, (_, node) in enumerate(rows):
        if node not in view.plan.placement:
            ax.text(0.5, row, "holds no layers", va="center", fontsize=6, color="#777777", style="italic")
            continue
        s, e = view.plan.placement[node]
        cut = node in view.cut_nodes
        ax.barh(row, e - s, left=s, height=0.75, color=gpu_color(view.gpu[node]),
                alpha=0.35 + 0.65 * min(1.0, util[node]), edgecolor=CUT_RED if cut else "black",
                linewidth=2.0 if cut else 0.6)  # fmt: skip
        ax.text(e + 0.01 * num_layers, row, f"[{s}, {e})", va="center", fontsize=6)
    _mark_regions(ax, view, rows, names=region_names)
    ax.set_yticks(range(len(rows)), _row_labels(view, rows), fontsize=6)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, num_layers * 1.14)
    step = _layer_step(num_layers)
    ax.set_xticks(range(0, num_layers + 1, step))
    ax.tick_params(axis="x", labelsize=7)
    ax.xaxis.grid(True, color="#dddddd", lw=0.5)
    ax.set_axisbelow(True)
    ax.set_xlabel("layer", fontsize=8)
    ax.set_title("layer ranges (opacity = utilization, red rim = bottleneck)", fontsize=9)
    if legend:
        ax.legend(handles=legend_handles(view), loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                  fontsize=7, frameon=False)  # fmt: skip


def draw_utilization(ax: Any, view: PlanView, *, names: bool = True, region_names: bool = True) -> None:
    """Flow through each node over its capacity, one row per node in :meth:`PlanView.rows` order."""
    rows = view.rows()
    util = view.utilization
    for row, (_, node) in enumerate(rows):
        if node not in view.plan.placement:
            continue
        pct = 100 * util[node]
        cut = node in view.cut_nodes
        ax.barh(row, pct, height=0.75, color=gpu_color(view.gpu[node]), edgecolor=CUT_RED if cut else "black",
                linewidth=2.0 if cut else 0.6)  # fmt: skip
        ax.text(pct + 2, row, f"{pct:.0f}%", va="center", fontsize=6)
    _mark_regions(ax, view, rows, names=region_names)
    ax.set_yticks(range(len(rows)), _row_labels(view, rows), fontsize=6)
    ax.tick_params(axis="y", labelleft=names)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, 125)
    ax.set_xticks([0, 50, 100])
    ax.tick_params(axis="x", labelsize=7)
    ax.axvline(100, color="grey", lw=0.6, ls="--")
    ax.set_xlabel("utilization % (flow / capacity)", fontsize=8)
    ax.set_title("utilization (red rim = min cut)", fontsize=9)


def plan_figure(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet) -> Any:
    """A figure with the flow graph (and, when too busy for edge labels, :func:`draw_flow_table`
    beside it) over the layer ranges and utilization of ``plan``, sized to the cluster."""
    import matplotlib.pyplot as plt

    view = plan_view(plan, cluster, profiles)
    coordinator = cluster.coordinator.id
    flow_w, flow_h = flow_graph_size(view)
    tabled = flow_digraph(view, coordinator).number_of_edges() > MAX_EDGE_LABELS
    table_w = 3.6 if tabled else 0.0
    rows_h = ROW_INCHES * len(view.rows()) + 1.0
    width = max(10.0, flow_w + table_w + 0.5)
    fig = plt.figure(figsize=(width, flow_h + rows_h + 1.3), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[flow_h, rows_h], width_ratios=[3, 1])
    if tabled:
        sub = grid[0, :].subgridspec(1, 2, width_ratios=[flow_w, table_w])
        draw_flow_graph(fig.add_subplot(sub[0, 0]), view, coordinator, legend=False, headline=True)
        draw_flow_table(fig.add_subplot(sub[0, 1]), view, coordinator)
    else:
        draw_flow_graph(fig.add_subplot(grid[0, :]), view, coordinator, legend=False, headline=True)
    ranges = fig.add_subplot(grid[1, 0])
    draw_layer_ranges(ranges, view, legend=False, region_names=False)
    draw_utilization(fig.add_subplot(grid[1, 1], sharey=ranges), view, names=False)
    handles = legend_handles(view)
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(handles), 9), fontsize=8, frameon=False)
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
