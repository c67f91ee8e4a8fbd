"""planner.viz, planner.plan_view and planner.viz_layout: the min cut the picture highlights, where the layout puts
nodes (apart, inside their region's box), the fixed GPU colours, and the PNGs (Agg, no display)."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest
import yaml

from helix.cli import main
from helix.plan import Plan
from helix.profile import load_profiles_for
from helix.spec import ClusterSpec, load_cluster
from planner.api import evaluate_plan, load_checked_plan, make_plan
from planner.viz_layout import (
    CHAR_WIDTH,
    COORD_IN,
    COORD_OUT,
    GPU_COLORS,
    MIN_DISTANCE,
    PlanLayout,
    gpu_color,
    plan_layout,
)

from .conftest import DEMO, GEO, REFERENCE, SINGLE24

PAPER_PROFILES = SINGLE24.parent / "profiles-llama70b.yaml"
CUT_RED = "#d62728"


@pytest.fixture(scope="module")
def paper_milp():  # noqa: ANN201 - (plan, cluster, profiles)
    cluster = load_cluster(SINGLE24)
    profiles = load_profiles_for(cluster)
    plan = load_checked_plan(REFERENCE / "milp.json", cluster, profiles)
    return evaluate_plan(cluster, profiles, plan, partial_handoffs=plan.partial_handoffs), cluster, profiles


def test_plan_view_finds_the_min_cut(paper_milp) -> None:  # noqa: ANN001
    from planner.plan_view import plan_view

    plan, cluster, profiles = paper_milp
    view = plan_view(plan, cluster, profiles)
    assert view.cut_nodes == {"l4-18", "t4-22"}  # the paper's MILP placement is compute-bound there
    assert not view.cut_links and not view.cut_nic
    assert all(0.0 <= u <= 1.0 + 1e-9 for u in view.utilization.values())
    assert view.utilization["l4-18"] == pytest.approx(1.0)
    cut = sum(view.capacity[n] for n in view.cut_nodes)
    assert cut == pytest.approx(plan.max_flow_tok_s)  # max flow = min cut


def test_flow_digraph_splits_the_coordinator(paper_milp) -> None:  # noqa: ANN001
    from planner.plan_view import flow_digraph, plan_view

    plan, cluster, profiles = paper_milp
    g = flow_digraph(plan_view(plan, cluster, profiles), cluster.coordinator.id)
    out_of_source = sum(d["tok_s"] for _, _, d in g.out_edges(COORD_IN, data=True))
    into_sink = sum(d["tok_s"] for _, _, d in g.in_edges(COORD_OUT, data=True))
    assert out_of_source == pytest.approx(plan.max_flow_tok_s)
    assert into_sink == pytest.approx(plan.max_flow_tok_s)


# --- the layout: synthetic clusters of any size and the shipped ones -------------------------


def synthetic_cluster(n: int, regions: list[str], *, seed: int = 0, name_prefix: str = "") -> dict:
    """``n`` nodes of the paper's GPU types spread over ``regions`` (a cluster file's dict)."""
    rng = random.Random(seed)
    gpus = ["A100", "L4", "T4"]
    nodes = []
    for i in range(n):
        region = regions[i * len(regions) // n]
        gpu = gpus[rng.randrange(3)]
        nodes.append({"id": f"{name_prefix}{region}-{gpu.lower()}-{i}", "gpu": gpu, "region": region})
    return {"name": f"synthetic-{n}", "model": "llama-2-70b", "profiles": str(PAPER_PROFILES),
            "coordinator": {"id": "coordinator", "nic_gbps": 10, "region": regions[0]}, "nodes": nodes,
            "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 1},
                         "inter_region": {"bandwidth_gbps": 0.5, "latency_ms": 60}}}  # fmt: skip


def random_plan(cluster: ClusterSpec, *, seed: int, num_layers: int = 80, idle: float = 0.15) -> Plan:
    """Ranges of every width at every offset (the layout's worst case), some nodes holding nothing."""
    rng = random.Random(seed)
    placement: dict[str, tuple[int, int]] = {}
    for node in cluster.nodes:
        if rng.random() < idle:
            continue
        start = rng.randrange(num_layers)
        placement[node.id] = (start, min(num_layers, start + rng.randint(1, 12)))
    return Plan(cluster=cluster.name, model=cluster.model, method="given", placement=placement, max_flow_tok_s=0.0)


def _check_layout(cluster: ClusterSpec, layout: PlanLayout) -> None:
    pos = layout.positions
    assert set(pos) == {n.id for n in cluster.nodes} | {COORD_IN, COORD_OUT}
    for (a, (xa, ya)), (b, (xb, yb)) in itertools.combinations(pos.items(), 2):
        assert math.hypot(xa - xb, ya - yb) >= MIN_DISTANCE - 1e-9, f"{a} and {b} are too close"
        if abs(ya - yb) < 1e-9 and COORD_IN not in (a, b) and COORD_OUT not in (a, b):
            room = CHAR_WIDTH * (len(a) + len(b)) / 2  # two labels centred on their nodes, one row
            assert abs(xa - xb) >= room, f"the labels of {a} and {b} overlap"
    boxes = {b.name: b for b in layout.regions}
    assert len(boxes) == len(layout.regions)
    for node in cluster.nodes:
        region = node.region if node.region is not None else "(no region)"
        assert boxes[region].contains(*pos[node.id]), f"{node.id} lies outside its region {region}'s box"
    for a, b in itertools.combinations(layout.regions, 2):
        assert not a.overlaps(b), f"the boxes of {a.name} and {b.name} overlap"
    for end in (COORD_IN, COORD_OUT):
        assert not any(b.contains(*pos[end]) for b in layout.regions)


@pytest.mark.parametrize(("n", "regions"), [(3, ["only"]), (8, ["us", "eu"]), (24, ["a", "b", "c"]),
                                            (28, ["us-east", "us-west", "eu-west"]), (50, ["r1", "r2", "r3", "r4"])])  # fmt: skip
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layout_keeps_nodes_apart_and_inside_their_regions(n: int, regions: list[str], seed: int) -> None:
    cluster = ClusterSpec.model_validate(synthetic_cluster(n, regions, seed=seed))
    plan = random_plan(cluster, seed=seed)
    layout = plan_layout(cluster, plan, 80)
    _check_layout(cluster, layout)
    assert [b.name for b in layout.regions] == regions  # the coordinator's region first, then file order
    assert set(layout.unused) == {node.id for node in cluster.nodes} - set(plan.placement)


def test_layout_of_long_names_and_nodes_without_a_region() -> None:
    raw = synthetic_cluster(12, ["us-east"], seed=3, name_prefix="a-rather-long-node-name-")
    for node in raw["nodes"][::3]:
        del node["region"]
    cluster = ClusterSpec.model_validate(raw)
    layout = plan_layout(cluster, random_plan(cluster, seed=3), 80)
    _check_layout(cluster, layout)
    assert "(no region)" in {b.name for b in layout.regions}


@pytest.mark.parametrize("path", [DEMO, SINGLE24, GEO], ids=["demo-3", "single24", "geo-28"])
def test_layout_of_the_shipped_clusters(path: Path) -> None:
    cluster = load_cluster(path)
    profiles = load_profiles_for(cluster)
    plan = make_plan(cluster, profiles, method="petals")
    layout = plan_layout(cluster, plan, profiles.models[cluster.model].num_layers)
    _check_layout(cluster, layout)
    if path == GEO:
        assert [b.name for b in layout.regions] == ["us-east", "us-west", "eu-west"]
        # the pipeline reads left to right: a node holding later layers sits further right
        x = {n: layout.positions[n][0] for n in plan.placement}
        first, last = min(plan.placement, key=lambda n: plan.placement[n]), max(plan.placement, key=lambda n: plan.placement[n])
        assert x[first] < x[last]


def test_a_small_cluster_is_not_drawn_on_one_line() -> None:
    """Three nodes in one region: not all on one row, so arrows between them miss the others."""
    cluster = load_cluster(DEMO)
    plan = Plan(cluster="demo", model="smollm2-135m", method="given", max_flow_tok_s=0.0,
                placement={"cpu-0": (0, 30), "cpu-1": (0, 15), "cpu-2": (14, 30)})  # fmt: skip
    layout = plan_layout(cluster, plan, 30)
    assert len({round(layout.positions[n][1], 6) for n in plan.placement}) >= 2


def test_gpu_colours_are_fixed_across_clusters() -> None:
    paper = plan_layout(load_cluster(SINGLE24), Plan.model_validate_json((REFERENCE / "milp.json").read_text()))
    geo_cluster = load_cluster(GEO)
    geo = plan_layout(geo_cluster, random_plan(geo_cluster, seed=0))
    demo = load_cluster(DEMO)
    only_t4 = ClusterSpec.model_validate({**synthetic_cluster(3, ["x"]), "nodes": [
        {"id": f"t4-{i}", "gpu": "T4", "region": "x"} for i in range(3)]})  # fmt: skip
    solo = plan_layout(only_t4, random_plan(only_t4, seed=0, idle=0.0))
    for gpu in ("A100", "L4", "T4"):
        assert paper.gpu_colors[gpu] == geo.gpu_colors[gpu] == gpu_color(gpu) == GPU_COLORS[gpu]
    assert solo.gpu_colors["T4"] == paper.gpu_colors["T4"]  # not "the first colour of the palette"
    assert plan_layout(demo, Plan(cluster="demo", model="m", method="given", placement={"cpu-0": (0, 30)},
                                  max_flow_tok_s=0.0)).gpu_colors == {"cpu": GPU_COLORS["CPU"]}  # fmt: skip
    assert len(set(paper.gpu_colors.values())) == 3


def test_gpu_colour_of_any_name_is_stable_and_never_the_cut_red() -> None:
    assert gpu_color("a100-40gb") == gpu_color("A100_40GB") == gpu_color("A100")
    assert gpu_color("A100-80GB") != gpu_color("A100")
    names = [f"MadeUpGPU-{i}" for i in range(40)]
    colours = [gpu_color(n) for n in names]
    assert colours == [gpu_color(n) for n in names]  # a hash, not an order of appearance
    assert len(set(colours)) > 30
    for c in [*colours, *GPU_COLORS.values()]:
        r, g, b = (int(c[i : i + 2], 16) for i in (1, 3, 5))
        assert c != CUT_RED and not (r > 180 and g < 90 and b < 90), f"{c} reads as the min cut's red"


# --- the pictures -----------------------------------------------------------------------------


def test_save_plan_png(paper_milp, tmp_path: Path) -> None:  # noqa: ANN001
    from planner.viz import save_plan_png

    plan, cluster, profiles = paper_milp
    out = save_plan_png(plan, cluster, profiles, tmp_path / "plan.png", dpi=40)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flow_graph_legend_sits_outside_the_axes(paper_milp) -> None:  # noqa: ANN001
    """The key hides nothing: its box does not meet the flow graph's axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from planner.plan_view import plan_view
    from planner.viz import draw_flow_graph, flow_graph_size

    plan, cluster, profiles = paper_milp
    view = plan_view(plan, cluster, profiles)
    w, h = flow_graph_size(view)
    fig, ax = plt.subplots(figsize=(w + 2.0, h), layout="constrained")
    draw_flow_graph(ax, view, cluster.coordinator.id)
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1 - 1
    assert [t.get_text() for t in ax.get_legend().get_texts()][:3] == ["A100", "L4", "T4"]
    plt.close(fig)


def _write_cluster(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_helix_show_writes_a_png_for_50_nodes(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """50 nodes in three regions, some of them idle: ``helix show`` draws the plan ``helix plan`` made."""
    raw = synthetic_cluster(50, ["us-east", "eu-west", "ap-south"], seed=5)
    cluster_path = _write_cluster(tmp_path, raw)
    plan_path, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", str(cluster_path), "--method", "petals", "-o", str(plan_path)]) == 0
    assert main(["show", str(plan_path), "--cluster", str(cluster_path), "--png", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert height > width > 800  # sized to the cluster: one row per node below the graph


def test_edge_labels_miss_nodes_names_and_each_other() -> None:
    """Where edges get numbers (few edges), no number covers a node, a node's name or another number."""
    from planner.viz_layout import _meets, edge_label_boxes, node_boxes

    cluster = ClusterSpec.model_validate(synthetic_cluster(8, ["us-east", "eu-west"], seed=4))
    ids = [n.id for n in cluster.nodes]
    chain = {node: (10 * i, 10 * i + 10) for i, node in enumerate(ids)}
    plan = Plan(cluster=cluster.name, model=cluster.model, method="given", placement=chain, max_flow_tok_s=0.0)
    layout = plan_layout(cluster, plan, 80)
    hops = [(COORD_IN, ids[0]), *zip(ids, ids[1:], strict=False), (ids[-1], COORD_OUT), (COORD_IN, ids[3])]
    boxes = edge_label_boxes(layout, {hop: "1234" for hop in hops})
    covered = [box for group in node_boxes(layout).values() for box in group]
    for hop, box in boxes.items():
        assert not any(_meets(box, other) for other in covered), f"the label of {hop} covers a node or a name"
    for (a, box_a), (b, box_b) in itertools.combinations(boxes.items(), 2):
        assert not _meets(box_a, box_b), f"the labels of {a} and {b} overlap"
