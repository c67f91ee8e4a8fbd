"""The paper's baselines: valid placements everywhere, or a clear InfeasiblePlanError."""

from __future__ import annotations

import pytest

from helix.errors import InfeasiblePlanError
from helix.plan import check_plan
from planner import baselines
from planner.api import make_plan
from planner.capacity import CapacityModel

from .conftest import DEMO, GEO, SINGLE24, load


def _valid(cluster, cap, placement) -> None:
    assert set(placement) <= set(cluster.node_ids)
    for node, (s, e) in placement.items():
        assert 0 <= s < e <= cap.num_layers and e - s <= cap.max_layers[node]
    covered = {layer for s, e in placement.values() for layer in range(s, e)}
    assert covered == set(range(cap.num_layers))


@pytest.mark.parametrize("path", [SINGLE24, DEMO, GEO], ids=["single24", "demo", "geo"])
@pytest.mark.parametrize("name", baselines.BASELINES)
def test_baseline_valid(path, name: str) -> None:
    cluster, profiles = load(path)
    cap = CapacityModel.build(cluster, profiles)
    if name == "separate" and path == SINGLE24:
        with pytest.raises(InfeasiblePlanError, match="no GPU type has enough nodes"):
            baselines.run_baseline(name, cap)
        return
    placement = baselines.run_baseline(name, cap)
    _valid(cluster, cap, placement)
    plan = make_plan(cluster, profiles, method=name)  # also runs check_plan + check_flows
    assert plan.max_flow_tok_s > 0 and plan.method == name and plan.status == "heuristic"
    check_plan(plan, num_layers=cap.num_layers, node_ids=cluster.node_ids, max_layers=cap.max_layers)


def test_paper_figures_for_petals_and_swarm(single24) -> None:
    cluster, profiles = single24
    assert make_plan(cluster, profiles, method="petals").max_flow_tok_s == pytest.approx(952.107, rel=1e-3)
    swarm = make_plan(cluster, profiles, method="swarm")
    assert swarm.max_flow_tok_s == pytest.approx(757.853, rel=1e-3)
    assert {e - s for s, e in swarm.placement.values()} == {4}  # 20 stages x 4 layers
    assert len({s for s, _ in swarm.placement.values()}) == 20


def test_separate_builds_homogeneous_pipelines() -> None:
    cluster, profiles = load(GEO)
    cap = CapacityModel.build(cluster, profiles)
    gpu = {n.id: n.gpu for n in cluster.nodes}
    placement = baselines.separate(cap)
    # only the 12 L4s (7 layers each) can form an 80-layer pipeline on their own
    assert {gpu[n] for n in placement} == {"L4"} and len(placement) == 12
    assert sum(e - s for s, e in placement.values()) == 80


def test_separate_infeasible_message(single24) -> None:
    cluster, profiles = single24
    with pytest.raises(InfeasiblePlanError) as err:
        make_plan(cluster, profiles, method="separate")
    assert "A100: 4 node(s) x 12 layers = 48 < 80" in str(err.value)
