"""Helix's placement optimizer: :func:`optimize` (pure; progress through a callback).

The paper's MILP is weak for open-source solvers; we split the work (docs/planner-optimizer.md):

1. **Construction** (``planner.stages``): the warm starts (the user's, the baselines) are
   scored first, so an incumbent exists within moments; then the stage-pattern MILP,
   bisected on the target flow, builds stage plans (per region too, for geo clusters).
2. **Bound** (``planner.bounds``): the layer-configuration MILP proves an upper bound on the
   max flow of any placement (2045.64 tok/s on single24, vs. the network-free 2803.86).
3. **Polish** (``planner.local_search``): iterated local search, every move judged by the
   exact max flow (``planner.graph``) or, for ``objective="serving"``, by the serving
   estimate (``planner.serving_model``) computed on the exact max-flow solution: the mean of
   the estimates under the plan's balanced flows and under the flows the paper's simulator
   recomputes (``planner.flows.judge_flows``; ``score["judge_decode_tok_s"]``).
4. **Simulated refinement** (``planner.simulated``, objective ``serving``, on by default): the
   model's best few placements, and small moves of the best, are judged by a short run of our
   simulator under the plan's and the judge's flows; the search returns the one whose lower
   simulated decode tok/s is highest (``score["simulated_decode_tok_s"]`` and
   ``["simulated_judge_decode_tok_s"]``). It gets :data:`SIMULATE_SHARE` of the time limit, and
   all the search before it leaves: with it, the search's default stall window is
   ``planner.budget.STALL_MIN_S``.

One :class:`~planner.budget.Deadline` bounds the whole call: every phase (each MILP, the
serving evaluation's QP/LP, the bound, the search) gets at most the time left, and
:data:`FINISH_SHARE` of the limit is kept for the final exact check and balanced flows.
The search stops early when the incumbent meets the proven bound (max-flow objective) or
has not improved for the stall window (``planner.budget``); ``stats["stop_reason"]`` says
which (``bound_met`` / ``stalled`` / ``time_limit``).

Status: ``optimal`` when the max-flow incumbent meets the proven bound (within 1e-4;
``max_flow_optimal`` under the serving objective), ``bound_gap`` when within
``stop_at_bound_gap``, else ``feasible``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from helix.errors import InfeasiblePlanError
from helix.plan import FlowEdge
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner import bounds, stages
from planner.budget import (
    BOUND_MET,
    BOUND_REL_TOL,
    STALL_MIN_S,
    STALLED,
    TIME_LIMIT,
    Clock,
    Deadline,
    StallWatch,
    stall_window_s,
)
from planner.flows import balance
from planner.graph import evaluate
from planner.highs_model import highs_version
from planner.instance import Instance, Placement
from planner.local_search import SERVING_MIN_GAIN, Evaluator, Scored, improve
from planner.progress import Progress
from planner.serving_model import ServingModel, Workload
from planner.simulated import Refined, Refinement, RunSimulation, SimScorer, Simulated, refine, simulable

OPTIMAL_TOL = BOUND_REL_TOL
FINISH_SHARE = 0.1  # of the time limit, kept for the final exact check and balanced flows ...
FINISH_MAX_S = 3.0  # ... but never more than this
CONSTRUCTION_SHARE = 0.15  # the stage-plan bisection's share of the limit (at least 0.5 s)
SCORING_SHARE = 0.5  # construction stops scoring candidates after this share of the limit (at least 0.5 s)
BOUND_SHARE = 0.1  # the layer-configuration bound's share of the limit (at least 0.5 s)
SIMULATE_SHARE = 0.4  # the simulated refinement's share of the limit (the search before it stops earlier)


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
    stop_reason: str = TIME_LIMIT


Report = Callable[[Scored | None, float | None, str], None]


def _reporter(on_progress: Callable[..., None] | None, t0: float, clock: Clock) -> Report:
    """``report(incumbent, bound, phase)`` -> the caller's callback (a :class:`Progress`, or
    ``(incumbent, bound, elapsed)`` for a three-argument callback)."""
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

    def report(inc: Scored | None, bnd: float | None, msg: str) -> None:
        el = clock() - t0
        mf = inc.max_flow if inc is not None else None
        if three:
            on_progress(mf, bnd, el)
        else:
            est = inc.serving.decode_tok_s if inc is not None and inc.serving is not None else None
            on_progress(Progress(mf, bnd, el, msg, serving_tok_s=est))

    return report


def _warm_list(warm_start: Any) -> list[Placement]:
    if warm_start is None:
        return []
    if isinstance(warm_start, dict):
        warm_start = [warm_start]
    return [{n: (int(r[0]), int(r[1])) for n, r in w.items()} for w in warm_start if w]


def stage_candidates(inst: Instance, *, deadline: Deadline, lo: float, hi: float, serving: bool) -> list[Placement]:
    """Stage plans: the best-flow one (fewest nodes per stage, leftovers reinforcing), and for
    the serving objective also the fewest-stage plans at a ladder of lower targets."""
    out: list[Placement] = []
    best = stages.best_stage_plan(inst, lo=lo, hi=hi, deadline=deadline)
    if best is None:
        return out
    f_best, plan = best
    out.append(stages.to_placement(inst, plan))
    if serving and not deadline.expired():  # the best stage plan of every depth, shallowest first
        shallow = stages.solve_stages(inst, 1e-6, minimize="stages", time_limit_s=deadline.solver_limit(2.0))
        depth_lo = len(shallow) if shallow else 1
        for depth in range(depth_lo, len(plan)):
            if deadline.expired():
                break
            got = stages.best_stage_plan(inst, lo=0.0, hi=f_best, deadline=deadline, max_stages=depth, rel_tol=1e-3)
            if got:
                out.append(stages.to_placement(inst, got[1]))
    return out


class _Pool:
    """The scored candidates and the incumbent; every new best is reported at once."""

    def __init__(self, ev: Evaluator, report: Report, nodes: set[str]) -> None:
        self.ev, self.report, self.nodes = ev, report, nodes
        self.scored: dict[frozenset[tuple[str, tuple[int, int]]], Scored] = {}
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
    deadline: Deadline | None = None,
    stall_s: float | None = None,
    simulate: bool | Refinement = True,
    simulator: RunSimulation | None = None,
) -> OptimizeResult:
    """Search a placement of ``cluster`` for ``objective`` by ``deadline`` (default: within
    ``time_limit_s`` seconds from now); stop earlier when the bound is met or the search has
    not improved for ``stall_s`` seconds (default :func:`planner.budget.stall_window_s`).
    ``simulate`` (objective ``serving``): end with the simulated refinement (``planner.simulated``;
    a :class:`~planner.simulated.Refinement` sets its window, seed, candidates and patience) when a
    ``simulator`` is given (``simulator.short_run.run_short``) and the cluster's GPUs have latency curves."""
    deadline = deadline if deadline is not None else Deadline.after(time_limit_s)
    clock = deadline.clock
    t0 = clock()
    limit = max(deadline.remaining(), 1e-3)
    search = deadline.within(limit - min(FINISH_MAX_S, max(0.05, FINISH_SHARE * limit)))
    report = _reporter(on_progress, t0, clock)
    inst = Instance.build(cluster, profiles)
    if prune_links:
        inst = inst.pruned(prune_links)
    if sum(inst.max_layers(n) for n in inst.nodes) < inst.num_layers:
        raise InfeasiblePlanError(f"the nodes together hold fewer than the model's {inst.num_layers} layers")
    serving = objective == "serving"
    sm = ServingModel(inst, workload) if serving else None
    ev = Evaluator(inst, objective, partial_handoffs=partial_handoffs, serving_model=sm, deadline=search)
    flow_ev = Evaluator(inst, "max-flow", partial_handoffs=partial_handoffs)
    pool = _Pool(ev, report, set(inst.nodes))
    coarse = bounds.cheap_bound(inst)
    pool.bound = coarse.tok_s
    report(None, coarse.tok_s, "construction")

    # 1. candidates: the warm starts first (an incumbent at once), then stage plans (whole
    #    cluster and, for geo clusters, region by region); at least one is always scored
    for w in _warm_list(warm_start):
        if pool.best is not None and search.expired():
            break
        pool.add(w, "warm start / baselines")
    scoring = search.within(max(0.5, SCORING_SHARE * limit))  # leave the rest to the bound and search
    if not scoring.expired():
        construct = search.within(max(0.5, CONSTRUCTION_SHARE * limit))
        for c in stage_candidates(inst, deadline=construct, lo=0.0, hi=coarse.tok_s * (1 + 1e-6), serving=serving):
            if scoring.expired():
                break
            pool.add(c, "construction: stage plans")
    regions = inst.regions()
    if len(regions) > 1 and not inst.links_uniform() and not scoring.expired():
        per_region = _per_region_candidate(inst, search.within(0.05 * limit), coarse.tok_s)
        if per_region:
            pool.add(per_region, "construction: per-region stage plans")
    if pool.best is None:
        for w in _warm_list(warm_start):  # nothing scored yet: the deadline came first
            pool.add(w, "warm start / baselines")
            if pool.best is not None:
                break
    if pool.best is None:
        raise InfeasiblePlanError("no candidate placement covers every layer")

    # 2. the proven bound, bisected up from the best max flow found so far
    achieved = max(s.max_flow for s in pool.scored.values())
    bound = bounds.upper_bound(inst, achieved=achieved, deadline=search.within(max(0.5, BOUND_SHARE * limit)))
    pool.bound = bound.tok_s
    best = pool.best
    report(best, bound.tok_s, "bound")

    # 3. polish: local search from the best candidates, exact evaluation of every move, until
    #    the bound is met, the search stalls or the time is up
    target = None
    if not serving and stop_at_bound_gap is not None:
        target = bound.tok_s / (1 + stop_at_bound_gap) - 1e-9
    if not serving and best.max_flow >= bound.tok_s * (1 - OPTIMAL_TOL):
        target = best.key[0]
    refining = serving and simulate is not False and simulator is not None and simulable(cluster, profiles)
    # with the simulated refinement after it, the model's search stops after STALL_MIN_S without a gain
    # unless told otherwise: a simulated candidate is worth more than more of the model's search
    watch = StallWatch(clock, stall_window_s(limit, stall_s) if stall_s is not None or not refining else STALL_MIN_S)
    stalled = {"yes": False}

    def stop() -> bool:
        if watch.stalled():
            stalled["yes"] = True
        return stalled["yes"]

    anchor = [best]  # the incumbent when the stall window last restarted

    def on_improve(s: Scored) -> None:
        if pool.offer(s, "local search") and _progress(anchor[0], s, serving):
            anchor[0] = s
            watch.improved()

    reserve = SIMULATE_SHARE * limit if refining else 0.0
    polish = search.within(max(0.0, search.remaining() - reserve), stop=stop)
    if not serving and not ev.coverage_exact and (target is None or best.key[0] < target) and not polish.expired():
        # links may bind: first search the network-free relaxation (microseconds per move),
        # then keep its result only if the exact max flow agrees that it is better
        relaxed = Evaluator(inst, "max-flow", partial_handoffs=partial_handoffs)
        relaxed.coverage_exact = True
        got = improve(relaxed, best.placement, deadline=polish.share(0.4), seed=seed, target=target,
                      on_improve=lambda s: watch.improved())
        exact = ev.score(got.placement)
        if exact.key > best.key:
            pool.offer(exact, "local search (relaxation)")
    starts = pool.top(3)
    for i, st in enumerate(starts):
        best = pool.best
        assert best is not None
        if polish.expired() or (target is not None and best.key[0] >= target):
            break
        got = improve(ev, st.placement, deadline=polish.share(1.0 / (len(starts) - i)), seed=seed + i,
                      target=target, on_improve=on_improve)
        pool.offer(got, "local search")
    best = pool.best
    assert best is not None
    stats: dict[str, Any] = {"candidates": len(pool.scored), "stall_window_s": watch.window_s}
    refined = None
    if refining and simulator is not None and not search.expired():
        settings = simulate if isinstance(simulate, Refinement) else Refinement()
        refined = _refine(cluster, profiles, inst, ev, pool, search, settings, simulator, seed=seed,
                          partial_handoffs=partial_handoffs, report=report)
        if refined is not None:
            best = refined.best
            stalled["yes"] = refined.stop_reason != "time_limit"
            stats.update(simulations=refined.simulations, simulated_stop=refined.stop_reason,
                         model_choice_simulated_tok_s=round(refined.model_choice.score, 1))
    return _finish(inst, best, bound, objective=objective, stop_at_bound_gap=stop_at_bound_gap,
                   stalled=stalled["yes"], deadline=deadline, t0=t0, flow_ev=flow_ev, ev=ev, sm=sm, report=report,
                   stats=stats, simulated=refined.simulated if refined is not None else None)


def _refine(cluster: ClusterSpec, profiles: ProfileSet, inst: Instance, ev: Evaluator, pool: _Pool,
            deadline: Deadline, settings: Refinement, simulator: RunSimulation, *, seed: int,
            partial_handoffs: bool, report: Report) -> Refined | None:
    """The simulated refinement (``planner.simulated.refine``) of the pool's best placements."""
    scorer = SimScorer(cluster, profiles, inst, simulator, partial_handoffs=partial_handoffs, warmup_s=settings.warmup_s,
                       measure_s=settings.measure_s, seed=settings.seed)

    def say(s: Scored, sim: Simulated, phase: str) -> None:
        report(s, pool.bound, f"{phase}: simulated {sim.decode_tok_s:.1f} / {sim.judge_decode_tok_s:.1f} decode "
                              "tok/s (plan / judge flows)")

    return refine(ev, pool.top(settings.top), scorer, deadline=deadline, seed=seed, patience=settings.patience,
                  report=say)


def _progress(before: Scored, after: Scored, serving: bool) -> bool:
    """Whether a new incumbent restarts the stall window (``before``: the incumbent when it last
    did): any better max-flow key (its tie-breaks lead the search off plateaus), or a serving
    estimate higher by more than SERVING_MIN_GAIN (good to ~10 %: smaller gains are noise)."""
    if not serving:
        return after.key > before.key
    return after.key[0] > before.key[0] * (1 + SERVING_MIN_GAIN)


def _per_region_candidate(inst: Instance, deadline: Deadline, coarse: float) -> Placement | None:
    """Stage plans region by region (geo clusters), joined into one placement."""
    per_region: Placement = {}
    for r in inst.regions():
        if deadline.expired():
            break
        sub = inst.subset([n for n in inst.nodes if inst.region_of[n] == r])
        if sum(sub.max_layers(n) for n in sub.nodes) < inst.num_layers:
            continue
        sub_hi = min(coarse, bounds.area_bound(sub))
        region_plans = stage_candidates(sub, deadline=deadline, lo=0.0, hi=sub_hi, serving=False)
        if region_plans:
            per_region.update(region_plans[0])
    if not per_region:
        return None
    for n in inst.nodes:  # nodes of regions that cannot hold the model: copy a neighbour range
        if n not in per_region:
            per_region[n] = (0, min(inst.max_layers(n), inst.num_layers))
    return per_region


def _finish(
    inst: Instance, best: Scored, bound: bounds.Bound, *, objective: str, stop_at_bound_gap: float | None,
    stalled: bool, deadline: Deadline, t0: float, flow_ev: Evaluator, ev: Evaluator, sm: ServingModel | None,
    report: Report, stats: dict[str, Any], simulated: Simulated | None = None,
) -> OptimizeResult:
    """Exact check, status, stop reason and the plan's flows (balanced when there is time)."""
    mf = flow_ev.exact_max_flow(best.placement)
    serving = objective == "serving"
    at_bound = mf >= bound.tok_s * (1 - OPTIMAL_TOL)
    if at_bound:
        status = "optimal" if not serving else "max_flow_optimal"
    elif stop_at_bound_gap is not None and mf * (1 + stop_at_bound_gap) >= bound.tok_s:
        status = "bound_gap"
    else:
        status = "feasible"
    if not serving and status in ("optimal", "bound_gap"):
        stop_reason = BOUND_MET
    elif stalled:
        stop_reason = STALLED
    else:
        stop_reason = TIME_LIMIT
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
        judged = best.judged if best.serving is not None else ev.score(best.placement).judged
        if judged is not None:
            score["judge_decode_tok_s"] = judged.decode_tok_s
    if simulated is not None:
        score.update(simulated_decode_tok_s=simulated.decode_tok_s,
                     simulated_judge_decode_tok_s=simulated.judge_decode_tok_s,
                     simulated_prompt_p50_s=simulated.prompt_p50_s, simulated_decode_p50_s=simulated.decode_p50_s)
    flows = best.flows
    if flows is None or abs(sum(e.tok_s for e in flows if e.src == inst.coordinator) - mf) > 1e-6 * max(1.0, mf):
        got = balance(inst.cap, best.placement, partial_handoffs=flow_ev.partial_handoffs, value=mf, deadline=deadline)
        balanced = got is not None
        flows = got[1] if got is not None else evaluate(
            inst.cap, best.placement, partial_handoffs=flow_ev.partial_handoffs, with_cut=False).flows
    else:
        balanced = True
    report(best, bound.tok_s, f"done ({stop_reason})")
    stats.update({
        "objective": objective,
        "evaluations": ev.evaluations + flow_ev.evaluations,
        "coverage_min_tok_s": inst.coverage_min(best.placement),
        "wall_s": round(deadline.clock() - t0, 3),
        "serving_binding": best.serving.binding if best.serving is not None else None,
        "stop_reason": stop_reason,
        "balanced_flows": balanced,
    })
    return OptimizeResult(
        flows=flows,
        placement=dict(sorted(best.placement.items())),
        max_flow_tok_s=mf,
        upper_bound_tok_s=bound.tok_s,
        bound_method=bound.method,
        status=status,
        solver=f"stage-pattern MILP + local search ({highs_version()})",
        score=score,
        stats=stats,
        stop_reason=stop_reason,
    )
