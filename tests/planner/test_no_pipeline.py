"""A cluster whose best placement serves nothing is refused, saying why (not a plan of 0 tok/s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helix.cli import main

PROFILES = Path(__file__).resolve().parents[2] / "clusters" / "helix-paper-single24" / "profiles-llama70b.yaml"


def _cluster(tmp_path: Path, node_links: str) -> Path:
    nodes = "".join(f"  - {{id: a{i}, gpu: A100}}\n" for i in range(7))
    links = "".join(f"  - {{src: coordinator, dst: a{i}, bandwidth_gbps: 10, bidirectional: true}}\n" for i in range(7))
    path = tmp_path / "cluster.yaml"
    path.write_text(f"name: islands\nmodel: llama-2-70b\nprofiles: {PROFILES}\nnodes:\n{nodes}links:\n{links}{node_links}")
    return path


def test_no_links_between_nodes_is_an_error_naming_the_cause(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Seven A100s hold 12 layers each: only a chain of them holds llama-2-70b's 80 layers.
    code = main(["plan", str(_cluster(tmp_path, "")), "--time-limit", "2", "-o", str(tmp_path / "plan.json")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 3
    assert "no complete pipeline" in err and "no links between its nodes" in err
    assert not (tmp_path / "plan.json").exists()


def test_linked_nodes_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chain = "".join(f"  - {{src: a{i}, dst: a{i + 1}, bandwidth_gbps: 10}}\n" for i in range(6))
    assert main(["plan", str(_cluster(tmp_path, chain)), "--time-limit", "2", "--json"]) == 0
    assert '"max_flow_tok_s"' in capsys.readouterr().out
