"""The capacity model is the paper's: its four published max-flow figures on single24."""

from __future__ import annotations

import json

import pytest

from helix.cli import main
from helix.errors import ConfigError
from planner.api import evaluate_plan, load_checked_plan

from .conftest import REFERENCE, SINGLE24

CASES = [("milp", True, 1289.556), ("swarm", True, 757.853), ("petals", True, 952.107), ("petals", False, 531.703)]


@pytest.mark.parametrize(("name", "partial", "expected"), CASES)
def test_evaluator_reproduces_the_paper(single24, name: str, partial: bool, expected: float) -> None:
    cluster, profiles = single24
    plan = load_checked_plan(REFERENCE / f"{name}.json", cluster, profiles)
    got = evaluate_plan(cluster, profiles, plan, partial_handoffs=partial)
    assert got.max_flow_tok_s == pytest.approx(expected, rel=1e-3)
    assert got.flows and got.bottleneck


def test_evaluating_a_range_that_does_not_fit_its_node_names_the_node(single24) -> None:
    cluster, profiles = single24
    plan = load_checked_plan(REFERENCE / "petals.json", cluster, profiles)
    plan.placement = {**plan.placement, "a100-6": (0, 40)}  # an A100 holds 12 of the 80 layers
    with pytest.raises(ConfigError, match=r"placement\.a100-6: range \[0, 40\) is not valid for this node"):
        evaluate_plan(cluster, profiles, plan)
    plan.placement = {"gone-1": (0, 10)}
    with pytest.raises(ConfigError, match=r"placement\.gone-1: node 'gone-1' is not in the cluster"):
        evaluate_plan(cluster, profiles, plan)


@pytest.mark.parametrize(("name", "partial", "expected"), CASES)
def test_helix_evaluate_cli(capsys, name: str, partial: bool, expected: float) -> None:
    argv = ["evaluate", str(SINGLE24), str(REFERENCE / f"{name}.json"), "--json"]
    if not partial:
        argv.append("--no-partial")
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["max_flow_tok_s"] == pytest.approx(expected, rel=1e-3)
    assert plan["partial_handoffs"] is partial


def test_helix_evaluate_table(capsys) -> None:
    assert main(["evaluate", str(SINGLE24), str(REFERENCE / "milp.json")]) == 0
    out = capsys.readouterr().out
    assert "1289.6" in out and "bottleneck" in out and "a100-17" in out
