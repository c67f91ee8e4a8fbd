"""planner.viz: the min cut it highlights and the figures it writes (Agg backend, no display)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helix.profile import load_profiles_for
from helix.spec import load_cluster
from planner.api import evaluate_plan, load_checked_plan

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "clusters" / "helix-paper-single24"


@pytest.fixture(scope="module")
def paper_milp():  # noqa: ANN201 - (plan, cluster, profiles)
    cluster = load_cluster(PAPER / "cluster.yaml")
    profiles = load_profiles_for(cluster)
    plan = load_checked_plan(PAPER / "reference" / "milp.json", cluster, profiles)
    return evaluate_plan(cluster, profiles, plan, partial_handoffs=plan.partial_handoffs), cluster, profiles


def test_plan_view_finds_the_min_cut(paper_milp) -> None:  # noqa: ANN001
    from planner.viz import plan_view

    plan, cluster, profiles = paper_milp
    view = plan_view(plan, cluster, profiles)
    assert view.cut_nodes == {"l4-18", "t4-22"}  # the paper's MILP placement is compute-bound there
    assert not view.cut_links and not view.cut_nic
    assert all(0.0 <= u <= 1.0 + 1e-9 for u in view.utilization.values())
    assert view.utilization["l4-18"] == pytest.approx(1.0)
    cut = sum(view.capacity[n] for n in view.cut_nodes)
    assert cut == pytest.approx(plan.max_flow_tok_s)  # max flow = min cut


def test_flow_digraph_splits_the_coordinator(paper_milp) -> None:  # noqa: ANN001
    from planner.viz import COORD_IN, COORD_OUT, flow_digraph, plan_view

    plan, cluster, profiles = paper_milp
    g = flow_digraph(plan_view(plan, cluster, profiles), cluster.coordinator.id)
    out_of_source = sum(d["tok_s"] for _, _, d in g.out_edges(COORD_IN, data=True))
    into_sink = sum(d["tok_s"] for _, _, d in g.in_edges(COORD_OUT, data=True))
    assert out_of_source == pytest.approx(plan.max_flow_tok_s)
    assert into_sink == pytest.approx(plan.max_flow_tok_s)


def test_save_plan_png(paper_milp, tmp_path: Path) -> None:  # noqa: ANN001
    pytest.importorskip("matplotlib")
    from planner.viz import save_plan_png

    plan, cluster, profiles = paper_milp
    out = save_plan_png(plan, cluster, profiles, tmp_path / "plan.png", dpi=40)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
