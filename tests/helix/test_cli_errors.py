"""Every bad input of the planner issue: an error naming the file and field, a non-zero exit, no traceback."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from helix.cli import main

ROOT = Path(__file__).resolve().parents[2]

PROFILES: dict[str, Any] = {
    "models": {"m": {"num_layers": 4, "hidden_size": 8, "layer_weight_bytes": 1e6, "kv_bytes_per_token_per_layer": 16}},
    "gpus": {"G": {"vram_gb": 1, "throughput": {"m": {"max_layers": 2, "tok_s": [400, 200]}}}},
}
GOOD: dict[str, Any] = {
    "name": "t",
    "model": "m",
    "profiles": "profiles.yaml",
    "nodes": [{"id": "a", "gpu": "G"}, {"id": "b", "gpu": "G"}],
    "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 1}},
}


def write(tmp_path: Path, cluster: dict, profiles: dict | None = None) -> Path:
    (tmp_path / "profiles.yaml").write_text(yaml.safe_dump(profiles or PROFILES))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    return path


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return code, " ".join(captured.err.split())


def expect_error(capsys, argv: list[str], *needles: str) -> str:
    code, err = run_cli(capsys, argv)
    assert code != 0
    assert err.startswith("error:"), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def mutate(fn) -> dict:
    c = copy.deepcopy(GOOD)
    fn(c)
    return c


def test_good_cluster_plans(tmp_path, capsys) -> None:
    code, _ = run_cli(capsys, ["plan", str(write(tmp_path, GOOD)), "--method", "petals", "--json"])
    assert code == 0


def test_unknown_gpu_type(tmp_path, capsys) -> None:
    path = write(tmp_path, mutate(lambda c: c["nodes"][1].update(gpu="H100")))
    expect_error(capsys, ["plan", str(path), "--method", "petals"], str(path), "nodes[1].gpu", "H100")


def test_unknown_model(tmp_path, capsys) -> None:
    path = write(tmp_path, mutate(lambda c: c.update(model="llama-9000")))
    expect_error(capsys, ["plan", str(path)], str(path), "model", "llama-9000")


def test_model_that_cannot_fit_anywhere(tmp_path, capsys) -> None:
    path = write(tmp_path, mutate(lambda c: c.update(nodes=[{"id": "a", "gpu": "G"}])))
    expect_error(capsys, ["plan", str(path), "--method", "petals"], str(path), "4 layers", "at most 2")


def test_coordinator_with_no_links(tmp_path, capsys) -> None:
    def f(c: dict) -> None:
        del c["defaults"]
        c["links"] = [{"src": "a", "dst": "b", "bandwidth_gbps": 1, "bidirectional": True}]

    expect_error(capsys, ["plan", str(write(tmp_path, mutate(f))), "--method", "petals"], "cluster.yaml", "links", "coordinator")


def test_node_nothing_reaches(tmp_path, capsys) -> None:
    def f(c: dict) -> None:
        del c["defaults"]
        c["links"] = [
            {"src": "coordinator", "dst": "a", "bandwidth_gbps": 1, "bidirectional": True},
        ]

    expect_error(capsys, ["plan", str(write(tmp_path, mutate(f))), "--method", "petals"], "cluster.yaml", "nodes[1]", "'b'")


def test_duplicate_ids(tmp_path, capsys) -> None:
    path = write(tmp_path, mutate(lambda c: c["nodes"].append({"id": "a", "gpu": "G"})))
    expect_error(capsys, ["plan", str(path), "--method", "petals"], str(path), "nodes[2].id", "duplicate")


@pytest.mark.parametrize("bandwidth", [0, -5])
def test_non_positive_bandwidth(tmp_path, capsys, bandwidth: float) -> None:
    link = {"src": "coordinator", "dst": "a", "bandwidth_gbps": bandwidth}
    path = write(tmp_path, mutate(lambda c: c.update(links=[link])))
    expect_error(capsys, ["plan", str(path), "--method", "petals"], str(path), "links[0].bandwidth_gbps")


def test_non_positive_default_bandwidth(tmp_path, capsys) -> None:
    path = write(tmp_path, mutate(lambda c: c["defaults"]["intra_region"].update(bandwidth_gbps=0)))
    expect_error(capsys, ["plan", str(path)], str(path), "defaults.intra_region.bandwidth_gbps")


def test_unknown_field_in_cluster(tmp_path, capsys) -> None:
    path = write(tmp_path, mutate(lambda c: c["nodes"][0].update(gpus="G")))
    expect_error(capsys, ["plan", str(path)], str(path), "nodes[0].gpus", "unknown field")


def test_unknown_field_in_profiles(tmp_path, capsys) -> None:
    profiles = copy.deepcopy(PROFILES)
    profiles["gpus"]["G"]["throughput"]["m"]["tok_per_s"] = [1, 2]
    path = write(tmp_path, GOOD, profiles)
    expect_error(capsys, ["plan", str(path)], "profiles.yaml", "gpus.G.throughput.m.tok_per_s", "unknown field")


def _plan_file(tmp_path: Path, placement: dict) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"cluster": "t", "model": "m", "method": "hand", "placement": placement, "max_flow_tok_s": 0}))
    return path


def test_plan_not_covering_all_layers(tmp_path, capsys) -> None:
    cluster = write(tmp_path, GOOD)
    plan = _plan_file(tmp_path, {"a": [0, 2], "b": [3, 4]})
    expect_error(capsys, ["evaluate", str(cluster), str(plan)], str(plan), "placement", "layers 2", "cover all 4")


def test_plan_with_unknown_node(tmp_path, capsys) -> None:
    cluster = write(tmp_path, GOOD)
    plan = _plan_file(tmp_path, {"a": [0, 2], "zz": [2, 4]})
    expect_error(capsys, ["evaluate", str(cluster), str(plan)], str(plan), "placement.zz")


def test_plan_exceeding_a_node_limit(tmp_path, capsys) -> None:
    cluster = write(tmp_path, GOOD)
    plan = _plan_file(tmp_path, {"a": [0, 3], "b": [3, 4]})
    expect_error(capsys, ["evaluate", str(cluster), str(plan)], str(plan), "placement.a", "at most 2")


def test_bad_warm_start_names_the_plan(tmp_path, capsys) -> None:
    cluster = write(tmp_path, GOOD)
    plan = _plan_file(tmp_path, {"a": [0, 2]})
    expect_error(capsys, ["plan", str(cluster), "--method", "paper-milp", "--warm-start", str(plan)], str(plan), "placement")


def test_missing_file(tmp_path, capsys) -> None:
    expect_error(capsys, ["plan", str(tmp_path / "nope.yaml")], "nope.yaml", "file not found")


def test_bad_option_values(tmp_path, capsys) -> None:
    cluster = str(write(tmp_path, GOOD))
    expect_error(capsys, ["plan", cluster, "--method", "paper-milp", "--prune-links", "1.5"], "--prune-links")
    expect_error(capsys, ["plan", cluster, "--threads", "0"], "--threads")


def test_subprocess_exit_code_and_no_traceback(tmp_path) -> None:
    path = write(tmp_path, mutate(lambda c: c["nodes"][1].update(gpu="H100")))
    proc = subprocess.run([sys.executable, "-m", "helix.cli", "plan", str(path)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "nodes[1].gpu" in proc.stderr


@pytest.mark.parametrize(
    ("flags", "blamed", "not_blamed"),
    [
        (["--model", "mistral-7b"], "error: --model: unknown model 'mistral-7b'", "--model-config:"),
        (["--model-config", "no/such/config.json"], "error: --model-config: no such file", "--model:"),
    ],
)
def test_estimate_blames_the_flag_the_user_passed(capsys, flags: list[str], blamed: str, not_blamed: str) -> None:
    err = expect_error(capsys, ["profile", "--estimate", "--gpus", "A100", *flags], blamed)
    assert not_blamed not in err
    if flags[0] == "--model":
        assert "llama-2-70b" in err and "smollm2-135m" in err  # the models it knows


def test_estimate_of_a_cluster_blames_its_model_field(tmp_path, capsys) -> None:
    path = write(tmp_path, mutate(lambda c: c.update(model="mistral-7b")))
    err = expect_error(capsys, ["profile", "--estimate", "--cluster", str(path)], "model: unknown model 'mistral-7b'")
    assert "--model" not in err.split("unknown model")[0]
