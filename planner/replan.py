"""Incremental re-planning: when nodes leave or join, a new plan that moves few layers.

:func:`replan` is the pure entry point (no I/O; deterministic for a seed unless the time limit
cuts a phase) that ``helix plan --from`` and the coordinator call:
``replan(cluster, profiles, current, options) -> Replan``. ``cluster`` is the new membership:
nodes of ``current``'s placement missing from it have left, nodes of it that hold nothing in
``current`` join. Every moved layer is priced (``planner.moves``: a layer a node must newly
load); the search maximises the objective (``current``'s unless told) minus that price:

1. **warm start** (``planner.repair``): the current ranges of the nodes that stay, joiners in
   the thinnest layers, uncovered layers covered greedily or by a ripple along the chain;
2. **plan from scratch** (``planner.api.make_plan``, :data:`SCRATCH_SHARE` of the time),
   relabelled among interchangeable nodes to keep layers where they are (``moves.relabel``);
3. **fewest moves** (``planner.min_moves``, when the cluster is small enough: at most
   :data:`EXACT_MAX_RANGES` node ranges, and in :data:`EXACT_SHARE` of the time): the exact fewest
   layers moved that keep the max flow at ``fallback_below`` times the reachable max flow
   (:func:`reachable_max_flow`: the from-scratch plan's, or the most among the placements its search
   scored of about its objective), and
   among those the most flow, a covering MILP checked by the max flow; its placement joins the
   starts of step 5 and its proven minimum is recorded. It finds what the local search's moves
   cannot reach in one step: a node that gives up its range to fill the hole a leaver left while
   the chain closes behind it (single24 less ``l4-14``: 9 layers against the search's 18). Under
   ``max-flow``, when that placement has the from-scratch plan's max flow and that plan is proven
   optimal, no placement scores more and steps 4 and 5 are skipped;
4. **objective search** (when step 3 found no placement): the local search
   (``planner.local_search.improve``) from the warm start for the max flow (microseconds a move,
   whatever the objective), to learn what is within reach;
5. **move search**: the same local search, its evaluator scoring ``objective - price * moved
   layers - SHORTFALL_PRICE * shortfall`` (``Evaluator.penalty``; ``price = move_cost * best
   objective of the starts``: with the default 0.002 a layer must buy 0.2 % of the objective;
   the shortfall is how far the objective is below the fallback floor, ``fallback_below`` times
   the from-scratch plan's, plus under ``max-flow`` each layer's coverage below it on average: a
   gradient towards the floor where the minimum alone has none; under ``serving`` also how far the
   max flow is below ``fallback_below`` times the reachable max flow, as a share of the floor: plans
   of about the same serving estimate differ by up to 35 % in max flow, and the max flow is what a
   re-plan is judged by) and with re-planning's moves (``anchor``: back to a node's current range,
   boundary shifts, ejection chains), from every start — the warm start, step 3's placement or
   step 4's best, the relabelled plan from scratch, and under ``serving`` the same search run on
   the max flow first — best start first, then restarts from the best;
6. **fallback**: when the incremental plan's objective is below ``fallback_below`` (default
   0.95) times the from-scratch plan's, or (under ``serving``) its max flow is below that share of the
   reachable max flow and the from-scratch plan's is higher, the from-scratch plan is the answer. The
   move search prices a max flow below the floor but cannot promise it (a sweep kept the serving
   estimate of single24 less ``a100-9`` with 13 layers moved at 82 % of the max flow). Under
   ``serving`` the plan from scratch found in its share of the time is one of two plans of about the
   same estimate and max flows 1476 or 952 tok/s on single24 less an A100, as the wall clock falls,
   so the floors follow the reachable max flow, not that plan's.
   ``fallback_below=0`` skips step 2 (no fallback); above 1 always falls back.

The searches stop after :data:`STALL_CANDIDATES` candidates without a gain (a count, not
seconds: deterministic) or at their share of ``time_limit_s``. The chosen plan's
``stats["replan"]`` records the change (removed, added, the moves per node, layers moved, the
decision, step 3's proven fewest); ``helix plan --from -o`` writes it in the plan file (docs/planner.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from helix.domain import Placement, as_placement
from helix.errors import ConfigError, InfeasiblePlanError
from helix.plan import FlowEdge, Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec, NodeSpec
from planner.api import finish_plan, make_plan
from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.flows import balance
from planner.local_search import Evaluator, Scored, improve
from planner.min_moves import FewestMoves, fewest_moves, range_count
from planner.moves import NodeMove, layers_moved, node_moves, relabel, renamed
from planner.options import Objective
from planner.repair import warm_start
from planner.serving_model import ServingModel

STALL_CANDIDATES = 20000  # a search phase stops after trying this many candidates without a gain
MOVE_RESTARTS = 3  # the move search starts again from its best this many times, with new seeds
SEARCH_SHARE = 0.15  # of the time limit, at most, for the objective search (and serving's max-flow move search) ...
SCRATCH_SHARE = 0.4  # ... and for the plan from scratch; the move search gets the rest
EXACT_SHARE = 0.4  # ... and for the fewest-moves MILP (step 3), on clusters with at most EXACT_MAX_RANGES node ranges
EXACT_MAX_RANGES = 20000  # single24: 11,117 (the MILP takes 1-4 s there on this project's 2-core box)
EXACT_THREADS = 2
FINISH_SHARE = 0.1  # kept for the final evaluation and balanced flows ...
SERVING_FINISH_SHARE = 0.15  # ... under serving (an evaluation in flight when the search's time is up: 0.05-1 s)
SHORTFALL_PRICE = 10.0  # the move search's price of a unit of objective below the fallback floor


@dataclass(frozen=True, slots=True)
class ReplanOptions:
    """One re-planning run's settings (``helix plan --from``'s flags)."""

    objective: Objective | None = None  # None: the current plan's (``serving`` when it names none)
    time_limit_s: float = 10.0  # the whole call, from-scratch fallback and final check included
    move_cost: float = 0.002  # the price of one moved layer, as a share of the objective
    fallback_below: float = 0.95  # from scratch when incremental < this x from-scratch (0: never, > 1: always)
    partial_handoffs: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.objective is not None:
            object.__setattr__(self, "objective", Objective.parse(self.objective))
        if self.time_limit_s <= 0:
            raise ConfigError("must be positive", field="--time-limit")
        if self.move_cost < 0:
            raise ConfigError("must be at least 0", field="--move-cost")
        if self.fallback_below < 0:
            raise ConfigError("must be at least 0", field="--fallback-below")


@dataclass(slots=True)
class Replan:
    """What :func:`replan` decided: the plan to serve, how the nodes get there, and why."""

    plan: Plan  # the chosen plan (stats["replan"] records the rest)
    moves: list[NodeMove]  # every node of the current or the new placement
    layers_moved: int  # layers the nodes must newly load
    bytes_moved: float  # their weights, bytes
    removed: list[str]
    added: list[str]
    decision: str  # "incremental" or "from-scratch"
    reason: str
    incremental: Plan  # the incremental plan (the chosen one unless the fallback chose the other)
    scratch: Plan | None = None  # the from-scratch plan, relabelled (None: not run)
    scratch_layers_moved: int | None = None
    values: dict[str, float] = field(default_factory=dict)  # the objective of each plan, by decision name
    wall_s: float = 0.0
    fewest: FewestMoves | None = None  # step 3's proven fewest moves (None: not run)
    reachable_max_flow_tok_s: float = 0.0  # what the max-flow floors are a share of (0: no plan from scratch)


def without_nodes(cluster: ClusterSpec, nodes: Sequence[str]) -> ClusterSpec:
    """``cluster`` less ``nodes`` (and their explicit links): a membership after they left."""
    gone = set(nodes)
    unknown = gone - set(cluster.node_ids)
    if unknown:
        raise ConfigError(f"unknown nodes {sorted(unknown)}", source=cluster.source, field="nodes")
    return cluster.model_copy(update={
        "nodes": [n for n in cluster.nodes if n.id not in gone],
        "links": [link for link in cluster.links if link.src not in gone and link.dst not in gone],
    })


def with_nodes(cluster: ClusterSpec, nodes: Sequence[NodeSpec]) -> ClusterSpec:
    """``cluster`` with ``nodes`` added (links from ``defaults``): a membership after they joined."""
    taken = {cluster.coordinator.id, *cluster.node_ids}
    for node in nodes:
        if node.id in taken:
            raise ConfigError(f"node id {node.id!r} is already taken", source=cluster.source, field="nodes")
        taken.add(node.id)
    return cluster.model_copy(update={"nodes": [*cluster.nodes, *nodes]})


def replan(cluster: ClusterSpec, profiles: ProfileSet, current: Plan, options: ReplanOptions | None = None,
           *, deadline: Deadline | None = None) -> Replan:
    """Re-plan ``current`` for the membership ``cluster`` (module docstring). Raises
    InfeasiblePlanError, naming why, when the nodes left cannot serve the model."""
    options = options or ReplanOptions()
    objective = options.objective or Objective.parse(current.objective or Objective.SERVING.value)
    options = replace(options, objective=objective)
    deadline = deadline if deadline is not None else Deadline.after(options.time_limit_s)
    t0 = deadline.clock()
    limit = max(deadline.remaining(), 1e-3)
    if current.model != cluster.model:
        raise ConfigError(f"the plan is for model {current.model!r} but the cluster serves {cluster.model!r}",
                          field="model")
    old = as_placement(current.placement)
    removed = [n for n in old if n not in cluster.node_ids]
    added = [n for n in cluster.node_ids if n not in old]
    cap = CapacityModel.build(cluster, profiles)
    _check_feasible(cap, cluster, removed)
    search = deadline.within(limit * (1 - (FINISH_SHARE if objective == Objective.MAX_FLOW else SERVING_FINISH_SHARE)))
    ev = Evaluator(cap, objective.value, partial_handoffs=options.partial_handoffs,
                   serving_model=ServingModel(cap) if objective == Objective.SERVING else None, deadline=deadline)
    start, uncovered = warm_start(cap, old)
    scratch = None
    if options.fallback_below > 0 or uncovered:
        scratch = _from_scratch(cluster, profiles, cap, old, options, search.within(SCRATCH_SHARE * limit),
                                required=bool(uncovered))
    values: dict[str, float] = {}
    fewest = None
    reach = reachable_max_flow(scratch)
    if scratch is not None:
        values["from-scratch"] = ev.score(as_placement(scratch.placement)).key[0]
        fewest = _fewest(cap, old, reach, options, search.within(EXACT_SHARE * limit))
    if fewest is not None and fewest.placement is not None and _settles(fewest, scratch, objective):
        found = ev.score(fewest.placement)  # the fewest moves at the best max flow there is: nothing scores more
    else:
        found = _searches(ev, old, None if uncovered else start, scratch, values.get("from-scratch", 0.0), reach,
                          fewest, options, search, limit)
    inc_plan = _finish(cluster, profiles, cap, found, options, deadline, t0)
    values["incremental"] = ev.score(found.placement).key[0]
    flows = {"incremental": inc_plan.max_flow_tok_s, "reachable": reach}
    flows |= {"from-scratch": scratch.max_flow_tok_s} if scratch else {}
    decision, reason = decide(values, flows if objective == Objective.SERVING else {}, options.fallback_below)
    chosen = inc_plan if decision == "incremental" else scratch
    assert chosen is not None
    moves = node_moves(old, chosen.placement)
    out = Replan(
        plan=chosen, moves=moves, layers_moved=layers_moved(old, chosen.placement), removed=removed, added=added,
        bytes_moved=layers_moved(old, chosen.placement) * profiles.models[cluster.model].layer_weight_bytes,
        decision=decision, reason=reason, incremental=inc_plan, scratch=scratch,
        scratch_layers_moved=layers_moved(old, scratch.placement) if scratch is not None else None, values=values,
        fewest=fewest, reachable_max_flow_tok_s=reach,
    )
    out.wall_s = round(deadline.clock() - t0, 3)
    chosen.stats["replan"] = record(out)
    return out


def record(r: Replan) -> dict[str, Any]:
    """The plan file's ``stats.replan``: what changed and how the nodes get there."""
    return {
        "removed": r.removed, "added": r.added, "decision": r.decision, "reason": r.reason,
        "layers_moved": r.layers_moved, "bytes_moved": r.bytes_moved, "scratch_layers_moved": r.scratch_layers_moved,
        "values": {k: round(v, 3) for k, v in r.values.items()}, "wall_s": r.wall_s,
        "reachable_max_flow_tok_s": round(r.reachable_max_flow_tok_s, 3),
        "moves": [m.to_dict() for m in r.moves if m.change != "kept"],
        **({"fewest": {"status": r.fewest.status, "lower_bound": r.fewest.lower_bound,
                       "layers_moved": r.fewest.layers_moved, "wall_s": round(r.fewest.wall_s, 3)}}
           if r.fewest is not None else {}),
    }


def _check_feasible(cap: CapacityModel, cluster: ClusterSpec, removed: list[str]) -> None:
    held = sum(cap.max_layers.values())
    if held >= cap.num_layers:
        return
    gone = f"after {', '.join(removed)} left, " if removed else ""
    per = ", ".join(f"{node} {cap.max_layers[node]}" for node in cap.nodes)
    raise InfeasiblePlanError(
        f"{gone}the {len(cap.nodes)} remaining node(s) hold at most {held} of the {cap.num_layers} layers of "
        f"model {cluster.model!r} ({per}): the model cannot be served until nodes join"
    )


def reachable_max_flow(scratch: Plan | None) -> float:
    """The max flow a plan from scratch reaches, which every max-flow floor here is a share of: the
    from-scratch plan's, or, when higher, its search's ``stats["near_best_max_flow_tok_s"]`` (why:
    ``planner.optimize.near_best_max_flow``; 0: no plan from scratch)."""
    if scratch is None:
        return 0.0
    return max(scratch.max_flow_tok_s, float(scratch.stats.get("near_best_max_flow_tok_s", 0.0)))


def _fewest(cap: CapacityModel, old: Placement, reach: float, options: ReplanOptions,
            search: Deadline) -> FewestMoves | None:
    """Step 3 of the module docstring (None: the cluster has too many ranges, or no floor to keep)."""
    floor = options.fallback_below * reach
    if floor <= 0 or range_count(cap) > EXACT_MAX_RANGES or search.expired():
        return None
    return fewest_moves(cap, old, floor, partial_handoffs=options.partial_handoffs, deadline=search,
                        threads=EXACT_THREADS, then_max_flow_s=search.remaining(), enough_tok_s=reach)


def _settles(fewest: FewestMoves, scratch: Plan | None, objective: Objective) -> bool:
    """Whether step 3's placement scores best under the max flow: the fewest moves, at the max flow the
    from-scratch plan proved optimal (searching on would find nothing better)."""
    return (objective == Objective.MAX_FLOW and scratch is not None and scratch.status == "optimal"
            and fewest.status == "optimal" and fewest.max_flow_tok_s is not None
            and fewest.max_flow_tok_s >= scratch.max_flow_tok_s * (1 - 1e-9))


def _searches(ev: Evaluator, old: Placement, start: Placement | None, scratch: Plan | None, scratch_value: float,
              reach: float, fewest: FewestMoves | None, options: ReplanOptions, search: Deadline,
              limit: float) -> Scored:
    """Steps 4 and 5 of the module docstring from the warm start (None: it left layers uncovered)."""
    # the objective search, and under serving a first move search, run on the max flow: microseconds a move
    flow_ev = ev if ev.objective == Objective.MAX_FLOW.value else Evaluator(
        ev.cap, Objective.MAX_FLOW.value, partial_handoffs=options.partial_handoffs)
    exact = fewest.placement if fewest is not None else None
    starts = [] if start is None else [start]
    if start is not None and exact is None:  # step 3's placement, when there is one, is the better start
        starts.append(_search(flow_ev, start, search.within(SEARCH_SHARE * limit), options.seed, anchor=old).placement)
    if scratch is not None:
        starts.append(as_placement(scratch.placement))
    if exact is not None:
        starts.append(exact)
    floor = options.fallback_below * reach
    if flow_ev is not ev:
        starts.append(_move_search(flow_ev, old, starts, options, search.within(SEARCH_SHARE * limit),
                                   floor=floor).placement)
    return _move_search(ev, old, starts, options, search, floor=options.fallback_below * scratch_value,
                        flow_floor=floor if flow_ev is not ev else 0.0)


def _move_search(ev: Evaluator, old: Placement, starts: list[Placement], options: ReplanOptions, search: Deadline,
                 *, floor: float, flow_floor: float = 0.0) -> Scored:
    """Step 5 of the module docstring: the best placement for the objective less the moves' price and the
    shortfall below ``floor`` (under ``serving`` also the max flow's below ``flow_floor``, as a share of
    ``floor``), searched from every start (the time left shared among them)."""
    best = max(ev.score(st).key[0] for st in starts)
    price = options.move_cost * max(abs(best), 1e-9)

    flow = ev.objective == Objective.MAX_FLOW.value

    def cost(pl: Placement, value: float) -> float:
        short = max(0.0, floor - value)
        if flow and short > 0:  # and each layer's own shortfall: a gradient where the minimum alone has none
            short += sum(max(0.0, floor - c) for c in ev.cap.coverage(pl)) / ev.cap.num_layers
        if flow_floor > 0:  # serving: the max flow keeps its floor too (plans of equal estimate differ in it)
            short += max(0.0, 1.0 - ev.exact_max_flow(pl) / flow_floor) * abs(floor)
        return price * layers_moved(old, pl) + SHORTFALL_PRICE * short

    priced = Evaluator(ev.cap, ev.objective, partial_handoffs=ev.partial_handoffs, serving_model=ev.serving_model,
                       deadline=ev.deadline, penalty=cost)
    for st in starts:  # the starts are scored already (a serving evaluation is slow): priced, not evaluated again
        got_st = ev.score(st)
        priced.cache[frozenset(st.items())] = replace(
            got_st, key=(round(got_st.key[0] - cost(st, got_st.key[0]), 6), *got_st.key[1:]), flows=None)
    ranked = sorted(starts, key=lambda st: priced.score(st).key, reverse=True)  # best first: a slow objective
    runs = len(ranked) + MOVE_RESTARTS                                        # may have time for few
    got = [_search(priced, st, search.share(1.0 / (runs - i)), options.seed + 1 + i, anchor=old)
           for i, st in enumerate(ranked)]
    best_found = max(got, key=lambda s: s.key)
    for i in range(len(starts), runs):  # restarts from the best, each with its own seed
        again = _search(priced, best_found.placement, search.share(1.0 / (runs - i)), options.seed + 1 + i, anchor=old)
        best_found = max(best_found, again, key=lambda s: s.key)
    return best_found


def _search(ev: Evaluator, start: Placement, deadline: Deadline, seed: int, anchor: Placement | None = None) -> Scored:
    """``improve`` until it has tried :data:`STALL_CANDIDATES` candidates without a gain (it polls its
    deadline once per candidate: a count, so the stop is deterministic)."""
    polls = [0, 0]  # candidates tried; when the last gain came

    def stalled() -> bool:
        polls[0] += 1
        return polls[0] - polls[1] >= STALL_CANDIDATES

    def gained(_: Scored) -> None:
        polls[1] = polls[0]

    got = improve(ev, start, deadline=deadline.within(deadline.remaining(), stop=stalled), seed=seed,
                  on_improve=gained, anchor=anchor)
    first = ev.score(start)
    return got if got.key >= first.key else first


def _finish(cluster: ClusterSpec, profiles: ProfileSet, cap: CapacityModel, found: Scored, options: ReplanOptions,
            deadline: Deadline, t0: float) -> Plan:
    """The incremental placement as a checked plan, with balanced flows when the QP finishes in time."""
    flows: list[FlowEdge] | None = None
    got = balance(cap, found.placement, partial_handoffs=options.partial_handoffs, deadline=deadline)
    if got is not None:
        flows = got[1]
    plan = finish_plan(cluster, profiles, found.placement, method="helix", objective=str(options.objective),
                       partial_handoffs=options.partial_handoffs, status="feasible", wall_s=deadline.clock() - t0,
                       cap=cap, flows=flows, stats={"balanced_flows": flows is not None})
    if plan.max_flow_tok_s <= 0:
        raise InfeasiblePlanError(f"{cluster.source}: no complete pipeline: the incremental placement serves 0 tok/s")
    return plan


def _from_scratch(cluster: ClusterSpec, profiles: ProfileSet, cap: CapacityModel, old: Placement,
                  options: ReplanOptions, search: Deadline, *, required: bool) -> Plan | None:
    """A plan from scratch in the time left, relabelled to move the fewest layers (None: it failed and
    the incremental plan stands; ``required``: no incremental plan, so its failure is the answer)."""
    try:
        plan = make_plan(cluster, profiles, method="helix", objective=str(options.objective),
                         partial_handoffs=options.partial_handoffs, seed=options.seed, simulate=False,
                         deadline=search.within(search.remaining()), time_limit_s=max(search.remaining(), 1e-3))
    except InfeasiblePlanError:
        if required:
            raise
        return None
    groups = {n: f"{cap.kind_of[n]}@{cap.region_of[n]}" for n in cap.nodes}
    takes = relabel(plan.placement, old, groups)
    if all(a == b for a, b in takes.items()):
        return plan
    name = {b: a for a, b in takes.items()}  # the node whose range another takes -> that node
    flows = [FlowEdge(src=name.get(e.src, e.src), dst=name.get(e.dst, e.dst), tok_s=e.tok_s) for e in plan.flows]
    try:
        again = finish_plan(cluster, profiles, renamed(plan.placement, takes), method=plan.method,
                            objective=plan.objective, partial_handoffs=options.partial_handoffs, status=plan.status,
                            wall_s=plan.wall_s, cap=cap, upper_bound_tok_s=plan.upper_bound_tok_s,
                            bound_method=plan.bound_method, stop_reason=plan.stop_reason, score=plan.score,
                            stats=plan.stats, flows=flows)
    except ConfigError:  # the renamed flows do not fit the links (explicit links): keep the plan as found
        return plan
    return again if again.max_flow_tok_s >= plan.max_flow_tok_s * (1 - 1e-9) else plan


def decide(values: dict[str, float], max_flows: dict[str, float], fallback_below: float) -> tuple[str, str]:
    """Incremental or from scratch, and why (module docstring, step 6): ``values`` the objective of each plan
    ("incremental", "from-scratch" when there is one), ``max_flows`` their max flows and the ``reachable``
    one (:func:`reachable_max_flow`) when they must keep the floor as well (under ``serving``; empty: the
    objective is the max flow). Below the max-flow floor, the plan from scratch is the answer only when it
    has more max flow than the incremental one."""
    if "from-scratch" not in values:
        return "incremental", "fallback off" if fallback_below <= 0 else "no plan from scratch in time"
    inc, scratch = values["incremental"], values["from-scratch"]
    ratio = inc / scratch if scratch > 0 else 1.0
    if ratio < fallback_below:
        return "from-scratch", f"incremental objective is {ratio:.1%} of from-scratch's (< {fallback_below:.0%})"
    if max_flows:
        reach = max(max_flows.get("reachable", 0.0), max_flows["from-scratch"])
        flow = max_flows["incremental"] / reach if reach > 0 else 1.0
        if flow < fallback_below and max_flows["from-scratch"] > max_flows["incremental"]:
            return "from-scratch", (f"incremental objective is {ratio:.1%} of from-scratch's but its max flow "
                                    f"{flow:.1%} of the reachable (< {fallback_below:.0%})")  # fmt: skip
    return "incremental", f"incremental objective is {ratio:.1%} of from-scratch's (>= {fallback_below:.0%})"
