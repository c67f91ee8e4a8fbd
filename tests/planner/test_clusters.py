"""The shipped example clusters load, plan, and the demo survives losing any one agent."""

from __future__ import annotations

import pytest

from planner.api import make_plan
from planner.capacity import CapacityModel
from planner.graph import max_flow_value

from .conftest import DEMO, GEO, load


def survives_any_single_loss(cap: CapacityModel, placement: dict[str, tuple[int, int]]) -> bool:
    for lost in placement:
        rest = {n: r for n, r in placement.items() if n != lost}
        covered = {layer for s, e in rest.values() for layer in range(s, e)}
        if covered != set(range(cap.num_layers)) or max_flow_value(cap, rest) <= 0:
            return False
    return True


def test_demo_cluster_shape() -> None:
    cluster, profiles = load(DEMO)
    assert len(cluster.nodes) == 3 and {n.gpu for n in cluster.nodes} == {"cpu"}
    assert [n.max_layers for n in cluster.nodes] == [None, 16, 16]  # the small two must form a pipeline
    assert all(n.address and n.address.startswith("tcp://127.0.0.1:") for n in cluster.nodes)
    model = profiles.models["smollm2-135m"]
    assert (model.num_layers, model.hidden_size) == (30, 576)


@pytest.mark.parametrize(
    ("method", "objective"),
    [("paper-milp", "max-flow"), ("petals", "max-flow"), ("helix", "max-flow"), ("helix", "serving")],
)
def test_demo_plan_survives_losing_any_agent(method: str, objective: str) -> None:
    cluster, profiles = load(DEMO)
    plan = make_plan(cluster, profiles, method=method, objective=objective, time_limit_s=5, threads=1)
    cap = CapacityModel.build(cluster, profiles)
    assert survives_any_single_loss(cap, dict(plan.placement)), plan.placement
    assert all(e - s <= 16 for n, (s, e) in plan.placement.items() if n != "cpu-0")
    assert len({(s, e) for s, e in plan.placement.values()}) == 3, "the model is split, not copied"


def test_geo_uses_defaults_and_slow_inter_region_links() -> None:
    cluster, profiles = load(GEO)
    assert len({n.region for n in cluster.nodes}) == 3 and cluster.defaults is not None
    links = cluster.resolved_links()
    assert links[("use-a100-0", "euw-t4-0")].bandwidth_gbps < 1 <= links[("use-a100-0", "use-l4-0")].bandwidth_gbps
    assert links[("use-l4-2", "usw-l4-0")].bandwidth_gbps == 1  # the explicit link wins
    plan = make_plan(cluster, profiles, method="petals")
    assert plan.max_flow_tok_s > 0
