"""The cluster file's shared capacities: ``regions`` (uplink / downlink) and a node's ``nic_gbps``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from helix.errors import ConfigError
from helix.profile import load_profiles_for
from helix.spec import load_cluster
from planner.capacity import CapacityModel

PROFILES = {
    "models": {"m": {"num_layers": 4, "hidden_size": 8, "dtype_bytes": 2, "layer_weight_bytes": 1e6,
                     "kv_bytes_per_token_per_layer": 16}},
    "gpus": {"G": {"vram_gb": 1, "throughput": {"m": {"max_layers": 4, "tok_s": [400, 200, 130, 100]}}}},
}  # fmt: skip


def cluster(**extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "t", "model": "m", "profiles": "profiles.yaml",
        "coordinator": {"region": "r1"},
        "nodes": [{"id": "a", "gpu": "G", "region": "r1"}, {"id": "b", "gpu": "G", "region": "r2", "nic_gbps": 0.5}],
        "defaults": {"intra_region": {"bandwidth_gbps": 10}, "inter_region": {"bandwidth_gbps": 1}},
    }  # fmt: skip
    doc.update(extra)
    return doc


def write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    (tmp_path / "profiles.yaml").write_text(yaml.safe_dump(PROFILES))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_regions_and_nic_reach_the_capacity_model_in_activation_tokens(tmp_path: Path) -> None:
    spec = load_cluster(write(tmp_path, cluster(regions={"r1": {"uplink_gbps": 1}, "r2": {"downlink_gbps": 2,
                                                                                          "uplink_gbps": 0.25}})))
    assert spec.regions["r1"].down_gbps == 1  # one value gives the other
    assert spec.crosses_regions("a", "b") and spec.crosses_regions("coordinator", "b")
    assert not spec.crosses_regions("coordinator", "a")
    cap = CapacityModel.build(spec, load_profiles_for(spec))
    act = 8 * 2  # hidden_size x dtype_bytes
    assert cap.region_uplink_tok_s("r1") == pytest.approx(1e9 / 8 / act)
    assert cap.region_downlink_tok_s("r1") == pytest.approx(1e9 / 8 / act)
    assert cap.region_uplink_tok_s("r2") == pytest.approx(0.25e9 / 8 / act)
    assert cap.region_downlink_tok_s("r2") == pytest.approx(2e9 / 8 / act)
    assert cap.node_nic_tok_s("b") == pytest.approx(0.5e9 / 8 / act)
    assert cap.node_nic_tok_s("a") is None and cap.region_uplink_tok_s(None) is None
    assert cap.has_shared_links and not cap.links_uniform()


def test_without_the_table_nothing_is_shared(tmp_path: Path) -> None:
    doc = cluster()
    del doc["nodes"][1]["nic_gbps"]
    spec = load_cluster(write(tmp_path, doc))
    cap = CapacityModel.build(spec, load_profiles_for(spec))
    assert not cap.has_shared_links
    assert cap.region_uplink_tok_s("r1") is None and cap.region_downlink_tok_s("r2") is None


@pytest.mark.parametrize(
    ("regions", "nic", "field"),
    [
        ({"r9": {"uplink_gbps": 1}}, None, "regions.r9: no node or coordinator is in region 'r9'"),
        ({"r1": {"uplink_gbps": 0}}, None, "regions.r1.uplink_gbps"),
        ({"r1": {"downlink_gbps": -1}}, None, "regions.r1.downlink_gbps"),
        ({"r1": {}}, None, "give uplink_gbps or downlink_gbps"),
        ({"r1": {"uplink_gbs": 1}}, None, "regions.r1.uplink_gbs: unknown field (did you mean 'uplink_gbps'?)"),
        ({}, 0, "nodes[1].nic_gbps"),
    ],
)
def test_bad_shared_capacities_name_file_and_field(tmp_path: Path, regions: dict, nic: float | None, field: str) -> None:
    doc = cluster(regions=regions)
    doc["nodes"][1]["nic_gbps"] = nic
    with pytest.raises(ConfigError) as err:
        load_cluster(write(tmp_path, doc))
    assert "cluster.yaml" in str(err.value) and field in str(err.value), str(err.value)
