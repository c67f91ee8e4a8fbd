"""The layer-configuration LP at a target flow, by column generation (the network-free relaxation
the bounds of :mod:`planner.bounds` and :mod:`planner.link_bound` stand on).

Forget where the strips are and keep only which kinds (GPU type and layer cap t, layer count k)
cover each layer: a layer is covered by a multiset c of kinds whose capacities sum to >= F (a
configuration). A node of kind t holding k layers lends 1/k of itself to each of its layers, so
covering a layer with c costs ``a_{t,c} = sum_k mult_c(t,k) / k`` nodes of kind t. Master LP
(one row per kind)::

    maximize sum_c x_c   s.t.  sum_c a_{t,c} x_c <= N_t   (every kind t)

and no placement reaches F if the optimum (the layers coverable at F) is below L. Pricing (duals
pi_t) is a covering knapsack solved exactly by HiGHS: minimize sum_{t,k} pi_t m_{t,k} / k subject
to sum_{t,k} T_t(k) m_{t,k} >= F, 0 <= m_{t,k} <= N_t integer.

Run to optimality, the LP also gives *prices*: duals pi_t >= 0 under which every configuration
reaching F costs at least 1 (``sum_t pi_t a_{t,c} >= 1``), with ``sum_t pi_t N_t`` = the LP optimum.
Any placement reaching F then has ``sum_l cost(c_l) <= sum_t pi_t N_t`` (its layers use at most
the nodes there are): the link-aware bound prices what crossing a region costs with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.solvers import Model


@dataclass(slots=True, frozen=True)
class ConfigurationLP:
    """The LP at one flow: ``covered`` layers (a lower estimate of the optimum when stopped early)
    and, at optimality, prices per kind under which every configuration reaching the flow costs >= 1
    (``prices`` None when stopped early); ``budget`` = sum_t pi_t N_t."""

    covered: float
    prices: dict[str, float] | None
    budget: float = math.inf


def configuration_lp(
    cap: CapacityModel, flow: float, deadline: Deadline, *, stop_at: float | None = None
) -> ConfigurationLP | None:
    """Column generation for the LP at ``flow``: stops once ``stop_at`` layers are covered (no prices
    then) or at the optimum (with prices); None when a solve fails or ``deadline`` passes first."""
    counts = cap.kind_counts()
    types = cap.kind_names
    kinds = [(t, k) for t in types for k in range(1, cap.kinds[t].max_layers + 1)]
    cols: list[list[float]] = []  # a_{t,c} per type
    # start with single-kind columns that cover alone or with repeats (always valid configs)
    for t, k in kinds:
        height = cap.kinds[t].tok_s[k - 1]
        reps = math.ceil(flow / height - 1e-12)
        if reps <= counts[t]:
            cols.append([reps / k if tt == t else 0.0 for tt in types])
    if not cols:
        cols.append([counts[t] + 1.0 for t in types])  # a dummy that no budget affords
    while not deadline.expired():
        master = Model()  # minimize -sum_c x_c
        master_cols = [master.add_col(0.0, cost=-1.0) for _ in cols]
        for ti, t in enumerate(types):
            idx = [j for j in range(len(cols)) if cols[j][ti] > 0]
            master.add_row([master_cols[j] for j in idx], [cols[j][ti] for j in idx], hi=float(counts[t]))
        got = master.solve(time_limit_s=deadline.solver_limit(), options={"presolve": "off"})
        if got.status != "optimal":
            return None
        covered = -got.objective
        if stop_at is not None and covered >= stop_at * (1 - 1e-9):
            return ConfigurationLP(covered, None)
        duals = [max(0.0, -d) for d in got.row_dual]
        price = Model()
        mcols = [price.add_col(0, counts[t], cost=duals[types.index(t)] / k, integer=True) for t, k in kinds]
        price.add_row(mcols, [cap.kinds[t].tok_s[k - 1] for t, k in kinds], lo=flow)
        sol = price.solve(time_limit_s=deadline.solver_limit(), mip_gap=0.0)
        if sol.status != "optimal":
            return None
        if sol.objective >= 1 - 1e-9:  # no column improves: optimal, and the duals price every config >= 1
            cheapest = min(sol.objective, sol.dual_bound) if sol.dual_bound == sol.dual_bound else sol.objective
            if cheapest <= 0:
                return None
            prices = {t: duals[ti] / cheapest for ti, t in enumerate(types)}
            return ConfigurationLP(covered, prices, sum(prices[t] * counts[t] for t in types))
        counts_m = [round(v) for v in sol.x]
        cols.append([sum(counts_m[q] / k for q, (tt, k) in enumerate(kinds) if tt == t) for t in types])
    return None
