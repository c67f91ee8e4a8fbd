"""Stage decompositions: the pattern MILP that builds placements from scratch.

A *stage* is a layer segment [a, a+m) held in full by a group of nodes; a stage plan tiles
[0, L) with stages, so its network-free max flow is the weakest stage's capacity
sum_{i in stage} T_i(m). For a target flow F a *pattern* (:class:`StagePattern`) is (m, composition c)
with c_t nodes of kind t (GPU type and layer cap, each able to hold m layers) and
sum_t c_t T_t(m) >= F, kept minimal.
The pattern MILP (integer z_p = how many stages use pattern p)::

    sum_p m_p z_p = L,    sum_p c_{p,t} z_p <= N_t  (every type t),
    minimize  sum_p z_p            (fewest stages: short pipelines)   or
              sum_p |c_p| z_p      (fewest nodes: most left over to reinforce weak stages)

has a handful of rows and is solved by HiGHS in milliseconds. Symmetry among identical GPUs
is gone by construction (only counts per type appear). Bisection on F gives the best stage
plan; leftover nodes then join stages. ``to_placement`` turns a stage plan into node ranges,
keeping stages inside one region where it can (geo clusters).
"""

from __future__ import annotations

from dataclasses import dataclass

from helix.domain import LayerRange, Placement
from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.solvers import Model

MAX_PATTERNS = 30000


@dataclass(slots=True)
class StagePattern:
    """A stage of a stage plan as the pattern MILP sees it: ``layers`` consecutive layers held in full by
    ``members`` (node kind -> how many nodes), not yet any node in particular (``to_placement`` picks them;
    the pipeline stage a request runs is :class:`helix.domain.Stage`)."""

    layers: int
    members: dict[str, int]  # node kind -> node count


def patterns(cap: CapacityModel, flow: float, *, max_stage_layers: int | None = None) -> list[StagePattern] | None:
    counts = cap.kind_counts()
    out: list[StagePattern] = []
    top = max(g.max_layers for g in cap.kinds.values())
    if max_stage_layers is not None:
        top = min(top, max_stage_layers)
    for m in range(1, top + 1):
        kinds = sorted((t for t in cap.kind_names if cap.kinds[t].max_layers >= m), key=lambda t: -cap.kinds[t].tok_s[m - 1])
        heights = [cap.kinds[t].tok_s[m - 1] for t in kinds]
        if sum(h * counts[t] for h, t in zip(heights, kinds, strict=True)) < flow:
            continue
        cur = [0] * len(kinds)

        def rec(pos: int, total: float, cur: list[int] = cur, kinds: list[str] = kinds, heights: list[float] = heights,
                m: int = m) -> bool:
            if total >= flow - 1e-9:
                out.append(StagePattern(m, {kinds[i]: c for i, c in enumerate(cur) if c}))
                return len(out) <= MAX_PATTERNS
            rest = sum(heights[i] * (counts[kinds[i]] - cur[i]) for i in range(pos, len(kinds)))
            if total + rest < flow - 1e-9:
                return True
            for i in range(pos, len(kinds)):
                if cur[i] < counts[kinds[i]]:
                    cur[i] += 1
                    ok = rec(i, total + heights[i])
                    cur[i] -= 1
                    if not ok:
                        return False
            return True

        if not rec(0, 0.0):
            return None
    return out


def solve_stages(
    cap: CapacityModel,
    flow: float,
    *,
    minimize: str = "nodes",
    max_stages: int | None = None,
    max_stage_layers: int | None = None,
    time_limit_s: float = 5.0,
) -> list[StagePattern] | None:
    """A stage plan whose every stage reaches ``flow`` (network-free), or None."""
    pats = patterns(cap, flow, max_stage_layers=max_stage_layers)
    if not pats:
        return None
    counts = cap.kind_counts()
    m = Model()
    cols = []
    for p in pats:
        size = sum(p.members.values())
        cost = 1.0 + 1e-3 * size if minimize == "stages" else size + 1e-3
        cols.append(m.add_col(0, cap.num_layers, cost=cost, integer=True))
    m.add_row(cols, [float(p.layers) for p in pats], cap.num_layers, cap.num_layers)
    for t in cap.kind_names:
        idx = [cols[j] for j, p in enumerate(pats) if t in p.members]
        if idx:
            m.add_row(idx, [float(pats[j].members[t]) for j, p in enumerate(pats) if t in p.members], hi=counts[t])
    if max_stages is not None:
        m.add_row(cols, [1.0] * len(cols), hi=max_stages)
    sol = m.solve(time_limit_s=time_limit_s)
    if not sol.x:
        return None
    stages: list[StagePattern] = []
    for j, p in enumerate(pats):
        for _ in range(int(round(sol.x[cols[j]]))):
            stages.append(StagePattern(p.layers, dict(p.members)))
    return stages


def best_stage_plan(
    cap: CapacityModel, *, lo: float, hi: float, deadline: Deadline, minimize: str = "nodes",
    max_stages: int | None = None, rel_tol: float = 2e-4,
) -> tuple[float, list[StagePattern]] | None:
    """Bisection on the target flow: the best stage plan found before ``deadline`` (every
    MILP gets at most the time left, and none starts after it)."""
    best: tuple[float, list[StagePattern]] | None = None
    while hi - lo > rel_tol * max(hi, 1.0) and not deadline.expired():
        mid = (lo + hi) / 2 if best is not None or lo > 0 else hi * 0.5
        st = solve_stages(cap, mid, minimize=minimize, max_stages=max_stages, time_limit_s=deadline.solver_limit(10.0))
        if st is None:
            hi = mid
        else:
            got = stage_flow(cap, st)
            if best is None or got > best[0]:
                best = (got, st)
            lo = max(mid, got)
    if best is None and lo > 0 and not deadline.expired():
        st = solve_stages(cap, lo, minimize=minimize, max_stages=max_stages, time_limit_s=deadline.solver_limit(5.0))
        return (lo, st) if st else None
    return best


def stage_flow(cap: CapacityModel, stages: list[StagePattern]) -> float:
    return min(sum(cap.kinds[t].tok_s[s.layers - 1] * c for t, c in s.members.items()) for s in stages)


def to_placement(cap: CapacityModel, stages: list[StagePattern], *, use_leftovers: bool = True) -> Placement:
    """Node ranges for a stage plan. Stages go in order of decreasing length (deep stages on
    big GPUs first); nodes are drawn region by region so a stage stays in one region when the
    counts allow; leftover nodes reinforce the weakest stage they can hold."""
    stages = sorted(stages, key=lambda s: (-s.layers, sorted(s.members.items())))
    free: dict[str, list[str]] = {t: list(v) for t, v in cap.kind_nodes.items()}
    regions = cap.regions()
    members: list[list[str]] = []
    prev_region: str | None = None
    for st in stages:
        # pick the region that can supply the most of this stage, preferring the previous one
        def supply(r: str | None, st: StagePattern = st, prev: str | None = prev_region) -> tuple[int, bool]:
            n = sum(min(c, sum(1 for x in free[t] if cap.region_of[x] == r)) for t, c in st.members.items())
            return (n, r == prev)

        region = max(regions, key=supply)
        chosen: list[str] = []
        for t, c in st.members.items():
            pool = sorted(free[t], key=lambda x: (cap.region_of[x] != region, cap.nodes.index(x)))
            take = pool[:c]
            chosen.extend(take)
            for x in take:
                free[t].remove(x)
        members.append(chosen)
        prev_region = region
    placement: Placement = {}
    start = 0
    bounds_: list[LayerRange] = []
    for st, group in zip(stages, members, strict=True):
        for node in group:
            placement[node] = LayerRange(start, start + st.layers)
        bounds_.append(LayerRange(start, start + st.layers))
        start += st.layers
    if use_leftovers:
        caps = [sum(cap.node_capacity(n, st.layers) for n in g) for st, g in zip(stages, members, strict=True)]
        left = [n for t in cap.kind_names for n in free[t]]
        left.sort(key=lambda n: -cap.node_capacity(n, 1))
        for node in left:
            options = [j for j, st in enumerate(stages) if st.layers <= cap.max_layers[node]]
            if not options:
                continue
            j = min(options, key=lambda j: caps[j])
            placement[node] = bounds_[j]
            caps[j] += cap.node_capacity(node, stages[j].layers)
    return placement
