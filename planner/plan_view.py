"""What the pictures of a plan show, computed once; :mod:`planner.viz` draws it.

A :class:`PlanView` holds the flow through each node and its capacity, the min cut of the flow
graph (bottleneck nodes, bottleneck links, the coordinator's NIC) and where everything goes
(:func:`planner.viz_layout.plan_layout`). :func:`flow_digraph` is the flow-carrying edges with
the coordinator split into its two ends; :func:`flow_table` the short tables that stand in for
edge labels when a graph is too busy for them. No matplotlib here.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from helix.plan import Plan, node_inflow
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner.capacity import CapacityModel
from planner.graph import SINK, SOURCE, flow_graph
from planner.viz_layout import COORD_IN, COORD_OUT, PlanLayout, plan_layout


@dataclass(slots=True)
class PlanView:
    """What the pictures need, computed once: flows through nodes, capacities, the min cut, the layout."""

    plan: Plan
    cap: CapacityModel
    gpu: dict[str, str]
    through: dict[str, float]
    capacity: dict[str, float]
    cut_nodes: set[str]
    cut_links: set[tuple[str, str]]  # (src, dst) with the coordinator as COORD_IN / COORD_OUT
    cut_nic: bool
    layout: PlanLayout

    @property
    def utilization(self) -> dict[str, float]:
        return {n: (self.through.get(n, 0.0) / c if c > 0 else 0.0) for n, c in self.capacity.items()}

    def rows(self) -> list[tuple[str, str]]:
        """(region, node) in drawing order: by region, then start layer; nodes without layers last."""
        order = {b.name: i for i, b in enumerate(self.layout.regions)}
        far = self.cap.num_layers + 1
        return sorted(((self.layout.region_of[n], n) for n in self.gpu),
                      key=lambda rn: (order[rn[0]], self.plan.placement.get(rn[1], (far, far)), rn[1]))  # fmt: skip


def plan_view(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet) -> PlanView:
    """Flows per node, capacities and the min cut of ``plan`` (which should carry its flows)."""
    cap = CapacityModel.build(cluster, profiles)
    coord = cluster.coordinator.id
    through = node_inflow(plan.flows, coord)
    capacity = {n: cap.node_capacity(n, e - s) for n, (s, e) in plan.placement.items()}
    cut_nodes: set[str] = set()
    cut_links: set[tuple[str, str]] = set()
    cut_nic = False
    g = flow_graph(cap, dict(plan.placement), partial_handoffs=plan.partial_handoffs)
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
    layout = plan_layout(cluster, plan, cap.num_layers)
    return PlanView(plan, cap, gpu, through, capacity, cut_nodes, cut_links, cut_nic, layout)


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


def flow_table(view: PlanView, coordinator: str = "coordinator", *, top: int = 6) -> dict[str, list[tuple[str, float]]]:
    """The short tables that stand in for edge labels: ``(what, tok/s)`` rows, the largest first.

    ``between regions``: with more than one region, the flow between every two regions (the
    coordinator counts as its own end: what enters and leaves the pipeline); ``busiest links``:
    the ``top`` links carrying the most flow.
    """
    region_of = view.layout.region_of
    ends = {COORD_IN: "coordinator", COORD_OUT: "coordinator"}
    edges = list(flow_digraph(view, coordinator).edges(data="tok_s"))
    between: dict[tuple[str, str], float] = {}
    if len(view.layout.regions) > 1:
        for u, v, f in edges:
            key = (ends.get(u) or region_of[u], ends.get(v) or region_of[v])
            if key[0] != key[1]:
                between[key] = between.get(key, 0.0) + f
    busiest = sorted(edges, key=lambda e: -e[2])[:top]
    return {
        "between regions": [(f"{a} → {b}", f) for (a, b), f in sorted(between.items(), key=lambda kv: -kv[1])],
        "busiest links": [(f"{ends.get(u, u)} → {ends.get(v, v)}", f) for u, v, f in busiest],
    }
