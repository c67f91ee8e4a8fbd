"""Incremental re-planning (``planner.replan``, ``helix plan --from``): few moves, valid plans, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helix.cli import main
from helix.domain import LayerRange
from helix.errors import InfeasiblePlanError
from helix.plan import Plan, check_plan, load_plan
from helix.spec import NodeSpec
from planner.api import make_plan
from planner.candidates import CandidatePool
from planner.capacity import CapacityModel
from planner.local_search import Scored
from planner.moves import layers_moved, node_moves, relabel, renamed
from planner.optimize import near_best_max_flow
from planner.repair import warm_start
from planner.replan import ReplanOptions, decide, reachable_max_flow, replan, with_nodes, without_nodes

from .conftest import DEMO, load, mixed_cluster

MIX = ["A100"] * 3 + ["L4"] * 4 + ["T4"] * 6  # 88 layer slots for LLaMA-2 70B's 80: one T4 to spare


@pytest.fixture(scope="module")
def mixed13(tmp_path_factory: pytest.TempPathFactory):
    path = mixed_cluster(tmp_path_factory.mktemp("replan"), "mixed13",
                         [{"id": f"{g.lower()}-{i}", "gpu": g, "region": "r"} for i, g in enumerate(MIX)])
    cluster, profiles = load(path)
    return cluster, profiles, make_plan(cluster, profiles, objective="max-flow", time_limit_s=5, threads=1)


def _valid(plan: Plan, cluster, profiles) -> None:
    cap = CapacityModel.build(cluster, profiles)
    check_plan(plan, num_layers=cap.num_layers, node_ids=cluster.node_ids, max_layers=cap.max_layers,
               coordinator=cluster.coordinator.id)
    assert plan.max_flow_tok_s > 0


def test_moves_accounting() -> None:
    before = {"a": (0, 4), "b": (4, 8), "gone": (8, 10)}
    after = {"a": LayerRange(0, 5), "b": LayerRange(6, 10), "new": LayerRange(0, 2)}
    moves = {m.node: m for m in node_moves(before, after)}
    assert moves["a"].load == [(4, 5)] and moves["a"].drop == [] and moves["a"].kept == (0, 4)
    assert moves["b"].load == [(8, 10)] and moves["b"].drop == [(4, 6)] and moves["b"].change == "moved"
    assert moves["new"].change == "joins" and moves["new"].loaded == 2
    assert moves["gone"].change == "leaves" and moves["gone"].loaded == 0 and moves["gone"].drop == [(8, 10)]
    assert layers_moved(before, after) == 1 + 2 + 2
    # two interchangeable nodes whose ranges a plan from scratch swapped: relabelling swaps them back
    swapped = {"a": LayerRange(4, 8), "b": LayerRange(0, 4)}
    takes = relabel(swapped, before, {"a": "k", "b": "k"})
    assert renamed(swapped, takes) == {"a": (0, 4), "b": (4, 8)} and layers_moved(before, renamed(swapped, takes)) == 0


def test_warm_start_covers_what_a_leaver_held(mixed13) -> None:
    cluster, profiles, full = mixed13
    gone = max((n for n in full.placement if not n.startswith("a100")), key=lambda n: (full.layers_held(n), n))
    cap = CapacityModel.build(without_nodes(cluster, [gone]), profiles)
    start, uncovered = warm_start(cap, full.placement)
    assert not uncovered and set(start) == set(cap.nodes)
    assert {layer for s, e in start.values() for layer in range(s, e)} == set(range(cap.num_layers))


def test_removing_a_node_moves_few_layers(mixed13) -> None:
    cluster, profiles, full = mixed13
    gone = "l4-3"
    smaller = without_nodes(cluster, [gone])
    r = replan(smaller, profiles, full, ReplanOptions(time_limit_s=4))
    _valid(r.plan, smaller, profiles)
    assert r.removed == [gone] and r.added == [] and r.decision == "incremental"
    assert r.scratch is not None and r.scratch_layers_moved is not None
    assert r.layers_moved <= r.scratch_layers_moved
    assert r.plan.max_flow_tok_s >= 0.95 * r.scratch.max_flow_tok_s
    assert r.layers_moved == layers_moved(full.placement, r.plan.placement)
    assert {m.node for m in r.moves if m.change == "leaves"} == {gone}
    assert r.plan.stats["replan"]["layers_moved"] == r.layers_moved and r.wall_s <= 4 + 1
    reach = r.plan.stats["replan"]["reachable_max_flow_tok_s"]  # max-flow: the plan from scratch's own
    assert reach == pytest.approx(r.scratch.max_flow_tok_s, rel=1e-3) and reach == pytest.approx(
        r.reachable_max_flow_tok_s, abs=1e-3)


def test_adding_a_node_gives_it_layers_and_moves_little_else(mixed13) -> None:
    cluster, profiles, full = mixed13
    bigger = with_nodes(cluster, [NodeSpec(id="t4-new", gpu="T4", region="r")])
    r = replan(bigger, profiles, full, ReplanOptions(time_limit_s=3))
    _valid(r.plan, bigger, profiles)
    assert r.added == ["t4-new"] and r.removed == [] and r.decision == "incremental"
    joins = {m.node: m for m in r.moves}["t4-new"]
    assert joins.change == "joins" and joins.loaded > 0
    assert r.plan.max_flow_tok_s >= full.max_flow_tok_s * (1 - 1e-9)
    assert r.layers_moved <= 4  # a small change, a small move: at most what one T4 holds


def test_a_removal_that_leaves_the_model_unservable_says_why() -> None:
    cluster, profiles = load(DEMO)
    full = make_plan(cluster, profiles, method="petals")
    with pytest.raises(InfeasiblePlanError, match=r"after cpu-0, cpu-1 left.*hold at most 16 of the 30 layers"):
        replan(without_nodes(cluster, ["cpu-0", "cpu-1"]), profiles, full)


def test_fallback_to_the_plan_from_scratch_when_forced(mixed13) -> None:
    cluster, profiles, full = mixed13
    smaller = without_nodes(cluster, ["t4-7"])
    r = replan(smaller, profiles, full, ReplanOptions(time_limit_s=3, fallback_below=2.0))  # above 1: always
    assert r.decision == "from-scratch" and r.plan is r.scratch and "< 200%" in r.reason
    _valid(r.plan, smaller, profiles)
    assert r.layers_moved == r.scratch_layers_moved


def test_under_serving_a_plan_that_keeps_the_estimate_but_loses_max_flow_falls_back() -> None:
    values = {"incremental": 99.0, "from-scratch": 100.0}  # the serving estimates: within the floor
    keeps, _ = decide(values, {"incremental": 96.0, "from-scratch": 100.0}, 0.95)
    loses, why = decide(values, {"incremental": 82.1, "from-scratch": 100.0}, 0.95)
    assert keeps == "incremental" and loses == "from-scratch" and "max flow 82.1% of the reachable (< 95%)" in why
    assert decide(values, {}, 0.95)[0] == "incremental"  # under max-flow the objective is the max flow
    assert decide({"incremental": 90.0, "from-scratch": 100.0}, {}, 0.95)[0] == "from-scratch"


def test_under_serving_the_max_flow_floor_is_the_reachable_max_flow_not_the_plan_from_scratch() -> None:
    values = {"incremental": 99.0, "from-scratch": 100.0}
    # the plan from scratch has a weak max flow; the search reached more: the floor is 95 % of that
    weak, why = decide(values, {"incremental": 100.0, "from-scratch": 140.0, "reachable": 150.0}, 0.95)
    assert weak == "from-scratch" and "max flow 66.7% of the reachable" in why
    # below the floor, but the plan from scratch has no more max flow: falling back would only move layers
    assert decide(values, {"incremental": 100.0, "from-scratch": 95.0, "reachable": 150.0}, 0.95)[0] == "incremental"
    assert decide(values, {"incremental": 143.0, "from-scratch": 100.0, "reachable": 150.0}, 0.95)[0] == "incremental"


def test_under_serving_the_reachable_max_flow_is_the_most_among_placements_of_about_the_best_estimate(
        mixed13) -> None:
    cluster, profiles, _ = mixed13
    plan = make_plan(cluster, profiles, objective="serving", time_limit_s=3, simulate=False)
    reach = reachable_max_flow(plan)
    assert plan.stats["near_best_max_flow_tok_s"] >= plan.max_flow_tok_s * (1 - 1e-6)  # the chosen one counts
    assert reach == pytest.approx(plan.stats["near_best_max_flow_tok_s"]) and reach <= (plan.upper_bound_tok_s or 0.0) * 1.001
    assert reachable_max_flow(None) == 0.0


def test_near_best_max_flow_takes_the_most_among_placements_within_two_percent_of_the_best_estimate() -> None:
    pool = CandidatePool(ev=None, report=lambda *_: None, nodes=set())  # type: ignore[arg-type]
    for i, (estimate, flow) in enumerate([(100.0, 952.0), (98.7, 1476.0), (95.4, 2000.0)]):
        pool.scored[frozenset({(f"n{i}", LayerRange(0, 1))})] = Scored({f"n{i}": LayerRange(0, 1)}, (estimate,), flow)
    pool.best = max(pool.scored.values(), key=lambda s: s.key)
    assert near_best_max_flow(pool) == 1476.0  # 2000 tok/s is 4.6 % below the best estimate: not near it


def _demo_file(tmp_path: Path, drop: set[str]) -> Path:
    doc = yaml.safe_load(DEMO.read_text())
    doc["profiles"] = str(DEMO.parent / doc["profiles"])
    doc["nodes"] = [n for n in doc["nodes"] if n["id"] not in drop]
    path = tmp_path / "membership.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_cli_plan_from_lists_the_moves_and_writes_them(capsys, tmp_path) -> None:
    before, after = tmp_path / "plan.json", tmp_path / "after.json"
    assert main(["plan", str(DEMO), "--objective", "max-flow", "--time-limit", "3", "--json", "-o", str(before)]) == 0
    capsys.readouterr()
    gone = max(load_plan(before).placement, key=lambda n: n)  # any one node: the other two still hold the model
    args = ["plan", str(_demo_file(tmp_path, {gone})), "--from", str(before), "--objective", "max-flow",
            "--time-limit", "3", "-o", str(after)]
    assert main(args) == 0
    out = capsys.readouterr().out
    for text in ("membership: left: " + gone, "leaves", "layers to load", "incremental plan", "max flow"):
        assert text in out, text
    written = json.loads(after.read_text())
    assert gone not in written["placement"]
    record = written["stats"]["replan"]
    assert record["removed"] == [gone] and record["decision"] == "incremental"
    assert any(m["node"] == gone and m["after"] is None for m in record["moves"])


def test_cli_plan_from_an_unservable_membership_exits_3(capsys, tmp_path) -> None:
    before = tmp_path / "plan.json"
    assert main(["plan", str(DEMO), "--objective", "max-flow", "--time-limit", "3", "--json", "-o", str(before)]) == 0
    capsys.readouterr()
    code = main(["plan", str(_demo_file(tmp_path, {"cpu-0", "cpu-2"})), "--from", str(before)])
    err = capsys.readouterr().err
    assert code == 3 and "30 layers" in err and "add nodes" in err and "Traceback" not in err
