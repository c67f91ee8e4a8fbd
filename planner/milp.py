"""The Helix paper's placement MILP (section 3.3), exactly as formulated, stated in pulp.

:func:`solve_paper_milp` is method ``paper-milp``: the paper's model, for reference and
comparison (our default optimizer lives in ``planner.optimize``). The model is stated and solved
through the solver layer (``planner.solvers``: pulp, with HiGHS, CBC or Gurobi).

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

Beyond the paper: capacities links share (a region's uplink / downlink, a node's NIC;
:mod:`planner.shared_links`) cap their links' flows together, one row each
(``sum_e bytes_e f_e <= limit``), as the max-flow graph's evaluation does.

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
import time
from dataclasses import dataclass, field
from typing import Any

from helix.domain import LayerRange, Placement
from helix.errors import InfeasiblePlanError
from helix.perf_model import NETWORK_FREE_BOUND, network_free_bound
from helix.units import link_tokens_per_s
from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.graph import evaluate
from planner.progress import ProgressFn
from planner.shared_links import shared_capacities
from planner.solvers import add_variable, lp_sum, new_problem, solve_pulp

log = logging.getLogger(__name__)


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


@dataclass(slots=True)
class _Model:  # pulp's objects (the problem and its variables by role)
    prob: Any
    start: dict[str, Any]
    count: dict[str, dict[int, Any]]
    flow: dict[tuple[str, str], Any]
    valid: dict[tuple[str, str], Any]


def _var_name(kind: str, *parts: object) -> str:
    return kind + "_" + "_".join(str(p) for p in parts)


def build_paper_milp(cap: CapacityModel, *, partial_handoffs: bool = True, cap_objective: float | None = None) -> _Model:
    """The section-3.3 model over the links present in ``cap``."""
    num = cap.num_layers
    coord = cap.coordinator
    nodes = list(cap.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    prob = new_problem("helix_paper_placement", maximize=True)

    def var(name: str, low: float | None = None, up: float | None = None, kind: str = "continuous") -> Any:
        return add_variable(prob, name, low, up, kind=kind)

    start = {n: var(_var_name("s", index[n]), 0, num - 1, kind="integer") for n in nodes}
    count = {
        n: {k: var(_var_name("b", index[n], k), kind="binary") for k in range(1, min(cap.max_layers[n], num) + 1)}
        for n in nodes
    }
    end = {n: start[n] + lp_sum(k * v for k, v in count[n].items()) for n in nodes}
    flow: dict[tuple[str, str], Any] = {}
    valid: dict[tuple[str, str], Any] = {}

    def vid(v: str) -> str:
        return "src" if v == coord else str(index[v])

    for a, b in cap.links:
        if a == coord and b == coord:
            continue
        key = (a, b)
        flow[key] = var(_var_name("f", vid(a), vid(b)), 0)
        valid[key] = var(_var_name("d", vid(a), vid(b)), kind="binary")

    source_out = lp_sum(f for (a, _), f in flow.items() if a == coord)
    prob += source_out
    for n in nodes:  # constraint 1: one layer count, the range inside the model
        prob += lp_sum(count[n].values()) == 1, f"onehot_{index[n]}"
        prob += end[n] <= num, f"end_{index[n]}"
    for n in nodes:  # constraints 2 and 3
        inflow = lp_sum(f for (a, b), f in flow.items() if b == n)
        outflow = lp_sum(f for (a, b), f in flow.items() if a == n)
        prob += inflow == outflow, f"conserve_{index[n]}"
        prob += inflow <= lp_sum(cap.node_capacity(n, k) * v for k, v in count[n].items()), f"compute_{index[n]}"
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
    for i, row in enumerate(shared_capacities(cap, ((key, key[0], key[1]) for key in flow))):
        unit = max(nbytes for _, nbytes in row.edges)  # in tokens/s of the row's largest messages
        prob += lp_sum(nbytes / unit * flow[key] for key, nbytes in row.edges) <= row.bytes_per_s / unit, f"shared_{i}"
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
    work = cap.pruned(prune_links_frac)
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
    placement: Placement = {}
    if outcome.objective is None:
        if warm_start is None:
            raise InfeasiblePlanError(
                f"paper-milp: {outcome.solver} found no placement in {time_limit_s:g} s ({outcome.status}); "
                "give it a warm start or more time"
            )
        placement, objective = dict(warm_start), 0.0
    else:
        for n in cap.nodes:
            s = int(round(model.start[n].value() or 0))
            k = max(model.count[n], key=lambda kk: model.count[n][kk].value() or 0.0)
            placement[n] = LayerRange(s, s + k)
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
