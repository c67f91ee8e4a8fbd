"""Upper bounds on the max flow of ANY placement of a cluster, each with a proof method.

1. ``area``: every unit of flow passes every layer, node i spends its capacity on k_i layers,
   so F * L <= sum_i max_k k * T_i(k)  (the paper's network-free bound, 2803.86 on single24).
2. ``coordinator``: the flow leaves the coordinator over its links/NIC and comes back over
   them: F <= min(sum of coordinator out-links, sum of in-links, NIC).
3. ``layer-configurations`` (the tight one). For any placement and any layer l, the nodes
   holding l form a vertex cut, so F <= sum_{i holds l} T_i(k_i). Forget where the strips
   are and keep only *which kinds* (GPU type t, layer count k) cover each layer: a layer is
   covered by a multiset c of kinds whose capacities sum to >= F (a "configuration"; only
   minimal ones are needed). A placement then yields integers n_{t,k} (nodes of type t
   holding k layers) and x_c (layers covered by configuration c) with

       sum_c x_c = L,   sum_c mult_c(t,k) x_c <= k n_{t,k},   sum_k n_{t,k} <= N_t.

   If this small MILP is infeasible at F, no placement reaches F. Its LP relaxation is solved
   by column generation (``configuration_lp_feasible``: one row per GPU type, pricing is a
   covering knapsack) and scales to 100+ nodes; we bisect F and report the smallest F proven
   infeasible. On single24 the LP proves 2045.64 (= the A100's T(8)), exactly the max flow
   the stage search attains; the MILP (``configuration_feasible``, enumerated
   configurations, capacities rounded *up* to multiples of F/Q when there are too many)
   gives the same there and is kept as a cross-check.

4. ``link-aware`` (:mod:`planner.link_bound`, clusters of 2+ regions): the prices of 3's LP
   charge every boundary between two layers; crossing from one region to another over slow
   node-pair links (or shared uplinks and NICs) takes boundaries that cost more than 1, and the
   flow must cross regions (no set of regions carries it alone) - above the bound, more than the
   LP's spare node-layers; or one region's nodes must be entered or left over slow links, and every
   way of doing so costs more than the spare node-layers (:mod:`planner.region_zone`). The proofs are
   in those modules.

3 ignores links (it is a relaxation of the network-free problem); the reported bound is min(1..4).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from helix.perf_model import NETWORK_FREE_BOUND, network_free_bound
from planner.bisection import bisect_unreachable
from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.config_lp import configuration_lp
from planner.link_bound import MAX_GROUPS, Groups, link_bound
from planner.solvers import Model

MAX_CONFIGS = 6000
SUBSET_TOL = 2e-3  # what a set of regions carries alone: coarse is enough (it only caps the crossing LP)


@dataclass(slots=True)
class Bound:
    tok_s: float
    method: str
    proven: bool = True


def area_bound(cap: CapacityModel) -> float:
    """The network-free bound (1 above) over every node's ``T(k)`` up to its layer limit."""
    tables = (cap.kind(n) for n in cap.nodes)
    return network_free_bound((g.tok_s[: g.max_layers] for g in tables), cap.num_layers)


def coordinator_bound(cap: CapacityModel) -> float:
    out = sum(cap.token_link_tok_s(cap.coordinator, n) or 0.0 for n in cap.nodes)
    back = sum(cap.token_link_tok_s(n, cap.coordinator) or 0.0 for n in cap.nodes)
    b = min(out, back)
    if cap.nic_gbps is not None:
        b = min(b, cap.nic_gbps * 1e9 / 8 / cap.token_bytes)
    return b


def _configs(heights: list[float], need: float, limit: int) -> list[tuple[int, ...]] | None:
    """Minimal multisets of indices into ``heights`` summing to >= need; None past ``limit``."""
    order = sorted(range(len(heights)), key=lambda i: -heights[i])
    out: list[tuple[int, ...]] = []
    cur: list[int] = []

    def rec(pos: int, total: float) -> bool:
        if total >= need - 1e-9:
            out.append(tuple(cur))
            return len(out) <= limit
        for p in range(pos, len(order)):
            i = order[p]
            # the remaining items are no taller than heights[i]; prune when even filling with
            # enough copies is pointless is unnecessary: every branch terminates once total>=need
            cur.append(i)
            ok = rec(p, total + heights[i])
            cur.pop()
            if not ok:
                return False
        return True

    return out if rec(0, 0.0) else None


def configuration_feasible(cap: CapacityModel, flow: float, *, time_limit_s: float = 10.0) -> bool | None:
    """Whether the layer-configuration relaxation admits max flow >= ``flow``.

    True/False are proofs (False => no placement reaches ``flow``); None = undecided."""
    kinds = [(t, k) for t in cap.kind_names for k in range(1, cap.kinds[t].max_layers + 1)]
    counts = cap.kind_counts()
    exact_h = [cap.kinds[t].tok_s[k - 1] for t, k in kinds]
    configs = _configs(exact_h, flow, MAX_CONFIGS)
    classes: list[list[int]]  # height class -> kinds in it
    if configs is not None:
        classes = [[q] for q in range(len(kinds))]
    else:
        for quanta in (48, 32, 24, 16, 12, 8):
            unit = flow / quanta
            units = [min(quanta, math.ceil(h / unit - 1e-9)) for h in exact_h]
            levels = sorted(set(units))
            classes = [[q for q in range(len(kinds)) if units[q] == lv] for lv in levels]
            configs = _configs([float(lv) for lv in levels], float(quanta), MAX_CONFIGS)
            if configs is not None:
                break
        else:
            return None
    m = Model()
    n_col = [m.add_col(0, counts[t], integer=True) for t, _ in kinds]
    x_col = [m.add_col(0, cap.num_layers, integer=True) for _ in configs]
    m.add_row(x_col, [1.0] * len(x_col), cap.num_layers, cap.num_layers)
    for ci, members in enumerate(classes):
        idx = [x_col[c] for c, cf in enumerate(configs) if ci in cf]
        val = [float(configs[c].count(ci)) for c, cf in enumerate(configs) if ci in cf]
        idx += [n_col[q] for q in members]
        val += [-float(kinds[q][1]) for q in members]
        m.add_row(idx, val, hi=0.0)
    for t in cap.kind_names:
        idx = [n_col[q] for q, (tt, _) in enumerate(kinds) if tt == t]
        m.add_row(idx, [1.0] * len(idx), hi=counts[t])
    sol = m.solve(time_limit_s=time_limit_s)
    if sol.status == "infeasible":
        return False
    if sol.x:
        return True
    return None


def configuration_lp_feasible(
    cap: CapacityModel, flow: float, *, time_limit_s: float = 10.0, deadline: Deadline | None = None
) -> bool | None:
    """The LP relaxation of the layer-configuration model (3 above; column generation in
    :mod:`planner.config_lp`): False (a proof) when fewer than L layers can be covered at ``flow``.
    Stops undecided (None) at ``deadline`` or after ``time_limit_s``, whichever is first."""
    deadline = (deadline or Deadline.after(time_limit_s)).within(time_limit_s)
    L = float(cap.num_layers)
    got = configuration_lp(cap, flow, deadline, stop_at=L)
    if got is None:
        return None
    return got.covered >= L * (1 - 1e-9)


def configuration_bound(
    cap: CapacityModel, *, lower: float, upper: float, time_limit_s: float = 20.0, rel_tol: float = 1e-5,
    deadline: Deadline | None = None,
) -> float:
    """Bisect the layer-configuration relaxation between a feasible ``lower`` (e.g. an achieved
    max flow) and a valid ``upper``; returns the smallest flow proven unreachable (or ``upper``).
    Stops with what it has proven at ``deadline`` or after ``time_limit_s``."""
    deadline = (deadline or Deadline.after(time_limit_s)).within(time_limit_s)
    lo, hi = lower, upper
    if deadline.expired() or configuration_lp_feasible(cap, hi, deadline=deadline) is not False:
        return upper
    return bisect_unreachable(lambda flow: configuration_lp_feasible(cap, flow, deadline=deadline), lo, hi,
                              rel_tol=rel_tol, deadline=deadline)  # fmt: skip


def cheap_bound(cap: CapacityModel) -> Bound:
    """min(area, coordinator): proven instantly, no solver."""
    area = area_bound(cap)
    coord = coordinator_bound(cap)
    if coord < area:
        return Bound(coord, "coordinator links/NIC")
    return Bound(area, f"area: {NETWORK_FREE_BOUND}")


def subset_bounds(cap: CapacityModel, groups: Groups, deadline: Deadline) -> dict[frozenset[str], float]:
    """Per proper set U of region groups, a network-free bound on what U's nodes carry by themselves
    (0 when they cannot hold the model): the P_U of :mod:`planner.link_bound`."""
    out: dict[frozenset[str], float] = {}
    for u in groups.proper_subsets():
        sub = cap.subset(groups.nodes_of(cap, u))
        if sum(sub.max_layers.values()) < cap.num_layers:
            out[u] = 0.0
            continue
        top = min(area_bound(sub), coordinator_bound(sub))
        out[u] = top if deadline.expired() else configuration_bound(sub, lower=0.0, upper=top, rel_tol=SUBSET_TOL,
                                                                    deadline=deadline)
    return out


def upper_bound(
    cap: CapacityModel, *, achieved: float, time_limit_s: float = 20.0, deadline: Deadline | None = None
) -> Bound:
    """The best bound proven before ``deadline`` (or within ``time_limit_s``): the cheap ones,
    tightened by the layer-configuration LP, then by the link-aware argument when there is time."""
    deadline = (deadline or Deadline.after(time_limit_s)).within(time_limit_s)
    best = cheap_bound(cap)
    cfg = configuration_bound(
        cap, lower=min(achieved, best.tok_s), upper=best.tok_s, time_limit_s=time_limit_s, deadline=deadline
    )
    if cfg < best.tok_s:
        best = Bound(
            cfg,
            "layer-configuration LP (column generation, HiGHS): no mix of per-layer node configurations "
            "lets every layer be covered by nodes summing to more than this (bisection; infeasible above)",
        )
    groups = Groups.of(cap)
    if 2 <= len(groups.names) <= MAX_GROUPS and not deadline.expired():
        alone = functools.cache(lambda: subset_bounds(cap, groups, deadline))
        linked = link_bound(cap, lower=min(achieved, best.tok_s), upper=best.tok_s, alone=alone, deadline=deadline)
        if linked < best.tok_s:
            best = Bound(
                linked,
                "link-aware LP + boundary and zone MILPs (HiGHS): above this, the region crossings the flow needs, "
                "or its passage into or out of one region's nodes, cost more node-layers than the layer-configuration "
                "LP has to spare (bisection; planner.link_bound, planner.region_zone)",
            )
    return best
