"""The Helix paper's placement MILP (section 3.3), exactly as formulated, solved with pulp.

This is the only planner module that imports pulp. It owns

* :func:`solve_paper_milp` — method ``paper-milp``: the paper's model, for reference and
  comparison (our default optimizer lives in ``planner.optimize``);
* :func:`solve_pulp` — a small generic wrapper (solver choice, threads, time limit, warm
  start, progress, early stop) that other planner code may reuse for its own sub-MILPs.

The formulation, with ``L`` layers, node ``i`` holding at most ``K_i`` layers and
``T_i(k)`` its tokens/s through ``k`` layers:

* node variables: integer start ``s_i`` in ``[0, L-1]`` and one-hot binaries ``b_{i,k}``
  (``k = 1..K_i``, ``sum_k b_{i,k} = 1``); the end is ``e_i = s_i + sum_k k b_{i,k} <= L``;
* edge variables, for every link of the (optionally pruned) cluster including the
  coordinator's (source/sink): real flow ``f_e >= 0`` and binary validity ``d_e``;
* constraint 1 (placement): the one-hot sum and ``e_i <= L``;
* constraint 2 (flow conservation) at every node: flow in = flow out;
* constraint 3 (inference throughput): flow in ``<= sum_k T_i(k) b_{i,k}``;
* constraint 4 (transmission): ``f_e <= C_e d_e``, with big-M (``M = L``) linearisations of
  validity: ``source->i`` needs ``s_i = 0``; ``i->sink`` needs ``e_i = L``; ``i->j`` needs
  ``s_j <= e_i < e_j`` with partial-layer hand-offs, ``e_i = s_j`` without;
* objective: maximise the flow out of the source (capped by the coordinator NIC if given).

The paper's speed-ups are options: a heuristic warm start, link pruning (keep only the
fastest links of every node) and an early stop once the incumbent meets the network-free
upper bound ``sum_i max_k k T_i(k) / L`` (added as the valid cut ``objective <= bound`` so
that every solver's own gap test stops there).

Why it is weak (see docs/planner.md): the LP relaxation lets ``d_e`` be fractional, so
flows cross every link at once and the bound is tens of times the optimum; with many
identical GPUs the search is highly symmetric. Open-source solvers rarely improve on a
good warm start on 24 nodes; small instances solve to optimality.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import pulp

from helix.errors import ConfigError, InfeasiblePlanError
from helix.perf_model import NETWORK_FREE_BOUND, network_free_bound
from helix.units import link_tokens_per_s
from planner.budget import Deadline
from planner.graph import CapacityModel, Placement, evaluate
from planner.highs_model import log_solver_line, quiet_banner, solver_log_wanted
from planner.progress import Progress, ProgressFn

log = logging.getLogger(__name__)

SOLVERS = ("highs", "cbc", "gurobi")




@dataclass(slots=True)
class SolveOutcome:
    """What :func:`solve_pulp` found: status text, objective, best proven bound, solver name."""

    status: str
    objective: float | None
    bound: float | None
    solver: str
    wall_s: float
    stopped_early: bool = False


@dataclass(slots=True)
class MilpResult:
    placement: Placement
    objective_tok_s: float
    upper_bound_tok_s: float
    bound_method: str
    status: str
    solver: str
    wall_s: float
    stats: dict[str, Any] = field(default_factory=dict)


# -- a generic pulp solve --------------------------------------------------------------------


def _highs_solver_class() -> type:
    """pulp's HiGHS (highspy) API, plus a warm start (``setSolution``) it lacks."""

    class _HiGHSWarm(pulp.HiGHS):  # type: ignore[misc, name-defined]
        def __init__(self, *args: Any, initial: dict[str, float] | None = None, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.initial = initial

        def callSolver(self, lp: Any) -> None:  # noqa: N802 - pulp's name
            if self.initial:
                import numpy as np

                idx, val = [], []
                for var in lp.variables():
                    if var.name in self.initial:
                        idx.append(var.index)
                        val.append(float(self.initial[var.name]))
                lp.solverModel.setSolution(len(idx), np.array(idx, dtype=np.int32), np.array(val, dtype=np.float64))
            # HiGHS refuses a thread count other than the one its process-wide scheduler was
            # started with (e.g. by an earlier solve with threads=1): start a fresh scheduler.
            import highspy

            if solver_log_wanted():  # the log goes to the DEBUG logger (helix -vv), never the console
                lp.solverModel.setOptionValue("output_flag", True)
                lp.solverModel.setOptionValue("log_to_console", False)
            highspy.Highs.resetGlobalScheduler(True)
            try:
                lp.solverModel.run()
            finally:  # and leave none behind, so later solves may pick their own thread count
                highspy.Highs.resetGlobalScheduler(True)

    return _HiGHSWarm


def _cbc(**options: Any) -> Any:
    """CBC through pulp: a ``cbc`` on the PATH (``COIN_CMD``, e.g. ``pip install pulp[cbc]``), else
    the binary bundled with pulp < 4 (``PULP_CBC_CMD``, deprecated there and gone in PuLP 4.0)."""
    coin = pulp.COIN_CMD(**options)
    if coin.available():
        return coin
    bundled = getattr(pulp, "PULP_CBC_CMD", None)
    if bundled is None:
        return coin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # handled: COIN_CMD is preferred above
        return bundled(**options)


def solver_available(name: str) -> bool:
    if name == "highs":
        return pulp.HiGHS().available()
    if name == "cbc":
        return bool(_cbc(msg=False).available())
    if name == "gurobi":
        try:
            return bool(pulp.GUROBI(msg=False).available())
        except Exception:  # noqa: BLE001 - a missing or unlicensed gurobipy
            return False
    return False


def solver_label(name: str) -> str:
    if name == "highs":
        import highspy

        return f"highs {getattr(highspy, '__version__', '')}".strip() + " (pulp)"
    return f"{name} (pulp {pulp.__version__})"


def solve_pulp(
    prob: pulp.LpProblem,
    *,
    solver: str = "highs",
    time_limit_s: float | None = None,
    threads: int = 1,
    gap_rel: float | None = None,
    initial: dict[str, float] | None = None,
    on_progress: ProgressFn | None = None,
    stop_at: float | None = None,
) -> SolveOutcome:
    """Solve a pulp model with HiGHS (default), CBC or Gurobi; never needs a licence.

    ``initial`` maps variable names to a warm start; ``stop_at`` interrupts HiGHS as soon as
    the incumbent reaches that objective. ``on_progress`` gets incumbent/bound reports
    (HiGHS only; the others report once at the end).
    """
    if solver not in SOLVERS:
        raise ConfigError(f"unknown solver {solver!r} (choose from {', '.join(SOLVERS)})", field="--solver")
    if not solver_available(solver):
        raise ConfigError(f"solver {solver!r} is not installed or not usable here", field="--solver")
    maximize = prob.sense == pulp.LpMaximize
    sign = -1.0 if maximize else 1.0
    t0 = time.monotonic()
    state: dict[str, Any] = {"stopped": False, "bound": None, "last": 0.0}
    if initial:
        for var in prob.variables():
            if var.name in initial:
                var.setInitialValue(initial[var.name])
    if solver == "highs":
        import highspy

        quiet_banner()
        log_kind = int(highspy.cb.HighsCallbackType.kCallbackLogging)

        def callback(kind: int, message: str, out: Any, inp: Any, user: Any) -> None:
            if int(kind) == log_kind:
                log_solver_line(message)
                return
            inc = out.mip_primal_bound
            bnd = out.mip_dual_bound
            inc_v = None if not math.isfinite(inc) or abs(inc) >= 1e30 else sign * inc
            bnd_v = None if not math.isfinite(bnd) or abs(bnd) >= 1e30 else sign * bnd
            if bnd_v is not None:
                state["bound"] = bnd_v
            now = time.monotonic() - t0
            if on_progress is not None and (now - state["last"] >= 0.5 or kind != int(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)):
                state["last"] = now
                on_progress(Progress(inc_v, bnd_v, now))
            if stop_at is not None and inc_v is not None and (inc_v >= stop_at - 1e-6 if maximize else inc_v <= stop_at + 1e-6):
                state["stopped"] = True
                inp.user_interrupt = True

        kinds = [highspy.cb.HighsCallbackType.kCallbackMipInterrupt, highspy.cb.HighsCallbackType.kCallbackMipImprovingSolution]
        if solver_log_wanted():
            kinds.append(highspy.cb.HighsCallbackType.kCallbackLogging)
        cls = _highs_solver_class()
        s = cls(
            msg=False,
            timeLimit=time_limit_s,
            threads=threads,
            gapRel=gap_rel,
            initial=initial,
            callbackTuple=(callback, None),
            callbacksToActivate=kinds,
        )
    elif solver == "cbc":
        s = _cbc(msg=False, timeLimit=time_limit_s, threads=threads, gapRel=gap_rel, warmStart=bool(initial))
    else:
        s = pulp.GUROBI(msg=False, timeLimit=time_limit_s, threads=threads, gapRel=gap_rel, warmStart=bool(initial))
    prob.solve(s)
    wall = time.monotonic() - t0
    obj = pulp.value(prob.objective)
    sol_status = prob.sol_status
    has_solution = sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible) and obj is not None
    if state["stopped"]:
        status = "reached_target"
    elif sol_status == pulp.LpSolutionOptimal:
        status = "optimal"
    elif prob.status == pulp.LpStatusInfeasible:
        status = "infeasible"
    elif has_solution:
        status = "time_limit"
    else:
        status = "no_solution"
    bound = state["bound"]
    if status == "optimal" and obj is not None:
        bound = obj
    if on_progress is not None:
        on_progress(Progress(float(obj) if has_solution else None, bound, wall, status))
    return SolveOutcome(
        status=status,
        objective=float(obj) if has_solution else None,
        bound=bound,
        solver=solver_label(solver),
        wall_s=wall,
        stopped_early=state["stopped"],
    )


# -- the paper's model -----------------------------------------------------------------------


def prune_links(cap: CapacityModel, frac: float) -> CapacityModel:
    """Drop the slowest ``frac`` of every node's outgoing node-to-node links (coordinator links stay).

    Ties (equal bandwidth) go by higher latency first, then by name, so the result is
    deterministic. ``frac = 0`` keeps everything.
    """
    if not 0.0 <= frac < 1.0:
        raise ConfigError(f"link pruning fraction must be in [0, 1), got {frac}", field="--prune-links")
    if frac == 0.0:
        return cap
    coord = cap.coordinator
    keep: dict[tuple[str, str], float] = {}
    by_src: dict[str, list[tuple[str, str]]] = {}
    for (a, b), bw in cap.links.items():
        if a == coord or b == coord:
            keep[(a, b)] = bw
        else:
            by_src.setdefault(a, []).append((a, b))
    for edges in by_src.values():
        edges.sort(key=lambda e: (-cap.links[e], cap.latency_ms.get(e, 0.0), e[1]))
        n_keep = max(1, math.ceil(len(edges) * (1.0 - frac)))
        for e in edges[:n_keep]:
            keep[e] = cap.links[e]
    return replace(cap, links=keep, latency_ms={e: cap.latency_ms.get(e, 0.0) for e in keep})


@dataclass(slots=True)
class _Model:
    prob: pulp.LpProblem
    start: dict[str, pulp.LpVariable]
    count: dict[str, dict[int, pulp.LpVariable]]
    flow: dict[tuple[str, str], pulp.LpVariable]
    valid: dict[tuple[str, str], pulp.LpVariable]


def _var_name(kind: str, *parts: object) -> str:
    return kind + "_" + "_".join(str(p) for p in parts)


def build_paper_milp(cap: CapacityModel, *, partial_handoffs: bool = True, cap_objective: float | None = None) -> _Model:
    """The section-3.3 model over the links present in ``cap``."""
    num = cap.num_layers
    coord = cap.coordinator
    nodes = list(cap.node_tok_s)
    index = {n: i for i, n in enumerate(nodes)}
    prob = pulp.LpProblem("helix_paper_placement", pulp.LpMaximize)

    def var(name: str, low: float | None = None, up: float | None = None, cat: str = pulp.LpContinuous) -> pulp.LpVariable:
        if hasattr(prob, "add_variable"):  # pulp >= 3.3
            return prob.add_variable(name, low, up, cat=cat)
        return pulp.LpVariable(name, low, up, cat=cat)

    start = {n: var(_var_name("s", index[n]), 0, num - 1, cat=pulp.LpInteger) for n in nodes}
    count = {
        n: {k: var(_var_name("b", index[n], k), cat=pulp.LpBinary) for k in range(1, min(cap.max_layers[n], num) + 1)}
        for n in nodes
    }
    end = {n: start[n] + pulp.lpSum(k * v for k, v in count[n].items()) for n in nodes}
    flow: dict[tuple[str, str], pulp.LpVariable] = {}
    valid: dict[tuple[str, str], pulp.LpVariable] = {}

    def vid(v: str) -> str:
        return "src" if v == coord else str(index[v])

    for a, b in cap.links:
        if a == coord and b == coord:
            continue
        key = (a, b)
        flow[key] = var(_var_name("f", vid(a), vid(b)), 0)
        valid[key] = var(_var_name("d", vid(a), vid(b)), cat=pulp.LpBinary)

    source_out = pulp.lpSum(f for (a, _), f in flow.items() if a == coord)
    prob += source_out
    for n in nodes:  # constraint 1: one layer count, the range inside the model
        prob += pulp.lpSum(count[n].values()) == 1, f"onehot_{index[n]}"
        prob += end[n] <= num, f"end_{index[n]}"
    for n in nodes:  # constraints 2 and 3
        inflow = pulp.lpSum(f for (a, b), f in flow.items() if b == n)
        outflow = pulp.lpSum(f for (a, b), f in flow.items() if a == n)
        prob += inflow == outflow, f"conserve_{index[n]}"
        prob += inflow <= pulp.lpSum(cap.node_capacity(n, k) * v for k, v in count[n].items()), f"compute_{index[n]}"
    big_m = num
    for (a, b), f in flow.items():  # constraint 4, with the validity of each link
        d = valid[(a, b)]
        tag = f"{vid(a)}_{vid(b)}"
        if a == coord:
            c = cap.token_link_tok_s(a, b)
            prob += start[b] <= big_m * (1 - d), f"vsrc_{tag}"
        elif b == coord:
            c = cap.token_link_tok_s(a, b)
            prob += num - end[a] <= big_m * (1 - d), f"vsink_{tag}"
        else:
            c = cap.activation_link_tok_s(a, b)
            if partial_handoffs:
                prob += start[b] - end[a] <= big_m * (1 - d), f"vlo_{tag}"
                prob += end[a] + 1 - end[b] <= big_m * (1 - d), f"vhi_{tag}"
            else:
                prob += end[a] - start[b] <= big_m * (1 - d), f"veq1_{tag}"
                prob += start[b] - end[a] <= big_m * (1 - d), f"veq2_{tag}"
        assert c is not None
        prob += f <= c * d, f"link_{tag}"
    if cap.nic_gbps is not None:
        prob += source_out <= link_tokens_per_s(cap.nic_gbps, cap.token_bytes), "nic_out"
    if cap_objective is not None:
        prob += source_out <= cap_objective, "network_free_bound"
    return _Model(prob, start, count, flow, valid)


def warm_start_values(model: _Model, cap: CapacityModel, placement: Placement, *, partial_handoffs: bool) -> dict[str, float]:
    """A full, consistent assignment of the model's variables for a placement (its max flow)."""
    values: dict[str, float] = {}
    for n, (s, e) in placement.items():
        values[model.start[n].name] = s
        for k, v in model.count[n].items():
            values[v.name] = 1.0 if k == e - s else 0.0
    result = evaluate(cap, placement, partial_handoffs=partial_handoffs, with_cut=False)
    on_edge = {(fe.src, fe.dst): fe.tok_s for fe in result.flows}
    coord = cap.coordinator
    for (a, b), f in model.flow.items():
        ra = placement.get(a) if a != coord else None
        rb = placement.get(b) if b != coord else None
        if a == coord:
            ok = rb is not None and rb[0] == 0
        elif b == coord:
            ok = ra is not None and ra[1] == cap.num_layers
        elif ra is None or rb is None:
            ok = False
        elif partial_handoffs:
            ok = rb[0] <= ra[1] < rb[1]
        else:
            ok = ra[1] == rb[0]
        values[model.valid[(a, b)].name] = 1.0 if ok else 0.0
        values[f.name] = on_edge.get((a, b), 0.0) if ok else 0.0
    return values


def solve_paper_milp(
    cap: CapacityModel,
    *,
    partial_handoffs: bool = True,
    time_limit_s: float = 60.0,
    threads: int = 1,
    solver: str = "highs",
    warm_start: Placement | None = None,
    prune_links_frac: float = 0.0,
    stop_at_bound: bool = False,
    on_progress: ProgressFn | None = None,
    deadline: Deadline | None = None,
) -> MilpResult:
    """Method ``paper-milp``: build the section-3.3 model and solve it by ``deadline``
    (default: ``time_limit_s`` from now; building the model counts against it).

    Returns the placement the solver ended with (at worst the warm start), the solver's
    objective on the (possibly pruned) model, and the better of the solver's proven bound
    and the network-free bound.
    """
    deadline = deadline if deadline is not None else Deadline.after(time_limit_s)
    t0 = time.monotonic()
    work = prune_links(cap, prune_links_frac)
    nf_bound = network_free_bound(cap.node_tok_s.values(), cap.num_layers)
    model = build_paper_milp(work, partial_handoffs=partial_handoffs, cap_objective=nf_bound if stop_at_bound else None)
    initial = None
    if warm_start is not None:
        initial = warm_start_values(model, work, warm_start, partial_handoffs=partial_handoffs)
    stats = {
        "variables": len(model.prob.variables()),
        "constraints": model.prob.numConstraints(),
        "links": len(model.flow),
        "pruned_links": len(cap.links) - len(work.links),
    }
    log.info("paper MILP: %(variables)d variables, %(constraints)d constraints", stats)
    outcome = solve_pulp(
        model.prob,
        solver=solver,
        time_limit_s=deadline.solver_limit(),
        threads=threads,
        initial=initial,
        on_progress=on_progress,
        stop_at=nf_bound * (1 - 1e-6) if stop_at_bound else None,
    )
    if outcome.objective is None:
        if warm_start is None:
            raise InfeasiblePlanError(
                f"paper-milp: {outcome.solver} found no placement in {time_limit_s:g} s ({outcome.status}); "
                "give it a warm start or more time"
            )
        placement, objective = dict(warm_start), 0.0
    else:
        placement = {}
        for n in cap.node_tok_s:
            s = int(round(model.start[n].value() or 0))
            k = max(model.count[n], key=lambda kk: model.count[n][kk].value() or 0.0)
            placement[n] = (s, s + k)
        objective = outcome.objective
    bound = nf_bound
    method = f"network-free ({NETWORK_FREE_BOUND})"
    if outcome.bound is not None and outcome.bound < bound and prune_links_frac == 0.0:
        bound, method = outcome.bound, f"MILP dual bound ({outcome.solver})"
    stats.update({"milp_objective_tok_s": objective, "milp_status": outcome.status, "milp_bound_tok_s": outcome.bound})
    return MilpResult(
        placement=placement,
        objective_tok_s=objective,
        upper_bound_tok_s=bound,
        bound_method=method,
        status=outcome.status,
        solver=outcome.solver,
        wall_s=time.monotonic() - t0,
        stats=stats,
    )
