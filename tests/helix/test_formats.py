"""The file formats of helix/: cluster, profiles, plan — parsing, defaults, invariants."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helix.errors import ConfigError, InfeasiblePlanError
from helix.plan import Plan, check_plan, load_plan
from helix.profile import ThroughputProfile, derive_tok_s, load_profiles_for
from helix.spec import load_cluster

ROOT = Path(__file__).resolve().parents[2]
SINGLE24 = ROOT / "clusters" / "helix-paper-single24" / "cluster.yaml"

PROFILES = {
    "models": {
        "m": {"num_layers": 4, "hidden_size": 8, "layer_weight_bytes": 1e6, "kv_bytes_per_token_per_layer": 16}
    },
    "gpus": {"G": {"vram_gb": 1, "throughput": {"m": {"max_layers": 4, "tok_s": [400, 200, 130, 100]}}}},
}


def write_cluster(tmp_path: Path, cluster: dict) -> Path:
    (tmp_path / "profiles.yaml").write_text(yaml.safe_dump(PROFILES))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    return path


def base_cluster() -> dict:
    return {
        "name": "t",
        "model": "m",
        "profiles": "profiles.yaml",
        "nodes": [{"id": "a", "gpu": "G", "region": "r1"}, {"id": "b", "gpu": "G", "region": "r2"}],
        "defaults": {
            "intra_region": {"bandwidth_gbps": 10, "latency_ms": 1},
            "inter_region": {"bandwidth_gbps": 0.5, "latency_ms": 40},
        },
        "links": [{"src": "a", "dst": "b", "bandwidth_gbps": 2, "latency_ms": 5}],
    }


def test_defaults_expand_and_explicit_links_win(tmp_path: Path) -> None:
    spec = load_cluster(write_cluster(tmp_path, base_cluster()))
    links = spec.resolved_links()
    assert links[("a", "b")].bandwidth_gbps == 2  # explicit, one direction only
    assert links[("b", "a")].bandwidth_gbps == 0.5  # inter-region default
    assert links[("coordinator", "a")].latency_ms == 1  # coordinator without region: intra default
    assert len(links) == 6


def test_bidirectional_link_adds_reverse(tmp_path: Path) -> None:
    c = base_cluster()
    c["links"][0]["bidirectional"] = True
    del c["defaults"]
    c["links"] += [
        {"src": "coordinator", "dst": "a", "bandwidth_gbps": 1},
        {"src": "b", "dst": "coordinator", "bandwidth_gbps": 1},
    ]
    links = load_cluster(write_cluster(tmp_path, c)).resolved_links()
    assert set(links) == {("a", "b"), ("b", "a"), ("coordinator", "a"), ("b", "coordinator")}


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda c: c["nodes"].append({"id": "a", "gpu": "G"}), "duplicate id"),
        (lambda c: c["links"][0].update(bandwidth_gbps=0), "links[0].bandwidth_gbps"),
        (lambda c: c["links"][0].update(bandwidth_gbps=-1), "links[0].bandwidth_gbps"),
        (lambda c: c["nodes"][0].update(colour="red"), "nodes[0].colour: unknown field"),
        (lambda c: c["links"][0].update(dst="zz"), "links[0].dst"),
        (lambda c: c.pop("model"), "model: Field required"),
    ],
)
def test_bad_cluster_names_file_and_field(tmp_path: Path, mutate, field: str) -> None:
    c = base_cluster()
    mutate(c)
    with pytest.raises(ConfigError) as err:
        load_cluster(write_cluster(tmp_path, c))
    assert "cluster.yaml" in str(err.value) and field in str(err.value)


def test_unreachable_node_and_isolated_coordinator(tmp_path: Path) -> None:
    c = base_cluster()
    del c["defaults"]
    c["links"] = [{"src": "coordinator", "dst": "a", "bandwidth_gbps": 1}, {"src": "a", "dst": "coordinator", "bandwidth_gbps": 1}]
    with pytest.raises(ConfigError, match=r"nodes\[1\].*'b' is not reachable"):
        load_cluster(write_cluster(tmp_path, c))
    c["links"] = [{"src": "a", "dst": "b", "bandwidth_gbps": 1, "bidirectional": True}]
    with pytest.raises(ConfigError, match="coordinator has no outgoing link"):
        load_cluster(write_cluster(tmp_path, c))


def test_profiles_checked_against_cluster(tmp_path: Path) -> None:
    c = base_cluster()
    c["nodes"][1]["gpu"] = "H200"
    spec = load_cluster(write_cluster(tmp_path, c))
    with pytest.raises(ConfigError, match=r"nodes\[1\].gpu.*unknown GPU type 'H200'"):
        load_profiles_for(spec)
    c = base_cluster()
    c["nodes"] = [{"id": "a", "gpu": "G"}]
    c["links"] = []
    PROFILES["gpus"]["G"]["throughput"]["m"] = {"max_layers": 2, "tok_s": [400, 200]}
    try:
        spec = load_cluster(write_cluster(tmp_path, c))
        with pytest.raises(InfeasiblePlanError, match="4 layers but all nodes together hold at most 2"):
            load_profiles_for(spec)
    finally:
        PROFILES["gpus"]["G"]["throughput"]["m"] = {"max_layers": 4, "tok_s": [400, 200, 130, 100]}


def test_derived_tok_s_falls_with_layers_and_respects_kv() -> None:
    tp = ThroughputProfile(
        max_layers=3,
        prefill_ms_per_layer=[(0, 0), (100, 1.0), (1000, 8.0)],
        decode_ms_per_layer=[(1, 0.5), (8, 0.6), (64, 1.0)],
        kv_capacity_tokens_by_layers=[64000, 64000, 30000],
    )
    table = derive_tok_s(tp, prompt_tokens=100, output_tokens=100)
    assert table[0] > table[1] > table[2] > 0
    # one layer: prefill 125k tok/s, decode 64k tok/s (KV fits 426 requests) -> harmonic mean
    assert table[0] == pytest.approx(1 / (0.5 / 125000 + 0.5 / 64000))
    # three layers: 10000 tokens per layer fit 66 requests of 150 context: batch 64 still fits
    assert table[2] == pytest.approx(1 / (0.5 / (1000 / 0.024) + 0.5 / (64 / 0.003)))


def test_single24_loads_with_paper_numbers() -> None:
    spec = load_cluster(SINGLE24)
    profiles = load_profiles_for(spec)
    assert len(spec.nodes) == 24
    assert profiles.throughput("A100", spec.model).tok_s is not None
    assert spec.resolved_links()[("a100-6", "t4-1")].bandwidth_gbps == 8


def test_check_plan_invariants() -> None:
    plan = load_plan(ROOT / "clusters" / "helix-paper-single24" / "reference" / "milp.json")
    spec = load_cluster(SINGLE24)
    check_plan(plan, num_layers=80, node_ids=spec.node_ids)
    gap = Plan(cluster="x", model="m", method="t", placement={"a": (0, 2), "b": (3, 4)}, max_flow_tok_s=0)
    with pytest.raises(ConfigError, match="layers 2 are held by no node"):
        check_plan(gap, num_layers=4, node_ids=["a", "b"])
    with pytest.raises(ConfigError, match=r"placement.a: holds 2 layers but this node fits at most 1"):
        check_plan(gap, num_layers=4, node_ids=["a", "b"], max_layers={"a": 1, "b": 1})
    with pytest.raises(ConfigError, match="not in the cluster"):
        check_plan(gap, num_layers=4, node_ids=["a"])


def test_plan_file_errors_name_field(tmp_path: Path) -> None:
    p = tmp_path / "plan.json"
    p.write_text('{"cluster": "x", "model": "m", "method": "t", "placement": {"a": [3, 1]}, "max_flow_tok_s": 1}')
    with pytest.raises(ConfigError, match=r"plan.json: placement.*empty or negative"):
        load_plan(p)
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="plan.json: not valid JSON"):
        load_plan(p)


def test_node_layer_cap_limits_planning(tmp_path: Path) -> None:
    from planner.capacity import CapacityModel

    c = base_cluster()
    c["nodes"][1]["max_layers"] = 2
    spec = load_cluster(write_cluster(tmp_path, c))
    profiles = load_profiles_for(spec)
    cap = CapacityModel.build(spec, profiles)
    assert cap.max_layers == {"a": 4, "b": 2} and cap.node_tok_s["b"] == [400, 200]
    assert cap.kind_of == {"a": "G", "b": "G<=2"} and cap.kind("b").max_layers == 2
    c["nodes"] = [{"id": "a", "gpu": "G", "max_layers": 3}]
    c["links"] = []
    with pytest.raises(InfeasiblePlanError, match="at most 3"):
        load_profiles_for(load_cluster(write_cluster(tmp_path, c)))
    c["nodes"][0]["max_layers"] = 0
    with pytest.raises(ConfigError, match=r"nodes\[0\].max_layers"):
        load_cluster(write_cluster(tmp_path, c))


def test_per_step_costs_are_optional_and_charged_once_per_step() -> None:
    curves = dict(max_layers=4, prefill_ms_per_layer=[(0, 0), (100, 1.0), (1000, 8.0)],
                  decode_ms_per_layer=[(1, 0.5), (8, 0.6), (64, 1.0)])
    plain = derive_tok_s(ThroughputProfile(**curves), prompt_tokens=100, output_tokens=100)
    zero = ThroughputProfile(**curves, step_overhead_ms=[(1, 0.0), (1000, 0.0)], head_ms=[(1, 0.0), (64, 0.0)])
    assert derive_tok_s(zero, prompt_tokens=100, output_tokens=100) == pytest.approx(plain)
    tp = ThroughputProfile(**curves, step_overhead_ms=[(1, 2.0), (1000, 2.0)], head_ms=[(1, 4.0), (64, 4.0)])
    table = derive_tok_s(tp, prompt_tokens=100, output_tokens=100, num_layers=4)
    # k layers: the step cost once, k/4 of the head; prefill at 1000 tokens, decode at batch 64
    for k in (1, 4):
        fixed = 2.0 + 4.0 * k / 4
        prefill = max(100 / ((k * 1.0 + fixed) / 1000), 1000 / ((k * 8.0 + fixed) / 1000))
        decode = 64 / ((k * 1.0 + fixed) / 1000)
        assert table[k - 1] == pytest.approx(1 / (0.5 / prefill + 0.5 / decode))
