"""``helix plan``, ``helix evaluate`` and ``helix show`` run for real through ``helix.cli.main``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helix.cli import main
from helix.plan import load_plan

from .conftest import DEMO, GEO, ROOT, SINGLE24, load, small_instance

REQUIRED = {"placement", "max_flow_tok_s", "upper_bound_tok_s", "bound_method", "method", "status", "wall_s",
            "flows", "bottleneck", "solver"}


def _plan_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # --json prints only the plan


@pytest.mark.parametrize("method", ["petals", "swarm", "uniform"])
def test_plan_json_fields(capsys, method: str) -> None:
    plan = _plan_json(capsys, ["plan", str(SINGLE24), "--method", method, "--json"])
    assert REQUIRED <= set(plan)
    assert plan["method"] == method and plan["status"] == "heuristic"
    assert plan["upper_bound_tok_s"] == pytest.approx(2803.861, rel=1e-4)
    assert len(plan["placement"]) == 24 and plan["max_flow_tok_s"] > 700


def test_plan_paper_milp_json_and_output_file(capsys, tmp_path) -> None:
    out = tmp_path / "plan.json"
    cluster = small_instance(tmp_path)
    plan = _plan_json(capsys, ["plan", str(cluster), "--method", "paper-milp", "--threads", "1", "--json", "-o", str(out)])
    assert plan["status"] == "optimal" and plan["solver"].startswith("highs")
    assert load_plan(out).placement == {k: tuple(v) for k, v in plan["placement"].items()}
    evaluated = _plan_json(capsys, ["evaluate", str(cluster), str(out), "--json"])
    assert evaluated["max_flow_tok_s"] == pytest.approx(plan["max_flow_tok_s"], rel=1e-6)
    # the plan is a valid warm start for another run
    again = _plan_json(capsys, ["plan", str(cluster), "--method", "paper-milp", "--warm-start", str(out), "--json",
                                "--prune-links", "0.3", "--stop-at-bound", "--time-limit", "20"])
    assert again["max_flow_tok_s"] > 0


def test_plan_table_and_compare(capsys) -> None:
    assert main(["plan", str(GEO), "--method", "petals", "--compare"]) == 0
    out = capsys.readouterr().out
    for text in ("max flow", "upper bound", "bottleneck", "util", "swarm", "separate", "uniform", "status heuristic"):
        assert text in out, text


def test_show_png(capsys, tmp_path) -> None:
    png = tmp_path / "plan.png"
    ref = ROOT / "clusters" / "helix-paper-single24" / "reference" / "milp.json"
    assert main(["show", str(ref), "--cluster", str(SINGLE24), "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_console_script_subprocess() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "helix.cli", "plan", str(DEMO), "--method", "uniform", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["cluster"] == "demo" and plan["max_flow_tok_s"] > 0


def test_default_method_is_our_optimizer(capsys) -> None:
    cluster, _ = load(DEMO)
    plan = _plan_json(capsys, ["plan", str(DEMO), "--json", "--time-limit", "5", "--threads", "1"])
    assert plan["method"] == "helix" and set(plan["placement"]) <= set(cluster.node_ids)
