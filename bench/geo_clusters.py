"""Geo-distributed test clusters (issue 17): regions joined by slow links, drawn like the Helix paper's.

    python bench/geo_clusters.py OUT_DIR        # writes OUT_DIR/<name>/cluster.yaml for every case

The paper's geo setting is LLaMA-2 70B on A100s, L4s and T4s spread over regions: 10 Gbit/s,
1 ms inside a region, ~0.1 Gbit/s and tens of ms between regions. This module draws such
clusters deterministically from a seed (:func:`write_geo_cluster`):

* 2-4 regions; the A100s (12-20 % of the nodes) all in one region, with up to two L4s beside
  them; the L4s (30-50 % of the rest) and T4s shuffled over the other regions;
* per region pair one link speed: bandwidth log-uniform in [0.05, 0.5] Gbit/s, latency uniform
  in [20, 80] ms (both directions alike); inside a region 10 Gbit/s, 1 ms;
* the coordinator in one region (its links are that region's: intra to it, the pair's to others),
  NIC 10 Gbit/s.

:func:`write_issue_geo_cluster` writes the cluster of the issue: 24 nodes, 4 A100 in one region,
2 L4 + 8 T4 and 6 L4 + 4 T4 in two others (the paper's geo cluster), 0.1 Gbit/s and 40-60 ms
between regions and from the coordinator (a site of its own).

Every file uses the paper's throughput tables (``clusters/helix-paper-single24/profiles-llama70b.yaml``,
by a relative path inside this checkout, else an absolute one) and holds the model several times over (checked when drawn).
Links between region pairs other than the first are explicit (``defaults.inter_region`` is the
first pair's), so the files are long but plain cluster files.
"""

from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "clusters" / "helix-paper-single24" / "profiles-llama70b.yaml"
MODEL = "llama-2-70b"
REGION_NAMES = ["us-east", "us-west", "eu-west", "ap-south"]
MAX_LAYERS = {"A100": 12, "L4": 7, "T4": 4}  # the profiles' layer caps (checked against the file in the tests)
NUM_LAYERS = 80
MIN_COPIES = 1.5  # a drawn cluster's layer slots must hold the model at least this many times
INTRA = {"bandwidth_gbps": 10.0, "latency_ms": 1.0}
COORDINATOR_NIC_GBPS = 10.0

GEO_SEEDS: list[tuple[int, int]] = [(1, 24), (2, 32), (3, 40), (6, 48)]  # 3, 4, 2 and 4 regions
ISSUE_NAME = "geo-issue24"


@dataclass(slots=True)
class GeoShape:
    """A geo cluster before it is written: regions' GPUs, region-pair links, the coordinator's site."""

    name: str
    regions: list[tuple[str, list[str]]]  # (region, GPU type of each node)
    pair_links: dict[tuple[str, str], dict[str, float]]  # (region a, region b), a < b in order -> link params
    coordinator_region: str  # a region of the cluster, or a site of its own (then in pair_links)
    notes: list[str] = field(default_factory=list)

    def link(self, a: str, b: str) -> dict[str, float]:
        if a == b:
            return INTRA
        return self.pair_links[(a, b)] if (a, b) in self.pair_links else self.pair_links[(b, a)]


def draw_shape(seed: int, n_nodes: int) -> GeoShape:
    """The seed's cluster of ``n_nodes`` nodes (deterministic)."""
    if n_nodes < 8:
        raise ValueError(f"a geo cluster needs at least 8 nodes, got {n_nodes}")
    rng = random.Random(seed * 1_000_003 + n_nodes)
    for _ in range(100):
        shape = _draw_once(rng, seed, n_nodes)
        slots = sum(MAX_LAYERS[g] for _, gpus in shape.regions for g in gpus)
        if slots >= MIN_COPIES * NUM_LAYERS:
            return shape
    raise AssertionError("no drawn cluster holds the model")  # pragma: no cover - the mix always does


def _draw_once(rng: random.Random, seed: int, n: int) -> GeoShape:
    k = rng.randint(2, min(4, n // 6))
    names = REGION_NAMES[:k]
    n_a100 = max(2, round(n * rng.uniform(0.12, 0.2)))
    rest = n - n_a100
    n_l4 = round(rest * rng.uniform(0.3, 0.5))
    pool = ["L4"] * n_l4 + ["T4"] * (rest - n_l4)
    rng.shuffle(pool)
    beside = min(rng.randint(0, 2), n_l4)
    home = ["A100"] * n_a100 + ["L4"] * beside
    for _ in range(beside):
        pool.remove("L4")
    # the other regions: sizes at least 3, the rest spread at random
    sizes = [3] * (k - 1)
    for _ in range(len(pool) - 3 * (k - 1)):
        sizes[rng.randrange(k - 1)] += 1
    regions: list[tuple[str, list[str]]] = [(names[0], home)]
    at = 0
    for r, size in zip(names[1:], sizes, strict=True):
        regions.append((r, sorted(pool[at : at + size])))
        at += size
    pairs: dict[tuple[str, str], dict[str, float]] = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            bw = math.exp(rng.uniform(math.log(0.05), math.log(0.5)))
            pairs[(a, b)] = {"bandwidth_gbps": round(bw, 3), "latency_ms": round(rng.uniform(20, 80), 1)}
    return GeoShape(f"geo-s{seed}-n{n}", regions, pairs, coordinator_region=rng.choice(names))


def issue_shape() -> GeoShape:
    """The issue's cluster: the paper's geo setting, 24 nodes in three regions, slow coordinator."""
    regions = [("us-east", ["A100"] * 4), ("us-west", ["L4"] * 2 + ["T4"] * 8), ("eu-west", ["L4"] * 6 + ["T4"] * 4)]
    slow = 0.1
    pairs = {
        ("us-east", "us-west"): {"bandwidth_gbps": slow, "latency_ms": 40.0},
        ("us-east", "eu-west"): {"bandwidth_gbps": slow, "latency_ms": 60.0},
        ("us-west", "eu-west"): {"bandwidth_gbps": slow, "latency_ms": 50.0},
        ("coordinator-site", "us-east"): {"bandwidth_gbps": slow, "latency_ms": 45.0},
        ("coordinator-site", "us-west"): {"bandwidth_gbps": slow, "latency_ms": 50.0},
        ("coordinator-site", "eu-west"): {"bandwidth_gbps": slow, "latency_ms": 55.0},
    }
    return GeoShape(ISSUE_NAME, regions, pairs, coordinator_region="coordinator-site")


def cluster_document(shape: GeoShape, profiles: str) -> dict[str, Any]:
    """The cluster file's content (``profiles``: the path written into it)."""
    nodes: list[dict[str, str]] = []
    for r, gpus in shape.regions:
        counters: dict[str, int] = {}
        for g in gpus:
            j = counters.get(g, 0)
            counters[g] = j + 1
            nodes.append({"id": f"{r}-{g.lower()}-{j}", "gpu": g, "region": r})
    region_names = [r for r, _ in shape.regions]
    sites = [shape.coordinator_region] + [r for r in region_names if r != shape.coordinator_region]
    pair_order = [(a, b) for i, a in enumerate(sites) for b in sites[i + 1 :]]
    default_pair = next(p for p in pair_order if p[0] in region_names and p[1] in region_names)
    inter = shape.link(*default_pair)
    members: dict[str, list[str]] = {r: [] for r in sites}
    members[shape.coordinator_region].insert(0, "coordinator")
    for nd in nodes:
        members[nd["region"]].append(nd["id"])
    links: list[dict[str, Any]] = []
    for a, b in pair_order:
        params = shape.link(a, b)
        if params == inter:
            continue  # defaults.inter_region says the same
        for u in members[a]:
            for v in members[b]:
                links.append({"src": u, "dst": v, **params, "bidirectional": True})
    coordinator: dict[str, Any] = {"id": "coordinator", "region": shape.coordinator_region,
                                   "nic_gbps": COORDINATOR_NIC_GBPS}
    return {
        "name": shape.name,
        "model": MODEL,
        "profiles": profiles,
        "coordinator": coordinator,
        "nodes": nodes,
        "links": links,
        "defaults": {"intra_region": dict(INTRA), "inter_region": dict(inter)},
    }


def _write(shape: GeoShape, dest_dir: Path) -> Path:
    dest_dir.mkdir(parents=True, exist_ok=True)
    inside = dest_dir.resolve().is_relative_to(ROOT)
    profiles = os.path.relpath(PROFILES, dest_dir.resolve()) if inside else str(PROFILES)
    doc = cluster_document(shape, profiles)
    head = f"# {shape.name}: generated by bench/geo_clusters.py (do not edit; regenerate)\n"
    path = dest_dir / "cluster.yaml"
    path.write_text(head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=140))
    return path


def write_geo_cluster(dest_dir: Path, seed: int, n_nodes: int) -> Path:
    """Draw the seed's cluster of ``n_nodes`` nodes and write ``dest_dir/cluster.yaml``; returns its path."""
    return _write(draw_shape(seed, n_nodes), Path(dest_dir))


def write_issue_geo_cluster(dest_dir: Path) -> Path:
    """Write the issue's 24-node geo cluster to ``dest_dir/cluster.yaml``; returns its path."""
    return _write(issue_shape(), Path(dest_dir))


def write_geo_clusters(out_dir: Path) -> list[Path]:
    """Every case: ``out_dir/geo-issue24`` and ``out_dir/geo-s<seed>-n<nodes>`` for each of GEO_SEEDS."""
    out = Path(out_dir)
    paths = [write_issue_geo_cluster(out / ISSUE_NAME)]
    for seed, n in GEO_SEEDS:
        paths.append(write_geo_cluster(out / f"geo-s{seed}-n{n}", seed, n))
    return paths


def describe(shape: GeoShape) -> str:
    parts = []
    for r, gpus in shape.regions:
        mix = ", ".join(f"{gpus.count(g)} {g}" for g in ("A100", "L4", "T4") if g in gpus)
        parts.append(f"{r}: {mix}")
    links = "; ".join(f"{a}<->{b} {p['bandwidth_gbps']} Gbit/s {p['latency_ms']} ms" for (a, b), p in shape.pair_links.items())
    return f"{shape.name} [{' | '.join(parts)}] coordinator in {shape.coordinator_region}; {links}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[0])
    for path, shape in zip(write_geo_clusters(out), [issue_shape()] + [draw_shape(s, n) for s, n in GEO_SEEDS],
                           strict=True):
        print(f"{path}: {describe(shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
