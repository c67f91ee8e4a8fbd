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

import highspy
import networkx as nx
import numpy as np

from helix.plan import FlowEdge
from planner.graph import SINK, SOURCE, CapacityModel, Placement, build_graph, flow_edges
from planner.highs_model import run


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
    n = len(edges)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("time_limit", 20.0)
    lp = highspy.HighsLp()
    lp.num_col_ = n
    lp.col_cost_ = np.zeros(n)
    lp.col_lower_ = np.zeros(n)
    lp.col_upper_ = np.array([float(c) if c is not None else highspy.kHighsInf for _, _, c in edges])
    rows: list[tuple[list[int], list[float], float, float]] = []
    for v in g.nodes:
        if v in (SOURCE, SINK):
            continue
        ins = [idx[(u, v)] for u in g.predecessors(v)]
        outs = [idx[(v, w)] for w in g.successors(v)]
        rows.append((ins + outs, [1.0] * len(ins) + [-1.0] * len(outs), 0.0, 0.0))
    src = [idx[(SOURCE, w)] for w in g.successors(SOURCE)]
    slack = 1e-7 * value
    rows.append((src, [1.0] * len(src), value - slack, value + slack))
    lp.num_row_ = len(rows)
    lp.row_lower_ = np.array([r[2] for r in rows])
    lp.row_upper_ = np.array([r[3] for r in rows])
    start, index, val = [0], [], []
    for i, v_, _, _ in rows:
        index.extend(i)
        val.extend(v_)
        start.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(start, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(val, dtype=float)
    h.passModel(lp)
    diag = [(j, 2.0 / float(c)) for j, (u, v, c) in enumerate(edges)
            if u.endswith("/in") and v.endswith("/out") and u[:-3] == v[:-4] and c]
    hs = highspy.HighsHessian()
    hs.dim_ = n
    hs.format_ = highspy.HessianFormat.kTriangular
    # a tiny term on every edge makes the optimum unique (edge flows are otherwise degenerate)
    by_col = {j: 1e-6 * 2.0 / float(c) for j, (_, _, c) in enumerate(edges) if c}
    by_col.update(diag)
    hstart, hindex, hvalue = [0], [], []
    for j in range(n):
        if j in by_col:
            hindex.append(j)
            hvalue.append(by_col[j])
        hstart.append(len(hindex))
    hs.start_ = np.array(hstart, dtype=np.int32)
    hs.index_ = np.array(hindex, dtype=np.int32)
    hs.value_ = np.array(hvalue, dtype=float)
    h.passHessian(hs)
    run(h)
    x = list(h.getSolution().col_value)
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal or len(x) != n:
        from planner.graph import evaluate

        res = evaluate(cap, placement, partial_handoffs=partial_handoffs, with_cut=False)
        return res.max_flow_tok_s, res.flows
    coord = cap.coordinator
    out = flow_edges(((u, v, max(0.0, x[j])) for j, (u, v, _) in enumerate(edges)), coord, min_tok_s=1e-9 * value)
    total = sum(e.tok_s for e in out if e.src == coord)
    return total, out
