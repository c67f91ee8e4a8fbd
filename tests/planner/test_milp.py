"""The paper's MILP (``paper-milp``) on a small instance reaches the brute-force optimum."""

from __future__ import annotations

import itertools

import pytest

from planner import milp, solvers
from planner.api import make_plan
from planner.capacity import CapacityModel
from planner.graph import max_flow_value
from planner.progress import Progress

from .conftest import load, small_instance


def brute_force(cap: CapacityModel, *, partial_handoffs: bool) -> float:
    options = {
        n: [(s, s + k) for k in range(1, cap.max_layers[n] + 1) for s in range(cap.num_layers - k + 1)]
        for n in cap.nodes
    }
    nodes = list(options)
    best = 0.0
    for combo in itertools.product(*(options[n] for n in nodes)):
        placement = dict(zip(nodes, combo, strict=True))
        best = max(best, max_flow_value(cap, placement, partial_handoffs=partial_handoffs))
    return best


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    cluster, profiles = load(small_instance(tmp_path_factory.mktemp("small")))
    cap = CapacityModel.build(cluster, profiles)
    return cluster, profiles, cap, {p: brute_force(cap, partial_handoffs=p) for p in (True, False)}


@pytest.mark.parametrize("partial", [True, False])
def test_paper_milp_reaches_brute_force_optimum(small, partial: bool) -> None:
    cluster, profiles, cap, optimum = small
    res = milp.solve_paper_milp(cap, partial_handoffs=partial, time_limit_s=60, threads=1)
    assert res.status == "optimal"
    assert res.objective_tok_s == pytest.approx(optimum[partial], rel=1e-6)
    assert max_flow_value(cap, res.placement, partial_handoffs=partial) == pytest.approx(optimum[partial], rel=1e-6)
    plan = make_plan(cluster, profiles, method="paper-milp", partial_handoffs=partial, threads=1, time_limit_s=60)
    assert plan.max_flow_tok_s == pytest.approx(optimum[partial], rel=1e-6)
    assert plan.upper_bound_tok_s is not None and plan.upper_bound_tok_s >= plan.max_flow_tok_s - 1e-6
    assert plan.solver and plan.solver.startswith("highs")


def test_warm_start_is_kept_and_progress_reported(small) -> None:
    _, _, cap, optimum = small
    warm = {"b0": (0, 2), "b1": (2, 4), "s0": (0, 1), "s1": (3, 4)}
    seen: list[Progress] = []
    res = milp.solve_paper_milp(cap, time_limit_s=60, threads=1, warm_start=warm, on_progress=seen.append)
    assert res.objective_tok_s == pytest.approx(optimum[True], rel=1e-6)
    assert seen and seen[-1].message == "optimal"


def test_stop_at_bound_and_pruning(small) -> None:
    _, _, cap, _ = small
    pruned = cap.pruned(0.5)
    assert len(pruned.links) < len(cap.links)
    assert all(k in cap.links for k in pruned.links)
    res = milp.solve_paper_milp(cap, time_limit_s=60, threads=1, prune_links_frac=0.5, stop_at_bound=True)
    assert res.stats["pruned_links"] > 0
    assert max_flow_value(cap, res.placement) >= res.objective_tok_s - 1e-6  # full graph only adds edges


def test_cbc_is_selectable(small) -> None:
    _, _, cap, optimum = small
    assert solvers.solver_available("cbc"), "PuLP's bundled CBC is missing"
    res = milp.solve_paper_milp(cap, time_limit_s=60, threads=1, solver="cbc")
    assert res.objective_tok_s == pytest.approx(optimum[True], rel=1e-5)


def test_gurobi_never_required(small) -> None:
    _, _, cap, _ = small
    if solvers.solver_available("gurobi"):
        pytest.skip("Gurobi is usable here")
    from helix.errors import ConfigError

    with pytest.raises(ConfigError, match="not installed"):
        milp.solve_paper_milp(cap, time_limit_s=5, solver="gurobi")


def test_later_highs_solves_may_use_another_thread_count(small) -> None:
    """HiGHS keeps one process-wide scheduler; a paper-milp solve must not leave it pinned."""
    import highspy

    _, _, cap, _ = small
    milp.solve_paper_milp(cap, time_limit_s=30, threads=2)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.addVar(0.0, 1.0)
    h.changeColCost(0, -1.0)
    assert h.run() == highspy.HighsStatus.kOk
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal
