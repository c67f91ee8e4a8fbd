"""Capacities links share (a region's uplink / downlink, a node's NIC) in the max-flow graph, the paper's
MILP, the planner and the flows it reports; without them everything is as before."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from helix.errors import ConfigError
from helix.plan import FlowEdge
from planner import milp
from planner.api import make_plan
from planner.capacity import CapacityModel
from planner.flows import balanced_flows
from planner.graph import check_flows, evaluate, max_flow_value

from .conftest import SINGLE24, load, small_instance

ACT_BYTES = 64 * 2  # the tiny model's hidden_size x dtype_bytes


def gbps(act_tok_s: float) -> float:
    """Gbit/s that carry ``act_tok_s`` activations a second of the tiny model."""
    return act_tok_s * ACT_BYTES * 8 / 1e9


def tiny(tmp_path: Path, nodes: list[dict[str, Any]], **extra: Any) -> CapacityModel:
    """A 2-layer model; every node runs one layer at 1000 tok/s; 600 activation tok/s between regions."""
    profiles = {
        "models": {"tiny": {"num_layers": 2, "hidden_size": 64, "dtype_bytes": 2, "layer_weight_bytes": 1e6,
                            "kv_bytes_per_token_per_layer": 256}},
        "gpus": {"G": {"vram_gb": 8, "throughput": {"tiny": {"max_layers": 1, "tok_s": [1000.0]}}}},
    }  # fmt: skip
    doc = {"name": "tiny", "model": "tiny", "profiles": "profiles.yaml", "coordinator": {"region": "A"},
           "nodes": nodes, "defaults": {"intra_region": {"bandwidth_gbps": 10},
                                        "inter_region": {"bandwidth_gbps": gbps(600)}}} | extra  # fmt: skip
    (tmp_path / "profiles.yaml").write_text(yaml.safe_dump(profiles))
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(doc))
    cluster, profile_set = load(tmp_path / "cluster.yaml")
    return CapacityModel.build(cluster, profile_set)


TWO_BY_TWO = [{"id": "a0", "gpu": "G", "region": "A"}, {"id": "a1", "gpu": "G", "region": "A"},
              {"id": "b0", "gpu": "G", "region": "B"}, {"id": "b1", "gpu": "G", "region": "B"}]  # fmt: skip
ACROSS = {"a0": (0, 1), "a1": (0, 1), "b0": (1, 2), "b1": (1, 2)}  # layer 0 in A, layer 1 in B


@pytest.mark.parametrize(
    ("regions", "nic", "expected"),
    [
        ({}, None, 2000.0),  # four 600 tok/s pairs carry both A nodes' 2000
        ({"A": {"uplink_gbps": gbps(800)}}, None, 800.0),  # A's uplink shared by the four pairs
        ({"B": {"downlink_gbps": gbps(500), "uplink_gbps": 10}}, None, 500.0),  # B's downlink
        ({}, gbps(300), 1300.0),  # a0's NIC: 300 out of a0, a1 still 1000 over its two pairs
    ],
)
def test_shared_capacity_caps_the_max_flow(tmp_path: Path, regions: dict, nic: float | None, expected: float) -> None:
    nodes = [dict(n) for n in TWO_BY_TWO]
    if nic is not None:
        nodes[0]["nic_gbps"] = nic
    cap = tiny(tmp_path, nodes, regions=regions)
    res = evaluate(cap, ACROSS)
    assert res.max_flow_tok_s == pytest.approx(expected, rel=1e-6)
    assert max_flow_value(cap, ACROSS) == pytest.approx(expected, rel=1e-6)
    assert {e.src for e in res.flows} | {e.dst for e in res.flows} <= {"coordinator", *ACROSS}  # no extra vertex
    check_flows(cap, ACROSS, res.flows)
    value, flows = balanced_flows(cap, ACROSS)
    assert value == pytest.approx(expected, rel=1e-5)
    check_flows(cap, ACROSS, flows)
    if regions or nic:
        assert any("full" in b for b in res.bottleneck), res.bottleneck


def test_flows_over_a_shared_uplink_fail_the_plan_check(tmp_path: Path) -> None:
    cap = tiny(tmp_path, TWO_BY_TWO, regions={"A": {"uplink_gbps": gbps(800)}})
    flows = [FlowEdge(src="coordinator", dst=n, tok_s=500.0) for n in ("a0", "a1")]
    flows += [FlowEdge(src=a, dst=b, tok_s=250.0) for a in ("a0", "a1") for b in ("b0", "b1")]
    flows += [FlowEdge(src=n, dst="coordinator", tok_s=500.0) for n in ("b0", "b1")]
    with pytest.raises(ConfigError, match="region A uplink"):
        check_flows(cap, ACROSS, flows)


def test_paper_milp_picks_the_direction_the_uplinks_allow(tmp_path: Path) -> None:
    """One node a region, each one layer: A first then B crosses A's uplink (300), the other way B's (200)."""
    nodes = [{"id": "a0", "gpu": "G", "region": "A"}, {"id": "b0", "gpu": "G", "region": "B"}]
    free = tiny(tmp_path, nodes)
    assert milp.solve_paper_milp(free, time_limit_s=30).objective_tok_s == pytest.approx(600.0, rel=1e-6)
    cap = tiny(tmp_path, nodes, regions={"A": {"uplink_gbps": gbps(300), "downlink_gbps": 10},
                                         "B": {"uplink_gbps": gbps(200), "downlink_gbps": 10}})
    res = milp.solve_paper_milp(cap, time_limit_s=30)
    assert res.status == "optimal"
    assert res.placement == {"a0": (0, 1), "b0": (1, 2)}
    assert res.objective_tok_s == pytest.approx(300.0, rel=1e-6)
    assert max_flow_value(cap, res.placement) == pytest.approx(300.0, rel=1e-6)


def test_paper_milp_meets_brute_force_with_shared_uplinks(tmp_path: Path) -> None:
    path = small_instance(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["coordinator"] = {"region": "r1"}
    path.write_text(yaml.safe_dump(doc))
    free = CapacityModel.build(*load(path))
    doc["regions"] = {"r1": {"uplink_gbps": gbps(300)}, "r2": {"uplink_gbps": gbps(250), "downlink_gbps": 10}}
    path.write_text(yaml.safe_dump(doc))
    cap = CapacityModel.build(*load(path))
    options = {n: [(s, s + k) for k in range(1, cap.max_layers[n] + 1) for s in range(cap.num_layers - k + 1)]
               for n in cap.nodes}  # fmt: skip

    def brute_force(problem: CapacityModel) -> float:
        return max(max_flow_value(problem, dict(zip(options, combo, strict=True)))
                   for combo in itertools.product(*options.values()))  # fmt: skip

    best = brute_force(cap)
    assert best < brute_force(free) - 1.0  # the uplinks bind
    res = milp.solve_paper_milp(cap, time_limit_s=60)
    assert res.status == "optimal"
    assert res.objective_tok_s == pytest.approx(best, rel=1e-5)
    assert max_flow_value(cap, res.placement) == pytest.approx(best, rel=1e-5)


def issue_cluster(tmp_path: Path, regions: dict[str, Any] | None) -> Path:
    """Issue 17's shape on the paper's LLaMA-2 70B profiles: A100s in region A (with the coordinator), T4s in B,
    0.1 Gbit/s between the regions (one pipeline at the cluster's ~1,200 tok/s needs 0.16 Gbit/s across)."""
    nodes = [{"id": f"a100-{i}", "gpu": "A100", "region": "A"} for i in range(4)]
    nodes += [{"id": f"t4-{i}", "gpu": "T4", "region": "B"} for i in range(12)]
    doc: dict[str, Any] = {
        "name": "issue17-uplink", "model": "llama-2-70b", "profiles": str(SINGLE24.parent / "profiles-llama70b.yaml"),
        "coordinator": {"id": "coordinator", "region": "A", "nic_gbps": 10}, "nodes": nodes,
        "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 1},
                     "inter_region": {"bandwidth_gbps": 0.1, "latency_ms": 50}},
    }  # fmt: skip
    if regions is not None:
        doc["regions"] = regions
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def gbit_across(cluster_path: Path, flows: list[FlowEdge]) -> float:
    """Activations (Gbit/s) the flows carry between the two regions."""
    cluster, profiles = load(cluster_path)
    act = profiles.models[cluster.model].activation_bytes_per_token
    coord = cluster.coordinator.id
    return sum(e.tok_s * act * 8 / 1e9 for e in flows
               if coord not in (e.src, e.dst) and cluster.crosses_regions(e.src, e.dst))  # fmt: skip


def test_the_planner_keeps_activations_within_the_shared_uplink(tmp_path: Path) -> None:
    (tmp_path / "free").mkdir()
    free_path = issue_cluster(tmp_path / "free", None)
    shared_path = issue_cluster(tmp_path, {"A": {"uplink_gbps": 0.1}, "B": {"uplink_gbps": 0.1}})
    free = make_plan(*load(free_path), objective="max-flow", time_limit_s=4, threads=1)
    assert gbit_across(free_path, free.flows) > 0.11  # per-pair links: more than 0.1 Gbit/s across
    for objective in ("max-flow", "serving"):
        shared = make_plan(*load(shared_path), objective=objective, time_limit_s=4, threads=1)
        assert gbit_across(shared_path, shared.flows) <= 0.1 * (1 + 1e-6), objective
        assert 700 < shared.max_flow_tok_s <= 0.1e9 / 8 / (8192 * 2) * (1 + 1e-6), objective  # all through one crossing


def test_a_binding_downlink_on_lp_written_capacities_evaluates(tmp_path: Path) -> None:
    """Found by the link bound's random sweep: region rc's downlink binds, the LP lowers the grouped
    links to its flows, and networkx's preflow-push overran its height levels on that graph
    (IndexError). The flow is the downlink's: n0 -> n2 alone may carry it (n1 -> n2 shares it)."""
    profiles = {
        "models": {"tiny": {"num_layers": 4, "hidden_size": 64, "dtype_bytes": 2, "layer_weight_bytes": 1e6,
                            "kv_bytes_per_token_per_layer": 256}},
        "gpus": {"g1": {"vram_gb": 8, "throughput": {"tiny": {"max_layers": 3, "tok_s": [585.0, 328.4, 184.2]}}},
                 "g2": {"vram_gb": 8, "throughput": {"tiny": {"max_layers": 2, "tok_s": [1714.6, 855.3]}}}},
    }  # fmt: skip
    nodes = [{"id": "n0", "gpu": "g1", "region": "ra"},
             {"id": "n1", "gpu": "g2", "region": "rb", "nic_gbps": 0.0007358477355730332},
             {"id": "n2", "gpu": "g2", "region": "rc"},
             {"id": "n3", "gpu": "g1", "region": "ra", "nic_gbps": 0.0008398133064455337}]  # fmt: skip
    doc = {"name": "tiny106", "model": "tiny", "profiles": "profiles.yaml", "coordinator": {"region": "ra"},
           "nodes": nodes, "regions": {"rb": {"uplink_gbps": 0.0005253140959647158},
                                       "rc": {"uplink_gbps": 0.0003646543634306987}},
           "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 1},
                        "inter_region": {"bandwidth_gbps": 0.0004557839501296754, "latency_ms": 50}}}  # fmt: skip
    (tmp_path / "profiles.yaml").write_text(yaml.safe_dump(profiles))
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(doc))
    cap = CapacityModel.build(*load(tmp_path / "cluster.yaml"))
    placement = {"n0": (1, 2), "n1": (0, 2), "n2": (2, 4), "n3": (0, 1)}
    downlink = 0.0003646543634306987 * 1e9 / 8 / ACT_BYTES  # rc's downlink in activation tok/s: 356.1
    assert max_flow_value(cap, placement) == pytest.approx(downlink, rel=1e-6)
    res = evaluate(cap, placement)
    assert res.max_flow_tok_s == pytest.approx(downlink, rel=1e-6)
    assert any("region rc downlink full" in b for b in res.bottleneck), res.bottleneck
    check_flows(cap, placement, res.flows)
