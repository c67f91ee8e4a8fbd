"""The fewest layers moved that keep a max-flow floor, exactly: a covering MILP checked by the max flow.

Re-planning (``planner.replan``) searches for a placement that moves few layers; this module says
how few is possible. :func:`fewest_moves` solves, over every node ``i`` of the new membership and
every range ``r = [s, s + k)`` it may hold (``k <= max_layers``), with ``x_{i,r}`` binary::

    minimise   sum_{i,r} load_i(r) x_{i,r}          load_i(r): layers of r not in i's current range
    subject to sum_r x_{i,r} = 1                        (every node holds one range)
               sum_{i, r holds l} min(T_i(|r|), F) x_{i,r} >= F   (every layer l, F = the floor)

The second row is a relaxation of ``max flow >= F``: the holders of a layer are a vertex cut of the
paper's flow graph (every request runs every layer on some node), so no placement whose max flow
reaches ``F`` breaks it (capping a coefficient at ``F`` changes no integer solution and tightens
the LP), and the optimum is a lower bound on the layers any such placement moves. The optimum's
placement is then evaluated exactly (``planner.graph``: links, partial hand-offs, the NIC); when
its max flow reaches ``F`` it is the minimum; when it does not, a no-good row cuts that placement
off and the MILP is solved again (the bound stays valid: only placements below the floor are cut).

How it is solved fast (single24 less a node: 11,117 columns, 1-3 s here): the LP relaxation gives
a bound ``z`` and reduced costs ``rc``; any placement moving at most ``B`` layers uses only columns
with ``rc <= B - z`` (its cost is ``z`` plus its columns' reduced costs, each >= 0). So ``B`` starts
at ``ceil(z)`` and grows by one: each MILP holds the columns that can be part of a placement moving
at most ``B`` layers and the row ``moves <= B``, and asks for any solution; infeasible proves
``> B`` (the bound returned on a time-out), a placement found moves exactly ``B``: the minimum. Why not the paper's MILP with a moves objective
(``planner.milp``): the overlap of two ranges is ``max(0, ...)``, a big-M disjunction per node, and
HiGHS proves no bound above 0 in minutes on single24; here the costs are known per range.

A second, optional solve keeps the moves at the minimum and maximises the weakest layer's coverage
(``then_max_flow_s``): among the placements that move the fewest layers, one with the most flow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from helix.domain import LayerRange, Placement
from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.graph import max_flow_value
from planner.moves import Ranges, layers_moved
from planner.solvers import Model, Solution

FLOW_TOL = 1e-9  # relative: a max flow this close below the floor meets it
RC_TOL = 1e-6  # reduced costs within this of the budget count as within it
# HiGHS presolve without probing (bit 15) and enumeration (bit 16): on these models they take most of
# the time (single24 less a T4: 1-2.5 s of a 1.2-3 s solve) and shorten the search little
HIGHS_OPTIONS = {"presolve_rule_off": (1 << 15) | (1 << 16)}


@dataclass(frozen=True, slots=True)
class FewestMoves:
    """What :func:`fewest_moves` proved and found."""

    status: str  # "optimal" | "time_limit" | "infeasible" (no placement's max flow reaches the floor)
    lower_bound: int  # no placement whose max flow reaches the floor moves fewer layers
    placement: Placement | None  # the best placement found whose max flow reaches the floor
    layers_moved: int | None
    max_flow_tok_s: float | None  # the placement's, evaluated exactly
    wall_s: float
    rounds: int = 0  # MILPs solved

    @property
    def gap(self) -> int | None:
        """Layers between the answer and the proven minimum (0: optimal)."""
        return None if self.layers_moved is None else self.layers_moved - self.lower_bound


@dataclass(frozen=True, slots=True)
class _Range:
    node: str
    start: int
    end: int
    load: int  # layers to load
    tok_s: float  # T_i(end - start)


def range_count(cap: CapacityModel) -> int:
    """The MILP's columns at most: every range every node may hold (11,117 on single24 less a node)."""
    return sum(sum(cap.num_layers - k + 1 for k in range(1, min(cap.max_layers[n], cap.num_layers) + 1))
               for n in cap.nodes)


def fewest_moves(cap: CapacityModel, current: Ranges, floor_tok_s: float, *, partial_handoffs: bool = True,
                 deadline: Deadline | None = None, time_limit_s: float = 60.0, threads: int = 2,
                 then_max_flow_s: float = 0.0, enough_tok_s: float = math.inf) -> FewestMoves:
    """The placement of ``cap``'s nodes whose max flow reaches ``floor_tok_s`` and that makes them load
    the fewest layers not in their ``current`` ranges (module docstring). ``then_max_flow_s``: the
    second solve's time, skipped when the first placement's max flow reaches ``enough_tok_s``."""
    deadline = deadline if deadline is not None else Deadline.after(time_limit_s)
    t0 = deadline.clock()
    cols = [_Range(n, s, s + k, layers_moved(current, {n: (s, s + k)}), cap.node_capacity(n, k))
            for n in cap.nodes for k in range(1, min(cap.max_layers[n], cap.num_layers) + 1)
            for s in range(cap.num_layers - k + 1)]
    lp = _model(cap, cols, floor_tok_s, floor_tok_s, integer=False).solve(time_limit_s=deadline.solver_limit())
    if lp.status == "infeasible":
        return FewestMoves("infeasible", 0, None, None, None, deadline.clock() - t0)
    if lp.status != "optimal":
        return FewestMoves("time_limit", 0, None, None, None, deadline.clock() - t0)
    rc = _reduced_costs(cap, cols, lp, floor_tok_s)
    budget, rounds = max(0, math.ceil(lp.objective - RC_TOL)), 0
    worst = sum(max(c.load for c in cols if c.node == n) for n in cap.nodes)  # a budget above it keeps every column
    cuts: list[Placement] = []
    while not deadline.expired():
        if budget > worst:  # no integer placement's coverage reaches the floor (or all that do were cut)
            return FewestMoves("infeasible", 0, None, None, None, deadline.clock() - t0, rounds)
        keep = [c for c, r in zip(cols, rc, strict=True) if r <= budget - lp.objective + RC_TOL]
        model = _model(cap, keep, floor_tok_s, floor_tok_s, integer=True, budget=budget, cuts=cuts)
        model.cost = [0.0] * len(keep)  # any placement within the budget moves exactly ``budget`` layers
        rounds += 1
        sol = model.solve(time_limit_s=deadline.solver_limit(), threads=threads, options=HIGHS_OPTIONS)
        if sol.status == "infeasible":
            budget += 1  # proven: every placement above the floor moves more
            continue
        if not sol.x:
            break
        placement = _placement(keep, sol)
        flow = max_flow_value(cap, placement, partial_handoffs=partial_handoffs)
        if flow < floor_tok_s * (1 - FLOW_TOL):
            cuts.append(placement)
            continue
        moved = layers_moved(current, placement)
        if then_max_flow_s > 0 and flow < enough_tok_s and not deadline.expired():
            placement, flow = _most_flow(cap, keep, moved, cuts, placement, flow, floor_tok_s, enough_tok_s,
                                         partial_handoffs, deadline.within(then_max_flow_s), threads)
        return FewestMoves("optimal", moved, placement, moved, flow, deadline.clock() - t0, rounds)
    return FewestMoves("time_limit", budget, None, None, None, deadline.clock() - t0, rounds)


def _model(cap: CapacityModel, cols: list[_Range], floor_tok_s: float, cap_tok_s: float, *, integer: bool,
           budget: int | None = None, cuts: list[Placement] | None = None) -> Model:
    """Rows: one per node (its range), one per layer (its coverage, coefficients capped at ``cap_tok_s``,
    ``>= floor_tok_s``), then ``moves <= budget`` and the no-good ``cuts``."""
    m = Model()
    mine: dict[str, list[int]] = {n: [] for n in cap.nodes}
    holders: list[tuple[list[int], list[float]]] = [([], []) for _ in range(cap.num_layers)]
    index = {}
    for c in cols:
        j = m.add_col(0.0, 1.0, cost=float(c.load), integer=integer)
        index[(c.node, c.start, c.end)] = j
        mine[c.node].append(j)
        for layer in range(c.start, c.end):
            holders[layer][0].append(j)
            holders[layer][1].append(min(c.tok_s, cap_tok_s))
    for n in cap.nodes:
        m.add_row(mine[n], [1.0] * len(mine[n]), 1.0, 1.0)
    for idx, tok_s in holders:
        m.add_row(idx, tok_s, lo=floor_tok_s)
    if budget is not None:
        loads = [j for j, c in enumerate(cols) if c.load > 0]
        m.add_row(loads, [float(cols[j].load) for j in loads], hi=float(budget))
    for pl in cuts or []:
        idx = [index[(n, s, e)] for n, (s, e) in pl.items() if (n, s, e) in index]
        if len(idx) == len(pl):  # else a column of it is left out: it is excluded already
            m.add_row(idx, [1.0] * len(idx), hi=len(idx) - 1)
    return m


def _reduced_costs(cap: CapacityModel, cols: list[_Range], lp: Solution, floor_tok_s: float) -> list[float]:
    """Each column's LP reduced cost ``c_j - y' A_j`` from the rows' duals (``_model``'s row order)."""
    nodes = {n: i for i, n in enumerate(cap.nodes)}
    per_layer = lp.row_dual[len(nodes):len(nodes) + cap.num_layers]
    prefix = [0.0]
    for y in per_layer:
        prefix.append(prefix[-1] + y)
    return [c.load - lp.row_dual[nodes[c.node]] - min(c.tok_s, floor_tok_s) * (prefix[c.end] - prefix[c.start])
            for c in cols]


def _most_flow(cap: CapacityModel, cols: list[_Range], moved: int, cuts: list[Placement], placement: Placement,
               flow: float, floor_tok_s: float, enough_tok_s: float, partial_handoffs: bool, deadline: Deadline,
               threads: int) -> tuple[Placement, float]:
    """Among placements moving ``moved`` layers, one whose weakest layer is best covered (up to
    ``enough_tok_s``), if its max flow beats ``flow`` (else ``placement``, ``flow``)."""
    top = enough_tok_s if math.isfinite(enough_tok_s) else max(c.tok_s for c in cols)
    m = _model(cap, cols, 0.0, top, integer=True, budget=moved, cuts=cuts)
    first = len(cap.nodes)
    weakest = m.add_col(floor_tok_s, top, cost=1.0)
    for row in range(first, first + cap.num_layers):  # coverage >= weakest
        idx, val, _, hi = m.rows[row]
        m.rows[row] = ([*idx, weakest], [*val, -1.0], 0.0, hi)
    m.cost = [0.0] * weakest + [1.0]
    m.maximize = True
    sol = m.solve(time_limit_s=deadline.solver_limit(), threads=threads, options=HIGHS_OPTIONS)
    if not sol.x:
        return placement, flow
    better = _placement(cols, sol)
    got = max_flow_value(cap, better, partial_handoffs=partial_handoffs)
    return (better, got) if got > flow else (placement, flow)


def _placement(cols: list[_Range], sol: Solution) -> Placement:
    return {c.node: LayerRange(c.start, c.end) for c, x in zip(cols, sol.x, strict=False) if x > 0.5}
