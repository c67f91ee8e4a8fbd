"""File validation shows every problem (up to a limit) and suggests the field a typo meant."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from helix.cli import main
from helix.errors import ConfigError
from helix.loading import MAX_PROBLEMS
from helix.profile import load_profile_file
from helix.spec import load_cluster

PROFILES: dict[str, Any] = {
    "models": {"m": {"num_layers": 4, "hidden_size": 8, "layer_weight_bytes": 1e6, "kv_bytes_per_token_per_layer": 16}},
    "gpus": {"G": {"vram_gb": 1, "throughput": {"m": {"max_layers": 4, "tok_s": [400, 200, 100, 50]}}}},
}
CLUSTER: dict[str, Any] = {
    "name": "t",
    "model": "m",
    "profiles": "profiles.yaml",
    "nodes": [{"id": "a", "gpu": "G"}],
    "links": [{"src": "coordinator", "dst": "a", "bandwidth_gbps": 1, "bidirectional": True}],
}


def write(tmp_path: Path, cluster: dict, profiles: dict | None = None) -> Path:
    (tmp_path / "profiles.yaml").write_text(yaml.safe_dump(profiles or PROFILES))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    return path


def test_misspelt_bandwidth_names_the_typo_with_a_suggestion_and_the_missing_field(tmp_path, capsys) -> None:
    c = copy.deepcopy(CLUSTER)
    c["links"][0]["bandwith_gbps"] = c["links"][0].pop("bandwidth_gbps")
    path = write(tmp_path, c)
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "more error" not in err
    assert "links[0].bandwith_gbps: unknown field (did you mean 'bandwidth_gbps'?)" in err, err
    assert "links[0].bandwidth_gbps: Field required" in err, err
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert info.value.source == str(path)
    assert info.value.field in ("links[0].bandwith_gbps", "links[0].bandwidth_gbps")


def test_every_problem_is_listed_up_to_the_limit(tmp_path) -> None:
    c = copy.deepcopy(CLUSTER)
    c["nodes"] = [{"id": f"n{i}", "gpu": "G", "colour": "red"} for i in range(MAX_PROBLEMS + 2)]
    with pytest.raises(ConfigError) as info:
        load_cluster(write(tmp_path, c))
    text = info.value.message
    assert f"{MAX_PROBLEMS + 2} problems" in text
    shown = [line for line in text.splitlines() if "colour: unknown field" in line]
    assert len(shown) == MAX_PROBLEMS
    assert "... and 2 more" in text
    assert info.value.field == "nodes[0].colour"


def test_suggestions_come_from_the_fields_at_that_place(tmp_path) -> None:
    c = copy.deepcopy(CLUSTER)
    c["nodes"][0]["max_layer"] = 2  # NodeSpec's field
    c["defaults"] = {"intra_region": {"bandwidth_gbps": 1, "latncy_ms": 1}}  # LinkParams behind `| None`
    with pytest.raises(ConfigError) as info:
        load_cluster(write(tmp_path, c))
    text = info.value.message
    assert "nodes[0].max_layer: unknown field (did you mean 'max_layers'?)" in text
    assert "defaults.intra_region.latncy_ms: unknown field (did you mean 'latency_ms'?)" in text


def test_nested_profile_typo_is_suggested(tmp_path) -> None:
    profiles = copy.deepcopy(PROFILES)
    profiles["gpus"]["G"]["throughput"]["m"]["tok_per_s"] = profiles["gpus"]["G"]["throughput"]["m"].pop("tok_s")
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(profiles))
    with pytest.raises(ConfigError) as info:
        load_profile_file(path)
    assert "gpus.G.throughput.m.tok_per_s: unknown field (did you mean 'tok_s'?)" in info.value.message


def test_an_unknown_field_without_a_close_match_lists_the_known_ones(tmp_path) -> None:
    c = copy.deepcopy(CLUSTER)
    c["colour"] = "red"
    with pytest.raises(ConfigError) as info:
        load_cluster(write(tmp_path, c))
    assert "colour: unknown field (known here: name, model, profiles, coordinator, nodes, links, defaults, regions, tasks, keys_dir)" in str(info.value)


def test_a_union_reports_one_line_not_one_per_member(tmp_path) -> None:
    c = copy.deepcopy(CLUSTER)
    c["profiles"] = 5
    with pytest.raises(ConfigError) as info:
        load_cluster(write(tmp_path, c))
    assert info.value.field == "profiles"
    assert "profiles: Input should be a valid string or a valid list" in str(info.value)
