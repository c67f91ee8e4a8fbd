"""An agent refuses, before READY, weights that are not its cluster's model (real SmolLM2 weights)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import yaml

from helix.cli import main
from helix.errors import EngineError, HelixError
from helix.processes import Supervisor
from helix.spec import load_cluster
from node_agent.commands import check_weights

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_8B = {"num_layers": 32, "hidden_size": 4096, "dtype_bytes": 2, "layer_weight_bytes": 436224000,
             "kv_bytes_per_token_per_layer": 4096}  # fmt: skip


def write_llama3_cluster(root: Path, placement: dict[str, tuple[int, int]], *, with_profile: bool = True) -> tuple[Path, Path]:
    """A llama-3-8b cluster (profile: 32 layers, hidden size 4096) and a plan for it."""
    profiles = {"models": {"llama-3-8b": LLAMA3_8B},
                "gpus": {"L4": {"vram_gb": 24, "throughput": {"llama-3-8b": {"max_layers": 32, "tok_s": [100.0] * 32}}}}}
    if with_profile:
        (root / "profiles.yaml").write_text(yaml.safe_dump(profiles))
    cluster = root / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({
        "name": "mine", "model": "llama-3-8b", "profiles": "profiles.yaml",
        "nodes": [{"id": n, "gpu": "L4"} for n in placement],
        "defaults": {"intra_region": {"bandwidth_gbps": 10}},
    }))  # fmt: skip
    plan = root / "plan.json"
    plan.write_text(json.dumps({"cluster": "mine", "model": "llama-3-8b", "method": "manual", "max_flow_tok_s": 0,
                                "placement": {n: list(r) for n, r in placement.items()}}))
    return cluster, plan


def _agent(cluster: Path, plan: Path, node: str, model_dir: Path) -> list[str]:
    return ["agent", "--cluster", str(cluster), "--plan", str(plan), "--node", node, "--model-dir", str(model_dir)]


def test_smollm2_weights_on_a_llama3_cluster_are_refused_before_ready(tmp_path: Path, smollm2_dir: Path) -> None:
    cluster, plan = write_llama3_cluster(tmp_path, {"a": (0, 24), "b": (24, 32)})
    with Supervisor(tmp_path) as agents:
        agents.start("a", [sys.executable, "-m", "node_agent", *_agent(cluster, plan, "a", smollm2_dir)[1:]],
                     env={"COLUMNS": "400"})  # fmt: skip
        with pytest.raises(HelixError, match="agent a exited with code 5 before it was ready"):
            agents.wait_ready(timeout_s=60)  # READY would be the agent serving the wrong model
        err = " ".join(agents.processes["a"].log_text().split())
    assert "'llama-3-8b' (32 layers, hidden size 4096" in err and "profiles.yaml" in err
    assert "(30 layers, hidden size 576)" in err and smollm2_dir.name in err


def test_a_range_beyond_the_weights_names_the_model_without_a_profile(
    tmp_path: Path, smollm2_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster, plan = write_llama3_cluster(tmp_path, {"a": (0, 24), "b": (24, 32)}, with_profile=False)
    with caplog.at_level(logging.WARNING), pytest.raises(EngineError) as info:
        check_weights(load_cluster(cluster), str(smollm2_dir), node="b", layers=(24, 32), plan_source=str(plan))
    msg = info.value.message
    assert "[24, 32) of 'llama-3-8b'" in msg and "with 30 layers" in msg and smollm2_dir.name in msg
    assert "cannot check" in caplog.text and "profiles file not found" in caplog.text


def test_the_demo_weights_match_the_demo_cluster(smollm2_dir: Path) -> None:
    demo = load_cluster(ROOT / "clusters" / "demo" / "cluster.yaml")
    check_weights(demo, str(smollm2_dir), node="cpu-0", layers=(0, 30), plan_source="plan.json")  # no error


def test_a_plan_for_another_model_is_refused(tmp_path: Path, smollm2_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    cluster, plan = write_llama3_cluster(tmp_path, {"a": (0, 32)})
    plan.write_text(plan.read_text().replace("llama-3-8b", "smollm2-135m"))
    assert main(_agent(cluster, plan, "a", smollm2_dir)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "plan is for model 'smollm2-135m'" in err and "'llama-3-8b'" in err
