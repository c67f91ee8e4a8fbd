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

On geo clusters a max-flow search that stalls proves the bound again from its final flow in
the time it leaves (up to :data:`REPROVE_SHARE` of the limit): the link-aware bisection tightens
with time.

``optimize`` runs these phases in order (``construct``, ``_prove_bound``, ``_polish``,
``_refine_by_simulation``, ``_finish``); the candidates and the construction live in
``planner.candidates``.

Status: ``optimal`` when the max-flow incumbent meets the proven bound (within 1e-4;
``max_flow_optimal`` under the serving objective), else ``feasible``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from helix.domain import Placement
from helix.errors import InfeasiblePlanError
from helix.plan import FlowEdge
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner import bounds
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
from planner.candidates import CandidatePool, Report, construct, warm_placements
from planner.capacity import CapacityModel
from planner.flows import balance
from planner.graph import evaluate
from planner.local_search import SERVING_MIN_GAIN, Evaluator, Scored, improve
from planner.options import Objective, PlannerOptions
from planner.progress import Progress, ProgressFn
from planner.serving_model import ServingModel
from planner.serving_workload import Workload
from planner.simulated import Refined, Refinement, RunSimulation, SimScorer, Simulated, refine, simulable
from planner.solvers import highs_version

OPTIMAL_TOL = BOUND_REL_TOL
NEAR_BEST = 0.98  # near_best_max_flow: placements within this share of the best objective
FINISH_SHARE = 0.1  # of the time limit, kept for the final exact check and balanced flows ...
FINISH_MAX_S = 3.0  # ... but never more than this
BOUND_SHARE = 0.1  # the layer-configuration bound's share of the limit (at least 0.5 s)
SIMULATE_SHARE = 0.4  # the simulated refinement's share of the limit (the search before it stops earlier)
REPROVE_SHARE = 0.3  # geo clusters: a stalled max-flow search re-proves the bound in what is left, up to this share


@dataclass(slots=True)
class OptimizeResult:
    placement: Placement
    max_flow_tok_s: float
    upper_bound_tok_s: float
    bound_method: str
    status: str
    solver: str
    score: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    flows: list[FlowEdge] = field(default_factory=list)  # balanced max flow: use as the plan's flows
    stop_reason: str = TIME_LIMIT


def optimize(
    cluster: ClusterSpec,
    profiles: ProfileSet,
    options: PlannerOptions | None = None,
    *,
    warm_start: Placement | list[Placement] | None = None,
    on_progress: ProgressFn | None = None,
    workload: Workload | None = None,
    deadline: Deadline | None = None,
    simulator: RunSimulation | None = None,
) -> OptimizeResult:
    """Search a placement of ``cluster`` for ``options.objective`` by ``deadline`` (default: within
    ``options.time_limit_s`` seconds from now); stop earlier when the bound is met or the search has
    not improved for ``options.stall_s`` seconds (default :func:`planner.budget.stall_window_s`).
    ``options.simulate`` (objective ``serving``): end with the simulated refinement (``planner.simulated``;
    a :class:`~planner.simulated.Refinement` sets its window, seed, candidates and patience) when a
    ``simulator`` is given (``simulator.short_run.run_short``) and the cluster's GPUs have latency curves."""
    options = options or PlannerOptions()
    deadline = deadline if deadline is not None else Deadline.after(options.time_limit_s)
    clock = deadline.clock
    t0 = clock()
    limit = max(deadline.remaining(), 1e-3)
    search = deadline.within(limit - min(FINISH_MAX_S, max(0.05, FINISH_SHARE * limit)))
    report = _reporter(on_progress, t0, clock)
    cap = CapacityModel.build(cluster, profiles)
    if options.prune_links:
        cap = cap.pruned(options.prune_links)
    if sum(cap.max_layers[n] for n in cap.nodes) < cap.num_layers:
        raise InfeasiblePlanError(f"the nodes together hold fewer than the model's {cap.num_layers} layers")
    serving = options.objective == Objective.SERVING
    sm = ServingModel(cap, workload) if serving else None
    ev = Evaluator(cap, options.objective.value, partial_handoffs=options.partial_handoffs, serving_model=sm,
                   deadline=search)
    flow_ev = Evaluator(cap, Objective.MAX_FLOW.value, partial_handoffs=options.partial_handoffs)
    pool = CandidatePool(ev, report, set(cap.nodes))
    coarse = bounds.cheap_bound(cap)
    pool.bound = coarse.tok_s
    report(None, coarse.tok_s, "construction")
    construct(pool, cap, warm_placements(warm_start), search=search, limit=limit, coarse=coarse.tok_s, serving=serving)
    bound = _prove_bound(pool, cap, search.within(max(0.5, BOUND_SHARE * limit)))
    refining = serving and options.simulate is not False and simulator is not None and simulable(cluster, profiles)
    window_s, stalled = _polish(pool, ev, bound, options, search, limit, refining=refining)
    best = pool.best
    assert best is not None
    if not refining and stalled and _geo(cap) and best.max_flow < bound.tok_s * (1 - OPTIMAL_TOL):
        bound = _reprove_bound(pool, cap, bound, search.within(REPROVE_SHARE * limit))
    stats: dict[str, Any] = {"candidates": len(pool.scored), "stall_window_s": window_s,
                             "near_best_max_flow_tok_s": round(near_best_max_flow(pool), 3)}
    refined = None
    if refining and simulator is not None and not search.expired():
        settings = options.simulate if isinstance(options.simulate, Refinement) else Refinement()
        refined = _refine_by_simulation(cluster, profiles, ev, pool, search, settings, simulator, seed=options.seed,
                                        partial_handoffs=options.partial_handoffs, report=report)
        if refined is not None:
            best = refined.best
            stalled = refined.stop_reason != "time_limit"
            stats.update(simulations=refined.simulations, simulated_stop=refined.stop_reason,
                         model_choice_simulated_tok_s=round(refined.model_choice.score, 1))
    return _finish(cap, best, bound, options=options, stalled=stalled, deadline=deadline, t0=t0, flow_ev=flow_ev,
                   ev=ev, sm=sm, report=report, stats=stats,
                   simulated=refined.simulated if refined is not None else None)


def near_best_max_flow(pool: CandidatePool) -> float:
    """The most max flow among the placements ``pool`` scored within :data:`NEAR_BEST` of the best
    objective (``stats["near_best_max_flow_tok_s"]``): under ``serving``, placements of about the same
    estimate differ by up to 35 % in max flow (single24 less an A100: 1476 and 952 tok/s within 1.3 %),
    and which of them a search in seconds returns follows the wall clock; this one does not. 2 %, not
    more: single24 less a T4 has a 1212 tok/s placement 4.6 % below its best (1063 tok/s), and a floor
    from it makes a re-plan move layers for max flow its objective does not value."""
    best = pool.best
    assert best is not None
    if best.key[0] <= 0:
        return best.max_flow
    return max(s.max_flow for s in pool.scored.values() if s.key[0] >= NEAR_BEST * best.key[0])


def _reporter(on_progress: ProgressFn | None, t0: float, clock: Clock) -> Report:
    """``report(incumbent, bound, phase)`` -> the caller's callback, as a :class:`Progress`."""
    if on_progress is None:
        return lambda inc, bnd, msg: None

    def report(inc: Scored | None, bnd: float | None, msg: str) -> None:
        mf = inc.max_flow if inc is not None else None
        est = inc.serving.decode_tok_s if inc is not None and inc.serving is not None else None
        on_progress(Progress(mf, bnd, clock() - t0, msg, serving_tok_s=est))

    return report


def _prove_bound(pool: CandidatePool, cap: CapacityModel, deadline: Deadline) -> bounds.Bound:
    """The proven bound, bisected up from the best max flow found so far."""
    achieved = max(s.max_flow for s in pool.scored.values())
    bound = bounds.upper_bound(cap, achieved=achieved, deadline=deadline)
    pool.bound = bound.tok_s
    pool.report(pool.best, bound.tok_s, "bound")
    return bound


def _geo(cap: CapacityModel) -> bool:
    """Regions joined by links that differ: where the link-aware bound applies."""
    return len(cap.regions()) > 1 and not cap.links_uniform()


def _reprove_bound(pool: CandidatePool, cap: CapacityModel, bound: bounds.Bound, deadline: Deadline) -> bounds.Bound:
    """The bound proven again from the search's final flow with the time the stalled search left (the
    link-aware bisection tightens with time: on geo-s6-n48 9.1 % in 6 s, 6.3 % in 30 s); the better one."""
    if deadline.expired():
        return bound
    again = _prove_bound(pool, cap, deadline)
    if again.tok_s < bound.tok_s:
        return again
    pool.bound = bound.tok_s
    return bound


def _polish(pool: CandidatePool, ev: Evaluator, bound: bounds.Bound, options: PlannerOptions, search: Deadline,
            limit: float, *, refining: bool) -> tuple[float | None, bool]:
    """Local search from the best candidates, exact evaluation of every move, until the bound is met,
    the search stalls or its time is up (all but :data:`SIMULATE_SHARE` of the limit when the simulated
    refinement follows). Returns the stall window and whether the search stalled."""
    best = pool.best
    assert best is not None
    serving = options.objective == Objective.SERVING
    target = None
    if not serving and options.stop_at_bound:
        target = bound.tok_s / (1 + 0.0) - 1e-9
    if not serving and best.max_flow >= bound.tok_s * (1 - OPTIMAL_TOL):
        target = best.key[0]
    # with the simulated refinement after it, the model's search stops after STALL_MIN_S without a gain
    # unless told otherwise: a simulated candidate is worth more than more of the model's search
    stall_s = options.stall_s
    watch = StallWatch(search.clock, stall_window_s(limit, stall_s) if stall_s is not None or not refining
                       else STALL_MIN_S)  # fmt: skip
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
    seed = options.seed
    if not serving and not ev.coverage_exact and (target is None or best.key[0] < target) and not polish.expired():
        # links may bind: first search the network-free relaxation (microseconds per move),
        # then keep its result only if the exact max flow agrees that it is better
        relaxed = Evaluator(ev.cap, Objective.MAX_FLOW.value, partial_handoffs=options.partial_handoffs)
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
    return watch.window_s, stalled["yes"]


def _progress(before: Scored, after: Scored, serving: bool) -> bool:
    """Whether a new incumbent restarts the stall window (``before``: the incumbent when it last
    did): any better max-flow key (its tie-breaks lead the search off plateaus), or a serving
    estimate higher by more than SERVING_MIN_GAIN (good to ~10 %: smaller gains are noise)."""
    if not serving:
        return after.key > before.key
    return after.key[0] > before.key[0] * (1 + SERVING_MIN_GAIN)


def _refine_by_simulation(cluster: ClusterSpec, profiles: ProfileSet, ev: Evaluator, pool: CandidatePool,
                          deadline: Deadline, settings: Refinement, simulator: RunSimulation, *, seed: int,
                          partial_handoffs: bool, report: Report) -> Refined | None:
    """The simulated refinement (``planner.simulated.refine``) of the pool's best placements."""
    scorer = SimScorer(cluster, profiles, ev.cap, simulator, partial_handoffs=partial_handoffs,
                       warmup_s=settings.warmup_s, measure_s=settings.measure_s, seed=settings.seed)

    def say(s: Scored, sim: Simulated, phase: str) -> None:
        report(s, pool.bound, f"{phase}: simulated {sim.decode_tok_s:.1f} / {sim.judge_decode_tok_s:.1f} decode "
                              "tok/s (plan / judge flows)")

    return refine(ev, pool.top(settings.top), scorer, deadline=deadline, seed=seed, patience=settings.patience,
                  report=say)


def _finish(
    cap: CapacityModel, best: Scored, bound: bounds.Bound, *, options: PlannerOptions, stalled: bool,
    deadline: Deadline, t0: float, flow_ev: Evaluator, ev: Evaluator, sm: ServingModel | None, report: Report,
    stats: dict[str, Any], simulated: Simulated | None = None,
) -> OptimizeResult:
    """Exact check, status, stop reason, score and the plan's flows (balanced when there is time)."""
    mf = flow_ev.exact_max_flow(best.placement)
    serving = options.objective == Objective.SERVING
    if mf >= bound.tok_s * (1 - OPTIMAL_TOL):
        status = "optimal" if not serving else "max_flow_optimal"
    else:
        status = "feasible"
    if not serving and status == "optimal":
        stop_reason = BOUND_MET
    elif stalled:
        stop_reason = STALLED
    else:
        stop_reason = TIME_LIMIT
    score = _score(best, mf, ev, simulated) if sm is not None else {"max_flow_tok_s": mf}
    flows, balanced = _plan_flows(cap, best, mf, partial_handoffs=flow_ev.partial_handoffs, deadline=deadline)
    report(best, bound.tok_s, f"done ({stop_reason})")
    stats.update({
        "objective": options.objective.value,
        "evaluations": ev.evaluations + flow_ev.evaluations,
        "coverage_min_tok_s": cap.coverage_min(best.placement),
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


def _score(best: Scored, mf: float, ev: Evaluator, simulated: Simulated | None) -> dict[str, float]:
    """The serving objective's score of the chosen placement: the model's estimates (and the
    simulated refinement's figures when it ran)."""
    score: dict[str, float] = {"max_flow_tok_s": mf}
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
    return score


def _plan_flows(cap: CapacityModel, best: Scored, mf: float, *, partial_handoffs: bool,
                deadline: Deadline) -> tuple[list[FlowEdge], bool]:
    """The plan's flows: the search's balanced ones when they carry the max flow, else balanced now
    (when the QP finishes in time), else networkx's; and whether they are balanced."""
    flows = best.flows
    if flows is not None and abs(sum(e.tok_s for e in flows if e.src == cap.coordinator) - mf) <= 1e-6 * max(1.0, mf):
        return flows, True
    got = balance(cap, best.placement, partial_handoffs=partial_handoffs, value=mf, deadline=deadline)
    if got is not None:
        return got[1], True
    return evaluate(cap, best.placement, partial_handoffs=partial_handoffs, with_cut=False).flows, False
