"""A link-aware upper bound on the max flow of ANY placement (geo clusters: regions joined by slow links).

The network-free bounds (:mod:`planner.bounds`) ignore links, and on geo clusters they are far
above what any placement reaches: with the paper's tables every node's best strip (A100 x 8, L4 x 3,
T4 x 2 layers) reaches about the same flow alone, so the best network-free covering is a chain of
single nodes, and a chain crosses from one region to the next over ONE node-pair link
(0.1 Gbit/s = 763 tok/s of activations). Crossing with more flow takes wide groups of nodes on
both sides, and wide groups cost layers. This module proves how much.

**Setting.** Group the nodes by region (nodes without one form a group of their own). Fix a flow
F and a placement whose max flow is >= F; take a flow of value exactly F. For a boundary b
(between layers b-1 and b, 1 <= b < L) let C = nodes holding both b-1 and b (continuing), S = nodes
whose range ends at b (senders), N = nodes whose range starts at b. Every unit of flow runs layer
b-1 on some node and layer b on some node: the same one (in C), or it hops over an edge i -> j with
i in S and j in C u N (partial hand-offs; without them j in N: fewer edges). Hence, with T the
capacities ``T_i(k_i)``, ``a_ij`` the activation link capacities and g the hop flows:

    (1) sum_{C u S} T >= F and sum_{C u N} T >= F                 (layers b-1 and b are covered)
    (2) F <= sum_C T + hops(S -> C u N),  F <= sum_C T + hops(S -> N) (a unit stays in C or hops)
    (3) hops(S_r -> X_s) <= a_rs * |S_r| * |X_s|,  a_rs = max link between the groups r and s,
        hops out of a sender <= min(T_i, its NIC), into an N node <= min(T_j, its NIC),
        cross-region hops out of region r <= r's uplink, into s <= s's downlink (when the cluster has them).
    Let y_b = the hop flow between different groups at b: y_b <= F and y_b <= sum over r != s of the hops.

**Prices.** The layer-configuration LP at F (:mod:`planner.config_lp`) run to optimality gives
prices pi_t >= 0 per kind under which every layer configuration reaching F costs >= 1, where
cost(c) = sum over c's nodes of pi_t / k. Write M = sum_t pi_t N_t. A placement's layers use
each node exactly once (1/k per layer held), so sum_l cost(c_l) <= M. Split every internal layer's
cost half to each of its two boundaries:

    sum_l cost(c_l) = cost(c_0)/2 + cost(c_{L-1})/2 + sum_{b=1}^{L-1} beta_b,
    beta_b = (cost(C u S) + cost(C u N)) / 2 = sum_C pi/k + sum_S pi/(2k) + sum_N pi/(2k),

each end term >= 1/2 and each beta_b >= 1, so sum_b (beta_b - 1) <= M - L.

**Crossings needed.** A unit of flow whose path runs layers in exactly the groups V hops between
groups >= |V| - 1 times. The paths inside a set U of groups form a flow of U's nodes alone, so their
total is at most P_U, U's own network-free bound (0 when U cannot hold the model). The LP

    Y(F) = min sum_V (|V| - 1) f_V   s.t.  sum_V f_V = F,  sum_{V subset of U} f_V <= P_U (every U),
           (with uplinks) sum_{V contains r, |V| >= 2} f_V <= up_r + down_r,  sum_V (|V|-1) f_V <= sum_r up_r

is a lower bound on sum_b y_b (it is infeasible when no placement's links can carry F).

**The proof.** Let lambda = (M - L + eta) / Y(F) (eta > 0 small). A MILP over boundary shapes
(integer counts of C, S and N nodes per region, kind, NIC and layer count; the pair counts
|S_r| * |X_s| linearised exactly by a unary expansion of |X_s| capped where the link alone carries F)
minimises beta - lambda * y subject to (1)-(3). If its proven lower bound is >= 1, every
boundary of every placement reaching F has beta_b - 1 >= lambda * y_b, so

    M - L >= sum_b (beta_b - 1) >= lambda * sum_b y_b >= lambda * Y(F) = M - L + eta,

a contradiction: no placement reaches F. A placement reaching F' > F carries a flow of exactly F,
so every F' > F is unreachable too, and :func:`link_bound` bisects F. Everything is a relaxation
of the real placement (positions of strips forgotten, the best link of a group pair for all its
pairs, each boundary alone), so the bound is valid with or without partial hand-offs; it is weak
where crossing costs nothing (links that carry F alone, or a region holding the model by itself).

**Second argument** (:mod:`planner.region_zone`, tried first at every F): where some crossings are
free (two L4 rails of two regions joined by a fast enough link) the multiplier above is too small,
yet one region (the A100s') must still be entered or left over slow links: layers holding only its
nodes and layers holding none of them both exist, and any passage from one kind to the other costs
more than the slack, counted over every layer its wide groups hold. F is unreachable when either
argument proves it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from itertools import combinations

from planner.bisection import bisect_unreachable
from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.config_lp import configuration_lp
from planner.region_groups import NO_REGION, Groups, NodeClass, cap_by_pairs, unary_count
from planner.region_zone import transition_rules_out
from planner.solvers import Model

__all__ = ["ETA", "MAX_GROUPS", "Groups", "NodeClass", "boundary_costs_at_least_one", "crossings_needed",
           "link_bound", "link_feasible"]

ETA = 1e-3  # layers of slack the proof must exceed (the cutoff's round-off over L boundaries is far below)
CUTOFF = 1.0 - 1e-6  # a boundary shape below this is a counterexample
MAX_GROUPS = 6  # more region groups: no crossing LP (2^groups subsets)
Alone = Callable[[], Mapping[frozenset[str], float]]  # P_U per proper set U of groups, computed when first needed
GOAL = 1.1  # the bisection's second probe: a bound this far above the flow found is a gap of 9.1 %


def crossings_needed(groups: Groups, flow: float, alone: Mapping[frozenset[str], float],
                     deadline: Deadline) -> float | None:
    """Y(F): the least total hop flow between groups any flow of value ``flow`` needs (inf: none can
    cross enough); ``alone[U]`` bounds what the groups U carry by themselves. None: solver failure."""
    names = groups.names
    subsets = [frozenset(c) for size in range(1, len(names) + 1) for c in combinations(names, size)]
    m = Model()
    f = [m.add_col(0.0, cost=float(len(v) - 1)) for v in subsets]
    m.add_row(f, [1.0] * len(f), flow, flow)
    for u, cap_u in alone.items():
        if cap_u < flow:
            idx = [f[i] for i, v in enumerate(subsets) if v <= u]
            m.add_row(idx, [1.0] * len(idx), hi=cap_u)
    if not groups.any_ungrouped:
        for r in names:
            if r in groups.uplink and r in groups.downlink:
                idx = [f[i] for i, v in enumerate(subsets) if r in v and len(v) > 1]
                m.add_row(idx, [1.0] * len(idx), hi=groups.uplink[r] + groups.downlink[r])
        for shared in (groups.uplink, groups.downlink):
            if all(r in shared for r in names):
                m.add_row(f, [float(len(v) - 1) for v in subsets], hi=sum(shared.values()))
    got = m.solve(time_limit_s=deadline.solver_limit())
    if got.status == "infeasible":
        return math.inf
    if got.status != "optimal":
        return None
    return max(0.0, got.objective)


def boundary_costs_at_least_one(cap: CapacityModel, groups: Groups, flow: float, prices: Mapping[str, float],
                                lam: float, deadline: Deadline) -> bool | None:
    """Whether every boundary shape has beta - lam * y >= 1 (the MILP of the proof; True is proven,
    up to :data:`CUTOFF`); None when the solver decides nothing before ``deadline``."""
    m = Model()
    T = {q.kind: cap.kinds[q.kind].tok_s for q in groups.classes}
    roles: dict[str, list[tuple[NodeClass, int, int]]] = {"C": [], "S": [], "N": []}  # (class, k, column)
    for q in groups.classes:
        kmax = cap.kinds[q.kind].max_layers
        cols: list[int] = []
        for role, weight in (("C", 1.0), ("S", 0.5), ("N", 0.5)):
            for k in range(2 if role == "C" else 1, kmax + 1):
                j = m.add_col(0, q.count, cost=weight * prices[q.kind] / k, integer=True)
                roles[role].append((q, k, j))
                cols.append(j)
        m.add_row(cols, [1.0] * len(cols), hi=float(q.count))

    def height(role: str, *, nic: bool = False) -> tuple[list[int], list[float]]:
        items = roles[role]
        return [j for _, _, j in items], [min(T[q.kind][k - 1], q.nic_tok_s) if nic else T[q.kind][k - 1]
                                          for q, k, _ in items]

    def count_in(role: str, r: str) -> tuple[list[int], list[float]]:
        idx = [j for q, _, j in roles[role] if q.group == r]
        return idx, [1.0] * len(idx)

    for pair in (("C", "S"), ("C", "N")):  # (1): layers b-1 and b are covered
        i1, v1 = height(pair[0])
        i2, v2 = height(pair[1])
        m.add_row(i1 + i2, v1 + v2, lo=flow)
    names = groups.names
    cross: list[int] = []
    for receivers in (("C", "N"), ("N",)):  # (2) with (3), once for S -> C u N and once for S -> N
        hops: dict[tuple[str, str], int] = {}
        for s in names:
            q_cap = groups.receivers_needed(s, flow)
            if q_cap == 0:
                continue
            beta = unary_count(m, [j for role in receivers for j in count_in(role, s)[0]], q_cap)  # |X_s|
            for r in (r for r in names if groups.link[(r, s)] > 0):
                g = m.add_col(0, flow)
                hops[(r, s)] = g
                cap_by_pairs(m, g, groups.link[(r, s)], beta, count_in("S", r)[0], groups.size[r])
        for r in names:  # a sender pushes no more than it runs (and its NIC passes)
            out = [g for (a, _), g in hops.items() if a == r]
            if out:
                idx = [j for q, _, j in roles["S"] if q.group == r]
                val = [min(T[q.kind][k - 1], q.nic_tok_s) for q, k, j in roles["S"] if q.group == r]
                m.add_row(out + idx, [1.0] * len(out) + [-v for v in val], hi=0.0)
            real = r != NO_REGION
            up = [g for (a, b), g in hops.items() if a == r and b != r and b != NO_REGION]
            if real and up and r in groups.uplink:
                m.add_row(up, [1.0] * len(up), hi=groups.uplink[r])
            down = [g for (a, b), g in hops.items() if b == r and a != r and a != NO_REGION]
            if real and down and r in groups.downlink:
                m.add_row(down, [1.0] * len(down), hi=groups.downlink[r])
        if receivers == ("N",):
            for s in names:
                into = [g for (_, b), g in hops.items() if b == s]
                if into:
                    idx = [j for q, _, j in roles["N"] if q.group == s]
                    val = [min(T[q.kind][k - 1], q.nic_tok_s) for q, k, j in roles["N"] if q.group == s]
                    m.add_row(into + idx, [1.0] * len(into) + [-v for v in val], hi=0.0)
        ic, vc = height("C")
        gs = list(hops.values())
        m.add_row(ic + gs, vc + [1.0] * len(gs), lo=flow)
        if receivers == ("C", "N"):
            cross = [g for (a, b), g in hops.items() if a != b]
    if cross:
        y = m.add_col(0, flow, cost=-lam)
        m.add_row([y] + cross, [1.0] + [-1.0] * len(cross), hi=0.0)
    # the MILP only has to say whether some shape goes below 1: everything above is cut off
    got = m.solve(time_limit_s=deadline.solver_limit(), mip_gap=1e-6,
                  options={"objective_bound": CUTOFF})
    if got.status == "infeasible":
        return True
    if got.x and got.objective < CUTOFF:
        return False
    return True if got.dual_bound >= CUTOFF else None


def link_feasible(cap: CapacityModel, flow: float, groups: Groups, alone: Alone, deadline: Deadline) -> bool | None:
    """False (a proof) when no placement reaches ``flow`` by either argument above (the region
    transition first: it needs no P_U); True when neither rules it out; None when a solver stopped
    without an answer."""
    lp = configuration_lp(cap, flow, deadline)
    if lp is None:
        return None
    L = float(cap.num_layers)
    if lp.prices is None:
        return None
    if lp.budget < L * (1 - 1e-9):
        return False
    zone = transition_rules_out(cap, groups, flow, lp.prices, lp.budget, margin=ETA, deadline=deadline)
    if zone is not False:
        return None if zone is None else False
    need = crossings_needed(groups, flow, alone(), deadline)
    if need is None:
        return None
    if need == math.inf:
        return False
    if need <= 0:
        return True
    lam = (lp.budget - L + ETA) / need
    dear = boundary_costs_at_least_one(cap, groups, flow, lp.prices, lam, deadline)
    return None if dear is None else not dear


def link_bound(cap: CapacityModel, *, lower: float, upper: float, alone: Alone, deadline: Deadline,
               rel_tol: float = 1e-4) -> float:
    """The smallest flow proven unreachable by :func:`link_feasible` (``alone()``: the P_U above, asked for
    only when the crossing argument runs) between a reachable ``lower``
    (the best max flow found) and a valid ``upper`` (``upper`` when none is, or the cluster has one
    group). Tries just above ``lower`` first (proving it optimal costs one test), then :data:`GOAL` times
    ``lower`` (a gap under 10 % in one more test), then just below ``upper`` (where the argument is idle,
    one test), then bisects."""
    groups = Groups.of(cap)
    if len(groups.names) < 2 or len(groups.names) > MAX_GROUPS or not 0 < lower < upper:
        return upper
    lo, hi = lower, upper
    for probe in (lower * GOAL, lower * (1 + rel_tol / 2), upper * (1 - rel_tol / 2)):
        if deadline.expired():
            break
        if not lo < probe < hi:
            continue
        res = link_feasible(cap, probe, groups, alone, deadline)
        if res is None:
            return hi
        if res is False:
            hi = probe
        else:
            lo = probe
    return bisect_unreachable(lambda flow: link_feasible(cap, flow, groups, alone, deadline), lo, hi,
                              rel_tol=rel_tol, deadline=deadline)  # fmt: skip
