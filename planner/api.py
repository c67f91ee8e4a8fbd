"""The planner's entry points: :func:`make_plan`, :func:`evaluate_plan`, :func:`load_checked_plan` (a
complete plan, e.g. for serving) and :func:`load_for_evaluation` (a placement, possibly hand-written).

``make_plan`` turns its keywords into :class:`~planner.options.PlannerOptions` and runs the method
they name (:class:`~planner.options.Method`) — our optimizer (``helix``, in ``planner.optimize``),
the paper's MILP (``paper-milp``, ``planner.milp``) or a baseline (``planner.baselines``) — then
evaluates the placement it got on the full cluster graph (``planner.graph``) and returns a
:class:`~helix.plan.Plan` with flows, bottleneck (min cut), upper bound, status and wall time.
Every plan produced or loaded goes through ``check_plan`` (structure, coverage, layer limits, flow
conservation) and ``check_flows`` (capacities).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helix.domain import Placement, as_placement
from helix.errors import ConfigError, HelixError, InfeasiblePlanError
from helix.perf_model import NETWORK_FREE_BOUND, network_free_bound
from helix.plan import FlowEdge, Plan, check_plan, load_placement, load_plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner import baselines
from planner.budget import BOUND_MET, TIME_LIMIT, Deadline
from planner.capacity import CapacityModel
from planner.graph import check_flows, evaluate
from planner.metrics import placement_stats
from planner.options import Method, Objective, PlannerOptions
from planner.progress import ProgressFn

if TYPE_CHECKING:
    from planner.simulated import RunSimulation

METHODS = tuple(m.value for m in Method)
OBJECTIVES = tuple(o.value for o in Objective)
NETWORK_FREE = f"network-free ({NETWORK_FREE_BOUND})"


def baseline_placements(cluster: ClusterSpec, profiles: ProfileSet, cap: CapacityModel | None = None) -> dict[str, Placement]:
    """Every baseline that is feasible on this cluster (infeasible ones are left out)."""
    cap = cap or CapacityModel.build(cluster, profiles)
    out: dict[str, Placement] = {}
    for name in baselines.BASELINES:
        try:
            out[name] = baselines.run_baseline(name, cap)
        except InfeasiblePlanError:
            continue
    return out


@dataclass(slots=True)
class _Found:
    """What a method found, before the plan's final evaluation."""

    placement: Placement
    bound: float
    bound_method: str
    status: str = "heuristic"
    solver: str | None = None
    stop_reason: str | None = None
    score: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    flows: list[FlowEdge] = field(default_factory=list)


def make_plan(
    cluster: ClusterSpec,
    profiles: ProfileSet,
    *,
    method: str = "helix",
    objective: str = "serving",
    time_limit_s: float = 60.0,
    threads: int = 2,
    partial_handoffs: bool = True,
    prune_links: float = 0.0,
    warm_start: Mapping[str, tuple[int, int]] | None = None,
    stop_at_bound: bool = False,
    solver: str = "highs",
    seed: int = 0,
    on_progress: ProgressFn | None = None,
    stall_s: float | None = None,
    deadline: Deadline | None = None,
    simulate: bool = True,
    simulator: RunSimulation | None = None,
) -> Plan:
    """Plan ``cluster`` with ``method`` and return a checked :class:`Plan` (the keywords are
    :class:`~planner.options.PlannerOptions`' fields, and what the run reports to and gets from outside).

    The whole call (search, bound, final evaluation) ends by ``deadline`` (default:
    ``time_limit_s`` from now) plus the plan's final check; ``helix`` stops earlier when its
    incumbent meets the bound or has not improved for ``stall_s`` (``planner.budget``); its serving
    objective ends with the simulated refinement (``planner.simulated``) when a ``simulator`` is given
    (``simulator.short_run.run_short``; ``helix plan`` passes it) unless ``simulate`` is False."""
    deadline = deadline if deadline is not None else Deadline.after(time_limit_s)
    t0 = deadline.clock()
    options = PlannerOptions(
        method=Method.parse(method), objective=Objective.parse(objective), time_limit_s=time_limit_s, threads=threads,
        partial_handoffs=partial_handoffs, prune_links=prune_links, stop_at_bound=stop_at_bound, solver=solver,
        seed=seed, stall_s=stall_s, simulate=simulate,
    )
    cap = CapacityModel.build(cluster, profiles)
    warm = None
    if warm_start is not None:
        _check_placement(cap, warm_start, source="--warm-start")
        warm = as_placement(warm_start)
    if options.method.is_baseline:
        nf_bound = network_free_bound(cap.node_tok_s.values(), cap.num_layers)
        found = _Found(baselines.run_baseline(options.method, cap), nf_bound, NETWORK_FREE)
    elif options.method == Method.PAPER_MILP:
        found = _run_paper_milp(cluster, profiles, cap, options, warm, on_progress=on_progress, deadline=deadline)
    else:
        found = _run_optimizer(cluster, profiles, cap, options, warm, on_progress=on_progress, deadline=deadline,
                               simulator=simulator)
    plan = finish_plan(
        cluster,
        profiles,
        found.placement,
        method=options.method.value,
        objective=options.objective.value if options.method == Method.HELIX else Objective.MAX_FLOW.value,
        partial_handoffs=options.partial_handoffs,
        upper_bound_tok_s=found.bound,
        bound_method=found.bound_method,
        status=found.status,
        solver=found.solver,
        wall_s=deadline.clock() - t0,
        score=found.score,
        stats=found.stats,
        cap=cap,
        flows=found.flows,
        stop_reason=found.stop_reason,
    )
    if plan.max_flow_tok_s <= 0:
        raise InfeasiblePlanError(_why_no_pipeline(cluster, options.method))
    return plan


def _run_paper_milp(cluster: ClusterSpec, profiles: ProfileSet, cap: CapacityModel, options: PlannerOptions,
                    warm: Placement | None, *, on_progress: ProgressFn | None, deadline: Deadline) -> _Found:
    """Method ``paper-milp``, hinted (as the paper does) with the best baseline unless given a warm start."""
    from planner import milp  # imported when used: it pulls in the solvers (pulp, highspy)

    start = warm
    if start is None:  # the paper hints the solver with its heuristics' best
        cands = baseline_placements(cluster, profiles, cap)
        start = max(cands.values(), default=None,
                    key=lambda p: evaluate(cap, p, partial_handoffs=options.partial_handoffs, with_cut=False).max_flow_tok_s)
    res = milp.solve_paper_milp(
        cap,
        partial_handoffs=options.partial_handoffs,
        time_limit_s=options.time_limit_s,
        deadline=deadline,
        threads=options.threads,
        solver=options.solver,
        warm_start=start,
        prune_links_frac=options.prune_links,
        stop_at_bound=options.stop_at_bound,
        on_progress=on_progress,
    )
    stop_reason = BOUND_MET if res.status in ("optimal", "reached_target") else TIME_LIMIT
    return _Found(res.placement, res.upper_bound_tok_s, res.bound_method, res.status, res.solver, stop_reason,
                  stats=dict(res.stats))


def _run_optimizer(cluster: ClusterSpec, profiles: ProfileSet, cap: CapacityModel, options: PlannerOptions,
                   warm: Placement | None, *, on_progress: ProgressFn | None, deadline: Deadline,
                   simulator: RunSimulation | None) -> _Found:
    """Method ``helix``, from the warm start and every feasible baseline."""
    from planner.optimize import optimize  # imported when used: it pulls in the solvers (pulp, highspy)

    starts = [warm] if warm is not None else []
    starts += list(baseline_placements(cluster, profiles, cap).values())
    res = optimize(cluster, profiles, options, warm_start=starts, on_progress=on_progress, deadline=deadline,
                   simulator=simulator)
    return _Found(dict(res.placement), float(res.upper_bound_tok_s), res.bound_method, res.status, res.solver,
                  res.stop_reason, score=dict(res.score), stats=dict(res.stats), flows=list(res.flows))


def _why_no_pipeline(cluster: ClusterSpec, method: str) -> str:
    """Why the best placement serves nothing: no chain of linked nodes covers every layer."""
    nodes = {n.id for n in cluster.nodes}
    linked = [pair for pair in cluster.resolved_links() if pair[0] in nodes and pair[1] in nodes]
    why = (
        "this cluster has no links between its nodes (add `defaults: {intra_region: ...}` or `links:`)"
        if not linked
        else f"only {len(linked)} directed node-to-node links exist; no chain of linked nodes can hold every layer"
    )
    return (
        f"{cluster.source}: no complete pipeline: the {method} placement serves 0 tok/s; a pipeline is a chain "
        f"of linked nodes from the coordinator and back that runs every layer, and {why}"
    )


def finish_plan(
    cluster: ClusterSpec,
    profiles: ProfileSet,
    placement: Mapping[str, tuple[int, int]],
    *,
    method: str,
    partial_handoffs: bool = True,
    objective: str | None = None,
    upper_bound_tok_s: float | None = None,
    bound_method: str | None = None,
    status: str = "evaluated",
    solver: str | None = None,
    wall_s: float = 0.0,
    score: dict[str, float] | None = None,
    stats: dict[str, Any] | None = None,
    cap: CapacityModel | None = None,
    flows: list[FlowEdge] | None = None,
    stop_reason: str | None = None,
) -> Plan:
    """Evaluate a placement on the cluster graph and wrap it as a checked plan.

    ``flows``, if given (the optimizer's balanced max flow), become the plan's flows when
    they carry the same max flow as the graph's; otherwise networkx's flows are used.
    """
    cap = cap or CapacityModel.build(cluster, profiles)
    ranges = as_placement(placement)
    result = evaluate(cap, ranges, partial_handoffs=partial_handoffs)
    if flows:
        out_of_source = sum(e.tok_s for e in flows if e.src == cluster.coordinator.id)
        if abs(out_of_source - result.max_flow_tok_s) <= 1e-6 * max(1.0, result.max_flow_tok_s):
            result.flows = list(flows)
    all_stats = dict(stats or {})
    all_stats.update(placement_stats(cluster, profiles, ranges, result.flows))
    plan = Plan(
        cluster=cluster.name,
        model=cluster.model,
        method=method,
        placement=dict(ranges),
        max_flow_tok_s=result.max_flow_tok_s,
        upper_bound_tok_s=upper_bound_tok_s,
        bound_method=bound_method,
        flows=result.flows,
        bottleneck=result.bottleneck,
        status=status,
        stop_reason=stop_reason,
        wall_s=round(wall_s, 3),
        solver=solver,
        objective=objective,
        partial_handoffs=partial_handoffs,
        score=score or {},
        stats=all_stats,
    )
    check_plan_against(plan, cluster, cap, source=f"<{method} plan>")
    return plan


def check_plan_against(plan: Plan, cluster: ClusterSpec, cap: CapacityModel, *, source: str) -> None:
    """``check_plan`` + ``check_flows`` for a plan on this cluster (ConfigError names ``source``)."""
    if plan.model != cluster.model:
        raise ConfigError(f"plan is for model {plan.model!r} but the cluster serves {cluster.model!r}", source=source, field="model")
    check_plan(
        plan,
        num_layers=cap.num_layers,
        node_ids=cluster.node_ids,
        max_layers=cap.max_layers,
        coordinator=cluster.coordinator.id,
        source=source,
    )
    if plan.flows:
        try:
            check_flows(cap, dict(plan.placement), plan.flows, partial_handoffs=plan.partial_handoffs)
        except ConfigError as exc:
            raise ConfigError(exc.detail, source=source, field=exc.field) from None


def _check_placement(cap: CapacityModel, placement: Mapping[str, tuple[int, int]], *, source: str) -> None:
    for node, (s, e) in placement.items():
        if node not in cap.max_layers:
            raise ConfigError(f"node {node!r} is not in the cluster", source=source, field=f"placement.{node}")
        if not 0 <= s < e <= cap.num_layers or e - s > cap.max_layers[node]:
            raise ConfigError(f"range [{s}, {e}) is not valid for this node", source=source, field=f"placement.{node}")


def serving_estimate(cluster: ClusterSpec, profiles: ProfileSet, plan: Plan, *, flows: str = "plan") -> float | None:
    """Decode tokens/s the optimizer's serving model estimates for a plan (None if unavailable),
    routed by the plan's flows (``flows="plan"``) or by the flows the paper's simulator
    recomputes (``"judge"``: :func:`planner.flows.judge_flows`)."""
    from planner.flows import judge_flows  # imported when used: they pull in the solvers (highspy)
    from planner.serving_model import ServingModel

    if flows not in ("plan", "judge"):
        raise ConfigError(f"unknown flows {flows!r} (plan or judge)", field="flows")
    try:
        cap = CapacityModel.build(cluster, profiles)
        if flows == "judge":
            routed = judge_flows(cap, plan.placement, partial_handoffs=plan.partial_handoffs)
        else:
            routed = {(e.src, e.dst): e.tok_s for e in plan.flows}
        est = ServingModel(cap).estimate(as_placement(plan.placement), routed, plan.max_flow_tok_s)
    except Exception:  # noqa: BLE001 - an estimate beside the table, never a reason to fail
        return None
    return float(est.decode_tok_s)


def load_checked_plan(path: str | Path, cluster: ClusterSpec, profiles: ProfileSet) -> Plan:
    """Read a plan file and check it against the cluster (unknown nodes, coverage, limits, flows)."""
    plan = load_plan(path)
    cap = CapacityModel.build(cluster, profiles)
    check_plan_against(plan, cluster, cap, source=str(path))
    return plan


def load_for_evaluation(path: str | Path, cluster: ClusterSpec, profiles: ProfileSet) -> tuple[Plan, list[str]]:
    """Read a placement to evaluate — a complete plan, or a hand-written ``cluster``, ``model``,
    ``placement`` — and check it against the cluster. Returns the plan and warnings for the
    user (a plan written for a cluster of another name is evaluated, with a warning)."""
    plan = load_placement(path, cluster=cluster.name, model=cluster.model)
    check_plan_against(plan, cluster, CapacityModel.build(cluster, profiles), source=str(path))
    warnings = []
    if plan.cluster != cluster.name:
        warnings.append(f"{path}: the plan names cluster {plan.cluster!r}; evaluating its placement on {cluster.name!r}")
    return plan, warnings


def evaluate_plan(cluster: ClusterSpec, profiles: ProfileSet, plan: Plan, *, partial_handoffs: bool = True) -> Plan:
    """Recompute a plan's max flow, flows and bottleneck on this cluster (keeps its method). ConfigError
    naming the node when a range does not fit it or the cluster has no such node."""
    cap = CapacityModel.build(cluster, profiles)
    _check_placement(cap, plan.placement, source=f"plan {plan.method!r} for cluster {plan.cluster!r}")
    return finish_plan(
        cluster,
        profiles,
        dict(plan.placement),
        cap=cap,
        method=plan.method,
        partial_handoffs=partial_handoffs,
        objective="max-flow",
        upper_bound_tok_s=plan.upper_bound_tok_s,
        bound_method=plan.bound_method,
        status="evaluated",
        solver=plan.solver,
    )


__all__ = [
    "METHODS",
    "OBJECTIVES",
    "HelixError",
    "baseline_placements",
    "evaluate_plan",
    "finish_plan",
    "load_checked_plan",
    "load_for_evaluation",
    "make_plan",
    "serving_estimate",
]
