"""Pipeline depth and KV per layer, the numbers printed beside the max flow."""

from __future__ import annotations

import pytest

from helix.plan import FlowEdge
from planner.api import make_plan
from planner.metrics import kv_tokens_per_layer, pipeline_depths

from .conftest import DEMO, load


def test_depths_on_a_small_dag() -> None:
    flows = [
        FlowEdge(src="c", dst="a", tok_s=3.0),
        FlowEdge(src="a", dst="b", tok_s=1.0),
        FlowEdge(src="a", dst="c", tok_s=2.0),
        FlowEdge(src="b", dst="c", tok_s=1.0),
    ]
    d = pipeline_depths(flows, "c")
    assert d == {"min": 1.0, "mean": pytest.approx(4.0 / 3.0), "max": 2.0}
    assert pipeline_depths([], "c") == {"min": 0.0, "mean": 0.0, "max": 0.0}


def test_swarm_is_twenty_stages_deep(single24) -> None:
    cluster, profiles = single24
    plan = make_plan(cluster, profiles, method="swarm")
    assert (plan.stats["depth_min"], plan.stats["depth_max"]) == (20.0, 20.0)
    assert plan.stats["depth_mean"] == pytest.approx(20.0)


def test_kv_per_layer_sums_holders() -> None:
    cluster, profiles = load(DEMO)
    tp = profiles.throughput("cpu", "smollm2-135m")
    kv = kv_tokens_per_layer(cluster, profiles, {"cpu-0": (0, 30), "cpu-1": (0, 10)})
    assert kv is not None
    assert kv[0] == pytest.approx(tp.kv_capacity_tokens_by_layers[29] / 30 + tp.kv_capacity_tokens_by_layers[9] / 10)
    assert kv[29] == pytest.approx(tp.kv_capacity_tokens_by_layers[29] / 30)
