"""Helix's placement optimizer: :func:`optimize` (pure; progress through a callback).

The paper's MILP is weak for open-source solvers; we split the work (docs/planner-optimizer.md):

1. **Bound** (``planner.bounds``): the layer-configuration MILP proves an upper bound on the
   max flow of any placement (2045.64 tok/s on single24, vs. the network-free 2803.86).
2. **Construction** (``planner.stages``): the stage-pattern MILP, bisected on the target
   flow, builds stage plans (per region too, for geo clusters); warm starts and baselines
   join the candidate pool.
3. **Polish** (``planner.local_search``): iterated local search, every move judged by the
   exact max flow (``planner.graph``) or, for ``objective="serving"``, by the serving
   estimate (``planner.serving_model``) computed on the exact max-flow solution.

Status: ``optimal`` when the max-flow incumbent meets the proven bound (within 1e-4),
``bound_gap`` when stopped by ``stop_at_bound_gap``, else ``time_limit``.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from helix.errors import InfeasiblePlanError
from helix.plan import FlowEdge
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner import bounds, stages
from planner.flows import balanced_flows
from planner.highs_model import highs_version
from planner.instance import Instance, Placement
from planner.local_search import Evaluator, Scored, improve
from planner.progress import Progress
from planner.serving_model import ServingModel, Workload

OPTIMAL_TOL = 1e-4




@dataclass(slots=True)
class OptimizeResult:
    placement: dict[str, tuple[int, int]]
    max_flow_tok_s: float
    upper_bound_tok_s: float
    bound_method: str
    status: str
    solver: str
    score: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    flows: list[FlowEdge] = field(default_factory=list)  # balanced max flow: use as the plan's flows


def _reporter(on_progress: Callable[..., None] | None, t0: float) -> Callable[[float | None, float | None, str], None]:
    if on_progress is None:
        return lambda inc, bnd, msg: None
    try:
        params = [
            p for p in inspect.signature(on_progress).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        three = len(params) >= 3
    except (TypeError, ValueError):
        three = False

    def report(inc: float | None, bnd: float | None, msg: str) -> None:
        el = time.monotonic() - t0
        if three:
            on_progress(inc, bnd, el)
        else:
            on_progress(Progress(inc, bnd, el, msg))

    return report


def _phase(name: str, s: Scored, serving: bool) -> str:
    return f"{name}; serving estimate {s.key[0]:.1f} decode tok/s" if serving else name


def _warm_list(warm_start: Any) -> list[Placement]:
    if warm_start is None:
        return []
    if isinstance(warm_start, dict):
        warm_start = [warm_start]
    return [{n: (int(r[0]), int(r[1])) for n, r in w.items()} for w in warm_start if w]


def stage_candidates(inst: Instance, *, deadline: float, lo: float, hi: float, serving: bool) -> list[Placement]:
    """Stage plans: the best-flow one (fewest nodes per stage, leftovers reinforcing), and for
    the serving objective also the fewest-stage plans at a ladder of lower targets."""
    out: list[Placement] = []
    best = stages.best_stage_plan(inst, lo=lo, hi=hi, deadline=deadline)
    if best is None:
        return out
    f_best, plan = best
    out.append(stages.to_placement(inst, plan))
    if serving:  # the best stage plan of every depth from the shallowest possible to len(plan)
        shallow = stages.solve_stages(inst, 1e-6, minimize="stages", time_limit_s=2.0)
        depth_lo = len(shallow) if shallow else 1
        for depth in range(depth_lo, len(plan)):
            if time.monotonic() >= deadline:
                break
            got = stages.best_stage_plan(inst, lo=0.0, hi=f_best, deadline=deadline, max_stages=depth, rel_tol=1e-3)
            if got:
                out.append(stages.to_placement(inst, got[1]))
    return out


def optimize(
    cluster: ClusterSpec,
    profiles: ProfileSet,
    *,
    objective: Literal["serving", "max-flow"] = "serving",
    time_limit_s: float = 60.0,
    threads: int = 2,
    partial_handoffs: bool = True,
    prune_links: float | None = None,
    warm_start: Placement | list[Placement] | None = None,
    stop_at_bound_gap: float | None = None,
    seed: int = 0,
    on_progress: Callable[..., None] | None = None,
    workload: Workload | None = None,
) -> OptimizeResult:
    """Search a placement of ``cluster`` for ``objective`` within ``time_limit_s`` seconds."""
    t0 = time.monotonic()
    deadline = t0 + max(1.0, time_limit_s) * 0.97
    report = _reporter(on_progress, t0)
    inst = Instance.build(cluster, profiles)
    if prune_links:
        inst = inst.pruned(prune_links)
    if sum(inst.max_layers(n) for n in inst.nodes) < inst.num_layers:
        raise InfeasiblePlanError(f"the nodes together hold fewer than the model's {inst.num_layers} layers")
    serving = objective == "serving"
    sm = ServingModel(inst, workload) if serving else None
    ev = Evaluator(inst, objective, partial_handoffs=partial_handoffs, serving_model=sm)
    flow_ev = Evaluator(inst, "max-flow", partial_handoffs=partial_handoffs)

    # 1. candidates: stage plans (whole cluster and, for geo clusters, region by region)
    coarse = min(bounds.area_bound(inst), bounds.coordinator_bound(inst))
    report(None, coarse, "construction")
    cands: list[Placement] = list(_warm_list(warm_start))
    sdl = time.monotonic() + max(0.5, 0.15 * time_limit_s)
    cands += stage_candidates(inst, deadline=sdl, lo=0.0, hi=coarse * (1 + 1e-6), serving=serving)
    regions = inst.regions()
    if len(regions) > 1 and not inst.links_uniform():
        per_region: Placement = {}
        for r in regions:
            sub = inst.subset([n for n in inst.nodes if inst.region_of[n] == r])
            if sum(sub.max_layers(n) for n in sub.nodes) < inst.num_layers:
                continue
            sub_hi = min(coarse, bounds.area_bound(sub))
            region_plans = stage_candidates(
                sub, deadline=time.monotonic() + 0.05 * time_limit_s, lo=0.0, hi=sub_hi, serving=False
            )
            if region_plans:
                per_region.update(region_plans[0])
        if per_region:
            for n in inst.nodes:  # nodes of regions that cannot hold the model: copy a neighbour range
                if n not in per_region:
                    per_region[n] = (0, min(inst.max_layers(n), inst.num_layers))
            cands.append(per_region)
    valid = [c for c in cands if ev.valid(c) and set(c) <= set(inst.nodes)]
    if not valid:
        raise InfeasiblePlanError("no candidate placement covers every layer")
    scored = sorted((ev.score(c) for c in valid), key=lambda s: s.key, reverse=True)
    best: Scored = scored[0]

    # 2. the proven bound, bisected up from the best max flow found so far
    achieved = max(s.max_flow for s in scored)
    budget = max(0.5, min(0.1 * time_limit_s, deadline - time.monotonic()))
    bound = bounds.upper_bound(inst, achieved=achieved, time_limit_s=budget)
    report(best.max_flow, bound.tok_s, _phase("bound", best, serving))

    # 3. polish: local search from the best candidates, exact evaluation of every move
    target = None
    if not serving and stop_at_bound_gap is not None:
        target = bound.tok_s / (1 + stop_at_bound_gap) - 1e-9
    if not serving and best.max_flow >= bound.tok_s * (1 - OPTIMAL_TOL):
        target = best.key[0]

    def on_improve(s: Scored) -> None:
        top = s if s.key > best.key else best
        report(top.max_flow, bound.tok_s, _phase("local search", top, serving))

    if not serving and not ev.coverage_exact and (target is None or best.key[0] < target):
        # links may bind: first search the network-free relaxation (microseconds per move),
        # then keep its result only if the exact max flow agrees that it is better
        relaxed = Evaluator(inst, "max-flow", partial_handoffs=partial_handoffs)
        relaxed.coverage_exact = True
        share = 0.4 * (deadline - time.monotonic())
        got = improve(relaxed, best.placement, deadline=time.monotonic() + share, seed=seed, target=target)
        exact = ev.score(got.placement)
        if exact.key > best.key:
            best = exact
            on_improve(best)
        scored = sorted([best, *scored], key=lambda s: s.key, reverse=True)
    starts = scored[: 3]
    for i, st in enumerate(starts):
        if time.monotonic() >= deadline or (target is not None and best.key[0] >= target):
            break
        share = (deadline - time.monotonic()) / (len(starts) - i)
        got = improve(ev, st.placement, deadline=time.monotonic() + share, seed=seed + i, target=target,
                      on_improve=on_improve)
        if got.key > best.key:
            best = got

    # 4. exact check, status (the bound is final: the search does not move it)
    mf = flow_ev.exact_max_flow(best.placement)
    final_bound = bound
    if mf >= final_bound.tok_s * (1 - OPTIMAL_TOL):
        status = "optimal" if not serving else "max_flow_optimal"
    elif stop_at_bound_gap is not None and mf * (1 + stop_at_bound_gap) >= final_bound.tok_s:
        status = "bound_gap"
    else:
        status = "time_limit"
    score: dict[str, float] = {"max_flow_tok_s": mf}
    if sm is not None:
        est = best.serving if best.serving is not None else ev.score(best.placement).serving
        if est is not None:
            score.update(
                decode_tok_s=est.decode_tok_s,
                requests_in_flight=est.requests_in_flight,
                round_trip_ms=est.mean_round_trip_ms,
                mean_hops=est.mean_hops,
            )
    report(mf, final_bound.tok_s, "done")
    stats = {
        "objective": objective,
        "evaluations": ev.evaluations + flow_ev.evaluations,
        "candidates": len(valid),
        "coverage_min_tok_s": inst.coverage_min(best.placement),
        "wall_s": round(time.monotonic() - t0, 3),
        "serving_binding": best.serving.binding if best.serving is not None else None,
    }
    _, flows = balanced_flows(inst.cap, best.placement, partial_handoffs=partial_handoffs, value=mf)
    return OptimizeResult(
        flows=flows,
        placement=dict(sorted(best.placement.items())),
        max_flow_tok_s=mf,
        upper_bound_tok_s=final_bound.tok_s,
        bound_method=final_bound.method,
        status=status,
        solver=f"stage-pattern MILP + local search ({highs_version()})",
        score=score,
        stats=stats,
    )
