"""The region-transition argument of the link-aware bound: where one region's nodes are the only good
use of its budget (A100s all in one region, linked to the others by slow links), some layers hold that
region's nodes alone and others none of them, and the flow must pass from one kind of layer to the other
somewhere; every way to do so over slow links costs more node-layers than the layer-configuration LP
has to spare. :mod:`planner.link_bound` tries it where its per-boundary argument proves nothing.

**Setting** (as in :mod:`planner.link_bound`). At a flow F the layer-configuration LP gives prices
pi_t >= 0 under which every configuration reaching F costs >= 1, with M = sum_t pi_t N_t. A placement
reaching F has configurations c_l (the nodes holding layer l) with e_l = cost(c_l) - 1 >= 0 and
sum_l cost(c_l) = sum over used nodes of pi <= M, so sum_l e_l <= sigma := M - L.

**Kinds of layers.** Fix a group r (a region); M_r = sum of pi over r's nodes. A layer is *r-only* when
all its nodes are in r, *rest-only* when none is, *mixed* otherwise. Let mu_r + 1 be the least cost of a
configuration reaching F with a node in r and a node outside r (a small MILP; its proven lower bound).
With a, o, m the numbers of r-only, rest-only and mixed layers: a + o + m = L; m mu_r <= sigma; a <= M_r
(each r-only layer costs >= 1, paid by r's used nodes) and o <= M - M_r. Hence if
L - floor(M - M_r) - floor(sigma / mu_r) >= 1 some layer is r-only, and if L - floor(M_r) - floor(sigma /
mu_r) >= 1 some layer is rest-only.

**The zone.** Both kinds exist, so two consecutive non-mixed layers in layer order are of different
kinds: layers i < j, one r-only and one rest-only, all z = j - i - 1 layers between them mixed, z <= m.
Take positions relative to i (the zone is 0..Z, Z = z + 1). Every node holding a zone layer has a range
[s, s + k) that meets the zone; its layers are real layers (ranges lie inside the model), so for the
*window* of all layers such ranges touch, sum over the window of e_l <= sigma. The zone MILP takes the
integer numbers of nodes of each class (group, kind, NIC) on each such relative range and states:

    layer 0 holds no node of the second kind's side, layer Z none of the first's; a mixed layer holds both;
    each zone layer's nodes (all of them: any node holding it meets the zone) reach F, e_l >= cost - 1;
    a window layer outside the zone holds at least the zone nodes there: e_l >= (their cost) - 1, e_l >= 0;
    region flows phi_{l,g} (sum_g = F, phi_{l,g} <= the capacity of g's nodes holding l) change from one
    zone layer to the next only by hops between groups, from nodes whose range ends there to nodes
    holding the next layer: hop(g -> h) <= a_gh |senders_g| |receivers_h| (exact unary linearisation),
    out of g <= phi_{l-1,g} and <= its senders' min(T, NIC), into h <= its receivers' min(T, NIC), shared
    uplinks and downlinks;

and minimises the window's sum of e_l. Every placement reaching F yields a solution (its real zone, read
relative to i), so if the MILP proves its minimum above sigma for both orders (r-only first or last) and
every z <= min(m, floor(sigma / mu_r)), no placement reaches F; nor any F' > F (a flow of exactly F
runs on it). Everything else is a relaxation (links the best of each group pair, a layer outside the zone
charged only for the zone nodes on it), so it holds with or without partial hand-offs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.region_groups import Groups, cap_by_pairs, unary_count
from planner.solvers import Model

MAX_MIXED = 6  # zones with more mixed layers than this: the argument is not tried (too many MILPs)
TOL = 1e-6  # the LP's prices hold up to round-off: a mixed layer's excess is taken this much lower, counts higher

Cols = list[tuple[int, str, int]]  # (column, kind, layers held) of node-range variables


def mixed_excess(cap: CapacityModel, groups: Groups, r: str, flow: float, prices: Mapping[str, float],
                 deadline: Deadline) -> float | None:
    """mu_r: a proven lower bound on (least cost of a configuration reaching ``flow`` with a node in ``r``
    and one outside it) - 1; inf when none exists; None when the solver stops first."""
    counts: dict[tuple[bool, str], int] = {}
    for q in groups.classes:
        counts[(q.group == r, q.kind)] = counts.get((q.group == r, q.kind), 0) + q.count
    m = Model()
    cover_idx, cover_val = [], []
    side: dict[bool, list[int]] = {True: [], False: []}
    for (inside, t), n in counts.items():
        cols = [m.add_col(0, n, cost=prices[t] / k, integer=True) for k in range(1, cap.kinds[t].max_layers + 1)]
        m.add_row(cols, [1.0] * len(cols), hi=float(n))
        cover_idx += cols
        cover_val += list(cap.kinds[t].tok_s[: len(cols)])
        side[inside] += cols
    m.add_row(cover_idx, cover_val, lo=flow)
    for cols in side.values():
        m.add_row(cols, [1.0] * len(cols), lo=1.0)
    got = m.solve(time_limit_s=deadline.solver_limit(), mip_gap=0.0)
    if got.status == "infeasible":
        return math.inf
    if got.status != "optimal":
        return None
    low = got.objective if got.dual_bound != got.dual_bound else min(got.objective, got.dual_bound)
    return max(0.0, low - 1.0 - TOL)


def zone_costs_more(cap: CapacityModel, groups: Groups, r: str, *, r_first: bool, mixed: int, flow: float,
                    prices: Mapping[str, float], mixed_cost: float, limit: float, deadline: Deadline) -> bool | None:
    """Whether every transition zone (r-only layer first when ``r_first``, then ``mixed`` mixed layers,
    then a rest-only layer; or the reverse) has window excess >= ``limit`` (the zone MILP above; True is
    proven); None when the solver decides nothing before ``deadline``. ``mixed_cost``: mu_r, the least
    excess of a mixed layer (a bound on each mixed layer's e_l that the MILP's relaxation lacks)."""
    Z = mixed + 1
    m = Model()
    holds: dict[int, Cols] = {}  # window layer -> node ranges holding it
    ends: dict[int, dict[str, list[int]]] = {b: {} for b in range(1, Z + 1)}  # boundary -> group -> senders
    cls_cols: dict[int, list[tuple[int, int, int]]] = {}  # class index -> (column, start, k)
    first: dict[int, list[int]] = {}  # zone layer -> columns on the first layer's side
    second: dict[int, list[int]] = {}
    for ci, q in enumerate(groups.classes):
        on_first = (q.group == r) == r_first
        cols: list[tuple[int, int, int]] = []
        for k in range(1, cap.kinds[q.kind].max_layers + 1):
            for s in range(1 - k, Z + 1):
                if (Z if on_first else 0) in range(s, s + k):
                    continue  # layer Z holds only the second side, layer 0 only the first
                j = m.add_col(0, q.count, integer=True)
                cols.append((j, s, k))
                for layer in range(s, s + k):
                    holds.setdefault(layer, []).append((j, q.kind, k))
                    if 0 <= layer <= Z:
                        (first if on_first else second).setdefault(layer, []).append(j)
                if 1 <= s + k <= Z:
                    ends[s + k].setdefault(q.group, []).append(j)
        m.add_row([j for j, _, _ in cols], [1.0] * len(cols), hi=float(q.count))
        cls_cols[ci] = cols
    for layer, items in holds.items():
        e = m.add_col(mixed_cost if 0 < layer < Z else 0.0, math.inf, cost=1.0)  # a mixed layer: e >= mu_r
        m.add_row([e] + [j for j, _, _ in items], [1.0] + [-prices[t] / k for _, t, k in items], lo=-1.0)
        if 0 <= layer <= Z:
            m.add_row([j for j, _, _ in items], [cap.kinds[t].tok_s[k - 1] for _, t, k in items], lo=flow)
    for layer in range(1, Z):
        for side in (first, second):
            m.add_row(side.get(layer, []), [1.0] * len(side.get(layer, [])), lo=1.0)
    _zone_flows(m, cap, groups, cls_cols, ends, Z, flow)
    got = m.solve(time_limit_s=deadline.solver_limit(), mip_gap=1e-6, options={"objective_bound": limit, "mip_heuristic_effort": 0.0})
    if got.status == "infeasible":
        return True
    if got.x and got.objective < limit:
        return False
    return True if got.dual_bound >= limit else None


def _zone_flows(m: Model, cap: CapacityModel, groups: Groups, cls_cols: dict[int, list[tuple[int, int, int]]],
                ends: dict[int, dict[str, list[int]]], Z: int, flow: float) -> None:
    """The region flows of the zone MILP and the hops between groups that move them."""
    names = groups.names
    phi = {(layer, g): m.add_col(0, flow) for layer in range(Z + 1) for g in names}
    held: dict[tuple[int, str], list[tuple[int, float, float]]] = {}  # (layer, group) -> (col, T, min(T, NIC))
    sends: dict[tuple[int, str], list[tuple[int, float]]] = {}  # (boundary, group) -> (col, min(T, NIC))
    for ci, cols in cls_cols.items():
        q = groups.classes[ci]
        for j, s, k in cols:
            t = cap.kinds[q.kind].tok_s[k - 1]
            for layer in range(max(s, 0), min(s + k, Z + 1)):
                held.setdefault((layer, q.group), []).append((j, t, min(t, q.nic_tok_s)))
            if 1 <= s + k <= Z:
                sends.setdefault((s + k, q.group), []).append((j, min(t, q.nic_tok_s)))
    for layer in range(Z + 1):
        m.add_row([phi[(layer, g)] for g in names], [1.0] * len(names), flow, flow)
        for g in names:
            items = held.get((layer, g), [])
            m.add_row([phi[(layer, g)]] + [j for j, _, _ in items], [1.0] + [-t for _, t, _ in items], hi=0.0)
    for b in range(1, Z + 1):
        hop = {(u, v): m.add_col(0, flow) for u in names for v in names if u != v and groups.link[(u, v)] > 0}
        for v in names:
            into = [c for (_, h), c in hop.items() if h == v]
            m.add_row([phi[(b, v)], phi[(b - 1, v)]] + into, [1.0, -1.0] + [-1.0] * len(into), hi=0.0)
            recv = held.get((b, v), [])
            m.add_row(into + [j for j, _, _ in recv], [1.0] * len(into) + [-c for _, _, c in recv], hi=0.0)
            out = [c for (g, _), c in hop.items() if g == v]
            snd = sends.get((b, v), [])
            m.add_row(out + [j for j, _ in snd], [1.0] * len(out) + [-c for _, c in snd], hi=0.0)
            m.add_row(out + [phi[(b - 1, v)]], [1.0] * len(out) + [-1.0], hi=0.0)
            up = [c for (g, h), c in hop.items() if g == v and groups.shares_uplink(g, h)]
            if up and v in groups.uplink:
                m.add_row(up, [1.0] * len(up), hi=groups.uplink[v])
            down = [c for (g, h), c in hop.items() if h == v and groups.shares_uplink(g, h)]
            if down and v in groups.downlink:
                m.add_row(down, [1.0] * len(down), hi=groups.downlink[v])
            q_cap = groups.receivers_needed(v, flow)
            if q_cap == 0 or not into:
                continue
            beta = unary_count(m, [j for j, _, _ in recv], q_cap)
            for (u, h), c in hop.items():
                if h == v:
                    cap_by_pairs(m, c, groups.link[(u, v)], beta, ends[b].get(u, []), groups.size[u])


def transition_rules_out(cap: CapacityModel, groups: Groups, flow: float, prices: Mapping[str, float],
                         budget: float, *, margin: float, deadline: Deadline) -> bool | None:
    """True when the argument above proves that no placement reaches ``flow`` (for some group r, every
    zone costs more than the LP's slack + ``margin``); False when it proves nothing; None when a solver
    stopped first. ``prices`` and ``budget`` are the layer-configuration LP's at ``flow``."""
    L = cap.num_layers
    slack = budget - L
    for r in groups.names:
        mu = mixed_excess(cap, groups, r, flow, prices, deadline)
        if mu is None:
            return None
        if mu <= 0:
            continue
        most_mixed = 0 if mu == math.inf else math.floor((slack + TOL) / mu)
        own = sum(prices[q.kind] * q.count for q in groups.classes if q.group == r)
        if most_mixed > MAX_MIXED or min(L - math.floor(budget - own + TOL), L - math.floor(own + TOL)) \
                - most_mixed < 1:
            continue
        proven = True
        for r_first in (True, False):
            for mixed in range(most_mixed + 1):
                res = zone_costs_more(cap, groups, r, r_first=r_first, mixed=mixed, flow=flow, prices=prices,
                                      mixed_cost=mu, limit=slack + margin, deadline=deadline)
                if res is None:
                    return None
                proven = proven and res
                if not proven:
                    break
            if not proven:
                break
        if proven:
            return True
    return False
