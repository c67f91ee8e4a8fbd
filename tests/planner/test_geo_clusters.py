"""bench/geo_clusters.py: the generated geo clusters are deterministic, load, hold the model and
have the links they were drawn with."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from helix.profile import load_profiles_for
from helix.spec import load_cluster
from planner.bounds import area_bound
from planner.capacity import CapacityModel

PATH = Path(__file__).resolve().parents[2] / "bench" / "geo_clusters.py"
_spec = importlib.util.spec_from_file_location("bench_geo_clusters", PATH)
assert _spec is not None and _spec.loader is not None
geo = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = geo  # dataclasses look their module up while the file runs
_spec.loader.exec_module(geo)


def test_same_seed_same_file(tmp_path: Path) -> None:
    a = geo.write_geo_cluster(tmp_path / "a", 5, 30).read_text()
    b = geo.write_geo_cluster(tmp_path / "b", 5, 30).read_text()
    c = geo.write_geo_cluster(tmp_path / "c", 6, 30).read_text()
    assert a == b
    assert a != c


def test_cases_cover_24_to_48_nodes() -> None:
    assert len(geo.GEO_SEEDS) >= 3
    assert all(24 <= n <= 48 for _, n in geo.GEO_SEEDS)


@pytest.mark.parametrize("seed, n_nodes", [*geo.GEO_SEEDS, (11, 24), (12, 36)])
def test_drawn_cluster_loads_and_has_its_links(tmp_path: Path, seed: int, n_nodes: int) -> None:
    shape = geo.draw_shape(seed, n_nodes)
    cluster = load_cluster(geo.write_geo_cluster(tmp_path, seed, n_nodes))
    profiles = load_profiles_for(cluster)
    assert len(cluster.nodes) == n_nodes
    regions = {n.region for n in cluster.nodes}
    assert 2 <= len(regions) <= 4
    a100_regions = {n.region for n in cluster.nodes if n.gpu == "A100"}
    assert len(a100_regions) == 1  # concentrated in one region
    assert cluster.coordinator.region in regions
    for gpu, cap in geo.MAX_LAYERS.items():
        assert profiles.throughput(gpu, geo.MODEL).max_layers == cap
    links = cluster.resolved_links()
    vertices = [cluster.coordinator.id, *cluster.node_ids]
    assert len(links) == len(vertices) * (len(vertices) - 1)  # every pair, both ways
    for (src, dst), link in links.items():
        rs, rd = cluster.region_of(src), cluster.region_of(dst)
        want = shape.link(rs, rd)
        assert (link.bandwidth_gbps, link.latency_ms) == (want["bandwidth_gbps"], want["latency_ms"])
        if rs != rd:
            assert 0.05 <= link.bandwidth_gbps <= 0.5 and 20 <= link.latency_ms <= 80
        else:
            assert (link.bandwidth_gbps, link.latency_ms) == (10.0, 1.0)
    cap = CapacityModel.build(cluster, profiles)
    assert sum(cap.max_layers.values()) >= 1.5 * cap.num_layers  # the model fits, with room
    assert area_bound(cap) > 0


def test_issue_cluster_is_the_papers_geo_shape(tmp_path: Path) -> None:
    paths = geo.write_geo_clusters(tmp_path)
    assert len(paths) == len(geo.GEO_SEEDS) + 1
    cluster = load_cluster(tmp_path / geo.ISSUE_NAME / "cluster.yaml")
    load_profiles_for(cluster)
    by_region: dict[str | None, list[str]] = {}
    for n in cluster.nodes:
        by_region.setdefault(n.region, []).append(n.gpu)
    assert len(cluster.nodes) == 24
    assert sorted(sorted(g) for g in by_region.values()) == sorted(
        [["A100"] * 4, ["L4"] * 2 + ["T4"] * 8, ["L4"] * 6 + ["T4"] * 4])
    assert cluster.coordinator.region not in by_region
    for (src, dst), link in cluster.resolved_links().items():
        if cluster.region_of(src) != cluster.region_of(dst):
            assert link.bandwidth_gbps == 0.1 and 40 <= link.latency_ms <= 60
        else:
            assert link.bandwidth_gbps == 10.0


def test_cli_writes_every_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert geo.main([str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("*/cluster.yaml"))) == len(geo.GEO_SEEDS) + 1
    assert geo.ISSUE_NAME in capsys.readouterr().out
