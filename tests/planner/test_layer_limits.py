"""A user's own cluster from `helix profile --estimate`: the KV reserve decides the layer limits,
the infeasibility error says what limits every node, and no layer cap is ignored silently."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from helix.cli import main as helix_main
from helix.errors import ConfigError, InfeasiblePlanError
from helix.plan import check_plan
from helix.profile import load_profile_file, load_profiles_for
from helix.spec import load_cluster
from planner.api import make_plan

# 2 x A100-80GB + 6 x T4 serving LLaMA-2 70B (80 layers): issue 20's cluster
NODES = [{"id": f"a{i}", "gpu": "A100-80GB"} for i in range(2)] + [{"id": f"t{i}", "gpu": "T4"} for i in range(6)]


def write_cluster(root: Path, nodes: list[dict] | None = None, profiles: str = "profiles.yaml") -> Path:
    path = root / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "name": "mine", "model": "llama-2-70b", "profiles": profiles, "nodes": nodes or NODES,
        "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 1}},
    }))  # fmt: skip
    return path


def estimate(cluster: Path, *flags: str) -> Path:
    out = cluster.parent / "profiles.yaml"
    assert helix_main(["profile", "--estimate", "--cluster", str(cluster), "-o", str(out), *flags]) == 0
    return out


def test_the_default_reserve_refuses_the_cluster_and_says_what_limits_each_node(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path)
    estimate(cluster)
    with pytest.raises(InfeasiblePlanError) as info:
        load_profiles_for(load_cluster(cluster))
    msg = info.value.message
    assert "80 layers but all nodes together hold at most 74" in msg
    assert "2 x A100-80GB (a0, a1): 25 layers each: the profile's max_layers" in msg
    assert "6 x T4 (t0, t1, t2, t3, t4, t5): 4 layers each" in msg
    assert "weights alone of 41 layers" in msg and "weights alone of 7 layers" in msg
    assert "--kv-requests" in msg


@pytest.mark.parametrize("flags", [("--kv-requests", "128"), ("--kv-reserve-gb", "4")])
def test_a_smaller_kv_reserve_plans_the_cluster(tmp_path: Path, flags: tuple[str, str]) -> None:
    cluster_path = write_cluster(tmp_path)
    profiles = load_profile_file(estimate(cluster_path, *flags))
    usable = {"A100-80GB": 80e9 * 0.9 - 1.6e9, "T4": 16e9 * 0.9 - 1.6e9}  # roofline: 90 % of VRAM - runtime
    w, kv_b = 1711276032, 4096
    for gpu, mem in usable.items():
        if flags[0] == "--kv-requests":  # 128 requests x 995 tokens in every layer held
            expected = math.floor(mem / (w + 128 * 995 * kv_b))
        else:  # 4 GB kept for KV, the rest for weights
            expected = math.floor((mem - 4e9) / w)
        assert profiles.throughput(gpu, "llama-2-70b").max_layers == expected
    cluster = load_cluster(cluster_path)
    plan = make_plan(cluster, load_profiles_for(cluster), method="petals")
    check_plan(plan, num_layers=80, node_ids=[n["id"] for n in NODES])
    assert plan.max_flow_tok_s > 0


def test_a_node_cap_above_the_profile_is_an_error_naming_both(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path, [*NODES[:2], {"id": "t0", "gpu": "T4", "max_layers": 6}, *NODES[3:]])
    estimate(cluster, "--kv-requests", "128")  # T4: 5 layers
    with pytest.raises(ConfigError) as info:
        load_profiles_for(load_cluster(cluster))
    msg = info.value.message
    assert msg.startswith(f"{cluster}: nodes[2].max_layers: node 't0' asks for max_layers 6")
    assert "allows at most 5" in msg and "profiles.yaml" in msg


def test_raising_a_profile_limit_by_hand_extends_its_kv_list(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path)
    path = estimate(cluster)  # T4: 4 layers, A100-80GB: 25
    before = load_profile_file(path).throughput("T4", "llama-2-70b").kv_capacity_tokens_by_layers
    assert before is not None and len(before) == 4
    raw = yaml.safe_load(path.read_text())
    raw["gpus"]["T4"]["throughput"]["llama-2-70b"]["max_layers"] = 7  # the weights-only limit
    path.write_text(yaml.safe_dump(raw))
    profiles = load_profiles_for(load_cluster(cluster))  # 2 x 25 + 6 x 7 = 92 >= 80: plans
    kv = profiles.throughput("T4", "llama-2-70b").kv_capacity_tokens_by_layers
    step = 1711276032 / 4096  # one more layer's weights, in KV entries
    assert kv is not None and kv[:4] == before and len(kv) == 7
    assert all(kv[k] == pytest.approx(kv[k - 1] - step, abs=1) for k in range(4, 7))
    raw["gpus"]["T4"]["throughput"]["llama-2-70b"]["max_layers"] = 8  # the weights of 8 do not fit
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"profiles.yaml: .*gpus.T4.throughput.llama-2-70b: max_layers 8 leaves no "
                                          r"KV space.*at most 7 layers fit"):  # fmt: skip
        load_profiles_for(load_cluster(cluster))


def test_nodes_capped_in_the_cluster_file_are_named_as_a_way_out(tmp_path: Path) -> None:
    nodes = [{**n, "max_layers": 3} if n["gpu"] == "T4" else n for n in NODES]
    cluster = write_cluster(tmp_path, nodes)
    estimate(cluster)  # A100-80GB: 25 layers each, T4 capped at 3 by the cluster file: 68 < 80
    with pytest.raises(InfeasiblePlanError) as info:
        load_profiles_for(load_cluster(cluster))
    assert f"raise or remove the max_layers of nodes t0, t1, t2, t3, t4, t5 in {cluster}" in info.value.message
