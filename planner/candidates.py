"""The optimizer's candidates (``planner.optimize``): the pool that scores them and keeps the
incumbent, and the construction phase that fills it.

Construction scores the warm starts first (the user's placement, the baselines), so an incumbent
exists within moments, then, for geo clusters whose links are not uniform, the region chains
(``planner.region_chains``: each region visited once, crossings wide enough for the slow links; also
separate chains side by side), then the stage plans of the stage-pattern MILP (``planner.stages``)
for the whole cluster and, on geo clusters, stage plans region by region. At least
one candidate is always scored, even when the deadline comes first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from helix.domain import LayerRange, Placement, as_placement
from helix.errors import InfeasiblePlanError
from planner import bounds, region_chains, stages
from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.local_search import Evaluator, Scored

CONSTRUCTION_SHARE = 0.15  # the stage-plan bisection's share of the limit (at least 0.5 s)
SCORING_SHARE = 0.5  # construction stops scoring candidates after this share of the limit (at least 0.5 s)

Report = Callable[[Scored | None, float | None, str], None]
"""``report(incumbent, bound, phase)``: a new incumbent or phase, for the caller's progress line."""


class CandidatePool:
    """The scored candidates and the incumbent; every new best is reported at once."""

    def __init__(self, ev: Evaluator, report: Report, nodes: set[str]) -> None:
        self.ev, self.report, self.nodes = ev, report, nodes
        self.scored: dict[frozenset[tuple[str, LayerRange]], Scored] = {}
        self.best: Scored | None = None
        self.bound: float | None = None

    def add(self, placement: Placement, phase: str) -> None:
        if not (set(placement) <= self.nodes and self.ev.valid(placement)):
            return
        self.offer(self.ev.score(placement), phase)

    def offer(self, s: Scored, phase: str) -> bool:
        self.scored.setdefault(frozenset(s.placement.items()), s)
        if self.best is None or s.key > self.best.key:
            self.best = s
            self.report(s, self.bound, phase)
            return True
        return False

    def top(self, n: int) -> list[Scored]:
        return sorted(self.scored.values(), key=lambda s: s.key, reverse=True)[:n]


def warm_placements(
    warm_start: Mapping[str, tuple[int, int]] | Sequence[Mapping[str, tuple[int, int]]] | None,
) -> list[Placement]:
    """The warm starts as placements (one, a list, or none; empty ones dropped)."""
    if warm_start is None:
        return []
    if isinstance(warm_start, Mapping):
        warm_start = [warm_start]
    return [as_placement(w) for w in warm_start if w]


def construct(pool: CandidatePool, cap: CapacityModel, warm: list[Placement], *, search: Deadline, limit: float,
              coarse: float, serving: bool) -> None:
    """The construction phase: warm starts, then stage plans (module docstring), into ``pool``."""
    for w in warm:
        if pool.best is not None and search.expired():
            break
        pool.add(w, "warm start / baselines")
    scoring = search.within(max(0.5, SCORING_SHARE * limit))  # leave the rest to the bound and search
    geo = len(cap.regions()) > 1 and not cap.links_uniform()
    if geo and not scoring.expired():  # first: where links bind they are the strong candidates (and cheap)
        build = search.within(max(0.5, CONSTRUCTION_SHARE * limit))
        for c in region_chains.chain_candidates(cap, deadline=build, lo=0.0, hi=coarse * (1 + 1e-6),
                                                  serving=serving):
            if scoring.expired():
                break
            pool.add(c, "construction: region chains")
        for c in region_chains.parallel_candidates(cap, deadline=build, serving=serving):
            if scoring.expired():
                break
            pool.add(c, "construction: separate region chains")
    if not scoring.expired():
        build = search.within(max(0.5, CONSTRUCTION_SHARE * limit))
        for c in stage_candidates(cap, deadline=build, lo=0.0, hi=coarse * (1 + 1e-6), serving=serving):
            if scoring.expired():
                break
            pool.add(c, "construction: stage plans")
    if geo and not scoring.expired():
        per_region = per_region_candidate(cap, search.within(0.05 * limit), coarse)
        if per_region:
            pool.add(per_region, "construction: per-region stage plans")
    if pool.best is None:
        for w in warm:  # nothing scored yet: the deadline came first
            pool.add(w, "warm start / baselines")
            if pool.best is not None:
                break
    if pool.best is None:
        raise InfeasiblePlanError("no candidate placement covers every layer")


def stage_candidates(cap: CapacityModel, *, deadline: Deadline, lo: float, hi: float, serving: bool) -> list[Placement]:
    """Stage plans: the best-flow one (fewest nodes per stage, leftovers reinforcing), and for
    the serving objective also the fewest-stage plans at a ladder of lower targets."""
    out: list[Placement] = []
    best = stages.best_stage_plan(cap, lo=lo, hi=hi, deadline=deadline)
    if best is None:
        return out
    f_best, plan = best
    out.append(stages.to_placement(cap, plan))
    if serving and not deadline.expired():  # the best stage plan of every depth, shallowest first
        shallow = stages.solve_stages(cap, 1e-6, minimize="stages", time_limit_s=deadline.solver_limit(2.0))
        depth_lo = len(shallow) if shallow else 1
        for depth in range(depth_lo, len(plan)):
            if deadline.expired():
                break
            got = stages.best_stage_plan(cap, lo=0.0, hi=f_best, deadline=deadline, max_stages=depth, rel_tol=1e-3)
            if got:
                out.append(stages.to_placement(cap, got[1]))
    return out


def per_region_candidate(cap: CapacityModel, deadline: Deadline, coarse: float) -> Placement | None:
    """Stage plans region by region (geo clusters), joined into one placement."""
    per_region: Placement = {}
    for r in cap.regions():
        if deadline.expired():
            break
        sub = cap.subset([n for n in cap.nodes if cap.region_of[n] == r])
        if sum(sub.max_layers[n] for n in sub.nodes) < cap.num_layers:
            continue
        sub_hi = min(coarse, bounds.area_bound(sub))
        region_plans = stage_candidates(sub, deadline=deadline, lo=0.0, hi=sub_hi, serving=False)
        if region_plans:
            per_region.update(region_plans[0])
    if not per_region:
        return None
    for n in cap.nodes:  # nodes of regions that cannot hold the model: copy a neighbour range
        if n not in per_region:
            per_region[n] = LayerRange(0, min(cap.max_layers[n], cap.num_layers))
    return per_region
