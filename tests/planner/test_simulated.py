"""The serving search's simulated refinement (``planner.simulated``): whole-group moves, re-ranking the
model's candidates by our simulator under both flows, the deadline, and clusters it cannot simulate."""

from __future__ import annotations

import json
import random

import pytest

from helix.cli import main
from helix.domain import LayerRange, Placement
from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner.budget import STALL_MIN_S, Deadline
from planner.capacity import CapacityModel
from planner.flows import balanced_flows
from planner.local_search import Evaluator, group_moves, neighbourhood
from planner.optimize import optimize
from planner.options import PlannerOptions
from planner.serving_model import ServingModel
from planner.simulated import Refinement, SimScorer, refine, simulable
from simulator.engine import SimConfig, simulate
from simulator.short_run import run_short

from .conftest import DEMO, SINGLE24, load

# a short window keeps the tests quick; on single24 it ranks the two stage plans below as 60 + 600 s does
WARMUP_S, MEASURE_S = 30.0, 120.0


def stage_plan(cap: CapacityModel, groups: list[tuple[str, int, int]]) -> Placement:
    """``(GPU type, nodes, layers)`` per stage, in pipeline order: the type's nodes by id, first unused first."""
    free = {t: sorted(n for n in cap.nodes if cap.gpu_of[n] == t) for t in set(cap.gpu_of.values())}
    out: Placement = {}
    start = 0
    for gpu, count, layers in groups:
        for _ in range(count):
            out[free[gpu].pop(0)] = LayerRange(start, start + layers)
        start += layers
    assert start == cap.num_layers and all(not left for left in free.values())
    return out


@pytest.fixture(scope="module")
def cap(single24: tuple[ClusterSpec, ProfileSet]) -> CapacityModel:
    return CapacityModel.build(*single24)


def sextets(cap: CapacityModel) -> Placement:
    """10 stages: A100s of 11 layers, L4 pairs of 7, T4 sextets of 4 (the model's pick on single24)."""
    return stage_plan(cap, [("A100", 1, 11)] * 4 + [("L4", 2, 7)] * 4 + [("T4", 6, 4)] * 2)


def quartets(cap: CapacityModel) -> Placement:
    """11 stages: A100s of 11 layers, L4 pairs of 6, T4 quartets of 4 (the model rates it lower, the simulator higher)."""
    return stage_plan(cap, [("A100", 1, 11)] * 4 + [("L4", 2, 6)] * 4 + [("T4", 4, 4)] * 3)


def test_group_moves_shift_whole_groups_and_keep_every_layer_covered(cap: CapacityModel) -> None:
    pl = quartets(cap)
    moves = group_moves(cap, pl)
    ev = Evaluator(cap, "max-flow")
    assert moves and all(ev.valid(m) for m in moves)
    # the boundary between the last L4 pair [62, 68) and the first T4 quartet [68, 72) moved to 69: all six follow
    group = sorted(n for n, r in pl.items() if r in ((62, 68), (68, 72)))
    shifted = [m for m in moves if all(m[n] in ((62, 69), (69, 72)) for n in group)]
    assert len(shifted) == 1 and sum(1 for n in pl if shifted[0][n] != pl[n]) == 6
    # to 67 the T4s would hold 5 layers, more than they can: not a move
    assert not any(m[n] == (67, 72) for m in moves for n in group)
    # a single A100 holds its 11 layers alone: it never leaves, and no T4 takes an A100's 11 layers
    a100s = [n for n in pl if cap.gpu_of[n] == "A100"]
    assert all(m[n] == pl[n] for m in moves for n in a100s if sum(1 for x in pl if m[x] != pl[x]) == 1)
    assert not any(m[n][1] - m[n][0] > cap.max_layers[n] for m in moves for n in m)
    # one T4 of a quartet joins another quartet's range
    assert any(sum(1 for x in pl if m[x] != pl[x]) == 1 and cap.gpu_of[next(x for x in pl if m[x] != pl[x])] == "T4"
               for m in moves)
    near = neighbourhood(cap, pl, random.Random(0))
    assert len({frozenset(m.items()) for m in near}) == len(near) and pl not in near


def test_the_simulator_overrules_the_models_ranking(single24: tuple[ClusterSpec, ProfileSet], cap: CapacityModel) -> None:
    cluster, profiles = single24
    ev = Evaluator(cap, "serving", serving_model=ServingModel(cap))
    first, second = ev.score(sextets(cap)), ev.score(quartets(cap))
    assert first.key > second.key  # the model prefers the sextets ...
    scorer = SimScorer(cluster, profiles, cap, run_short, warmup_s=WARMUP_S, measure_s=MEASURE_S)
    said: list[str] = []
    got = refine(ev, [first, second], scorer, deadline=Deadline.after(600.0), patience=0,
                 report=lambda s, sim, msg: said.append(msg))
    assert got is not None and got.best.placement == second.placement  # ... the simulator the quartets
    assert got.simulations == 2 and got.stop_reason == "patience"
    assert got.simulated.score > got.model_choice.score * 1.01
    assert said == ["simulated re-ranking (1 of 2)", "simulated re-ranking (2 of 2)"]
    # the figures are the simulator's own, under the plan's balanced flows and under the judge's
    value, edges = balanced_flows(cap, second.placement)
    plan = Plan(cluster=cluster.name, model=cluster.model, method="helix", placement=second.placement,
                max_flow_tok_s=value, flows=edges)
    for flows, figure in (("plan", got.simulated.decode_tok_s), ("judge", got.simulated.judge_decode_tok_s)):
        run = simulate(cluster, profiles, plan, SimConfig(warmup_s=WARMUP_S, duration_s=MEASURE_S, flows=flows))
        assert figure == pytest.approx(run.decode_tok_s)
    assert got.simulated.score == min(got.simulated.decode_tok_s, got.simulated.judge_decode_tok_s)


def test_refinement_tries_neighbours_until_its_patience_runs_out(single24: tuple[ClusterSpec, ProfileSet],
                                                                 cap: CapacityModel) -> None:
    cluster, profiles = single24
    ev = Evaluator(cap, "serving", serving_model=ServingModel(cap))
    start = ev.score(quartets(cap))
    scorer = SimScorer(cluster, profiles, cap, run_short, warmup_s=WARMUP_S, measure_s=MEASURE_S)
    got = refine(ev, [start], scorer, deadline=Deadline.after(600.0), patience=2)
    assert got is not None and got.simulations >= 3 and got.stop_reason in ("patience", "exhausted")
    assert len(scorer.cache) == got.simulations
    assert all(ev.valid(dict(k)) for k in scorer.cache)
    assert got.simulated.score >= got.model_choice.score  # never worse than where it started


def test_a_simulation_past_the_deadline_is_abandoned(single24: tuple[ClusterSpec, ProfileSet], cap: CapacityModel) -> None:
    cluster, profiles = single24
    ticks = [0]

    def clock() -> float:  # time passes only as the simulator reports progress
        ticks[0] += 1
        return float(ticks[0])

    scorer = SimScorer(cluster, profiles, cap, run_short, warmup_s=WARMUP_S, measure_s=MEASURE_S)
    assert scorer.score(quartets(cap), Deadline(at=50.0, clock=clock)) is None
    assert not scorer.cache and scorer.candidates == 0
    ev = Evaluator(cap, "serving", serving_model=ServingModel(cap))
    expired = Deadline.after(0.0)
    assert refine(ev, [ev.score(quartets(cap))], scorer, deadline=expired) is None


def test_clusters_without_latency_curves_skip_the_phase() -> None:
    cluster, profiles = load(DEMO)  # tok_s tables only
    assert not simulable(cluster, profiles)
    res = optimize(cluster, profiles, PlannerOptions(objective="serving", time_limit_s=10, threads=1, stall_s=0.5),
                   simulator=run_short)
    assert "simulations" not in res.stats and "simulated_decode_tok_s" not in res.score
    assert res.score["decode_tok_s"] > 0


def test_optimize_reports_and_returns_the_simulated_choice(single24: tuple[ClusterSpec, ProfileSet]) -> None:
    cluster, profiles = single24
    assert simulable(cluster, profiles)
    said: list[str] = []
    quick = Refinement(warmup_s=WARMUP_S, measure_s=MEASURE_S, top=2, patience=1)
    res = optimize(cluster, profiles, PlannerOptions(objective="serving", time_limit_s=30, threads=1, simulate=quick),
                   simulator=run_short, on_progress=lambda p: said.append(p.message))
    assert res.stats["stall_window_s"] == STALL_MIN_S  # the model's search leaves the time to the simulator
    assert res.stats["simulations"] >= 1 and res.stats["simulated_stop"] in ("patience", "exhausted", "time_limit")
    assert any(m.startswith("simulated re-ranking (1 of") and "(plan / judge flows)" in m for m in said)
    assert res.score["simulated_judge_decode_tok_s"] > 0 and res.score["simulated_decode_tok_s"] > 0
    assert min(res.score["simulated_decode_tok_s"], res.score["simulated_judge_decode_tok_s"]) >= \
        res.stats["model_choice_simulated_tok_s"] - 0.05


def test_helix_plan_no_simulate_keeps_the_models_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(SINGLE24), "--time-limit", "16", "--threads", "1", "--no-simulate", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["score"]["decode_tok_s"] > 0 and "simulated_decode_tok_s" not in plan["score"]
    assert "simulations" not in plan["stats"] and plan["stats"]["stall_window_s"] == pytest.approx(4.0, rel=0.05)  # a quarter


def test_helix_plan_hands_the_simulator_to_the_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner never imports the simulator: ``helix plan`` gets it from the command line's wiring."""
    import planner.commands

    seen: dict[str, object] = {}

    def fake_make_plan(*args: object, **kw: object) -> Plan:  # the arguments only: no search runs
        seen.update(kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(planner.commands, "make_plan", fake_make_plan)
    assert main(["plan", str(SINGLE24), "--time-limit", "1", "--json"]) == 130
    assert seen["simulator"] is run_short and seen["simulate"] is True
