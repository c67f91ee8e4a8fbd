"""Balanced flows: the max-flow value, spread over parallel nodes in proportion to capacity.

The router splits requests by the plan's flows (IWRR weights on out-edges). A max-flow
algorithm returns *a* maximum flow, and on a placement with slack (parallel nodes outside
the min cut) it often leaves some nodes with no flow at all: the router never uses them,
so their compute and KV are wasted (in the simulator, half of single24's T4s stay idle
under preflow-push flows). :func:`balanced_flows` keeps the max-flow value but solves the
convex QP (HiGHS)::

    minimize  sum_i f_i^2 / T_i(k_i)   (f_i = flow through node i)
    s.t.      flow conservation, edge and node capacities, value = max flow

whose optimum splits flow among interchangeable nodes in proportion to T_i (equal
utilisation), i.e. every node works and none is favoured. A 1e-6 weight on every edge's
``f_e^2 / c_e`` makes the optimum unique, so the flows (and the serving estimate computed
on them) do not depend on the solver's path.
"""

from __future__ import annotations

import networkx as nx

from helix.plan import FlowEdge
from planner.graph import SINK, SOURCE, CapacityModel, Placement, build_graph, evaluate, flow_edges
from planner.highs_model import INF, Model


def balanced_flows(
    cap: CapacityModel, placement: Placement, *, partial_handoffs: bool = True, value: float | None = None
) -> tuple[float, list[FlowEdge]]:
    """(max flow, flows on node/coordinator edges) with the max flow spread evenly."""
    g = build_graph(cap, placement, partial_handoffs=partial_handoffs)
    if value is None:
        value = float(nx.maximum_flow_value(g, SOURCE, SINK, flow_func=nx.algorithms.flow.preflow_push))
    if value <= 0:
        return 0.0, []
    edges = list(g.edges(data="capacity"))
    idx = {(u, v): j for j, (u, v, _) in enumerate(edges)}
    m = Model()
    for _, _, c in edges:
        m.add_col(0.0, float(c) if c is not None else INF)
    for v in g.nodes:
        if v in (SOURCE, SINK):
            continue
        ins = [idx[(u, v)] for u in g.predecessors(v)]
        outs = [idx[(v, w)] for w in g.successors(v)]
        m.add_row(ins + outs, [1.0] * len(ins) + [-1.0] * len(outs), 0.0, 0.0)
    src = [idx[(SOURCE, w)] for w in g.successors(SOURCE)]
    slack = 1e-7 * value
    m.add_row(src, [1.0] * len(src), value - slack, value + slack)
    # a tiny term on every edge makes the optimum unique (edge flows are otherwise degenerate)
    m.quadratic = {j: 1e-6 * 2.0 / float(c) for j, (_, _, c) in enumerate(edges) if c}
    m.quadratic.update((j, 2.0 / float(c)) for j, (u, v, c) in enumerate(edges)
                       if u.endswith("/in") and v.endswith("/out") and u[:-3] == v[:-4] and c)
    sol = m.solve(time_limit_s=20.0, threads=1)
    x = sol.x
    if sol.status != "optimal" or len(x) != len(edges):
        res = evaluate(cap, placement, partial_handoffs=partial_handoffs, with_cut=False)
        return res.max_flow_tok_s, res.flows
    coord = cap.coordinator
    out = flow_edges(((u, v, max(0.0, x[j])) for j, (u, v, _) in enumerate(edges)), coord, min_tok_s=1e-9 * value)
    total = sum(e.tok_s for e in out if e.src == coord)
    return total, out
