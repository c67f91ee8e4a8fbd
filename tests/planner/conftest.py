"""Shared helpers for the planner tests: the shipped clusters and small synthetic ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from helix.profile import ProfileSet, load_profiles_for
from helix.spec import ClusterSpec, load_cluster

ROOT = Path(__file__).resolve().parents[2]
SINGLE24 = ROOT / "clusters" / "helix-paper-single24" / "cluster.yaml"
DEMO = ROOT / "clusters" / "demo" / "cluster.yaml"
GEO = ROOT / "clusters" / "geo-3region" / "cluster.yaml"
REFERENCE = ROOT / "clusters" / "helix-paper-single24" / "reference"


def load(path: Path) -> tuple[ClusterSpec, ProfileSet]:
    cluster = load_cluster(path)
    return cluster, load_profiles_for(cluster)


@pytest.fixture(scope="session")
def single24() -> tuple[ClusterSpec, ProfileSet]:
    return load(SINGLE24)


def small_instance(tmp_path: Path, *, layers: int = 4) -> Path:
    """Four heterogeneous nodes in two regions, one missing link, a slow inter-region link."""
    profiles: dict[str, Any] = {
        "models": {
            "tiny": {"num_layers": layers, "hidden_size": 64, "dtype_bytes": 2,
                     "layer_weight_bytes": 1e6, "kv_bytes_per_token_per_layer": 256}
        },
        "gpus": {
            "big": {"vram_gb": 8, "throughput": {"tiny": {"max_layers": 3, "tok_s": [900.0, 520.0, 330.0]}}},
            "small": {"vram_gb": 4, "throughput": {"tiny": {"max_layers": 2, "tok_s": [400.0, 150.0]}}},
        },
    }
    cluster = {
        "name": "small",
        "model": "tiny",
        "profiles": "profiles.yaml",
        "nodes": [
            {"id": "b0", "gpu": "big", "region": "r1"},
            {"id": "b1", "gpu": "big", "region": "r2"},
            {"id": "s0", "gpu": "small", "region": "r1"},
            {"id": "s1", "gpu": "small", "region": "r2"},
        ],
        "links": [
            # 0.0008 Gbit/s = 100000 B/s = 781 activations/s: binds the big nodes' hand-off
            {"src": "b0", "dst": "b1", "bandwidth_gbps": 0.0008, "latency_ms": 50},
            {"src": "s1", "dst": "s0", "bandwidth_gbps": 0.0001, "latency_ms": 50},
        ],
        "defaults": {
            "intra_region": {"bandwidth_gbps": 10, "latency_ms": 1},
            "inter_region": {"bandwidth_gbps": 0.002, "latency_ms": 50},
        },
    }
    (tmp_path / "profiles.yaml").write_text(yaml.safe_dump(profiles))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    return path


def mixed_cluster(tmp_path: Path, name: str, nodes: list[dict[str, str]]) -> Path:
    """A LLaMA-2 70B cluster of the paper's GPUs (single24's profiles), regions from the nodes."""
    doc = {
        "name": name, "model": "llama-2-70b", "profiles": str(SINGLE24.parent / "profiles-llama70b.yaml"),
        "coordinator": {"id": "coordinator", "region": nodes[0]["region"], "nic_gbps": 10},
        "nodes": nodes,
        "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 1},
                     "inter_region": {"bandwidth_gbps": 0.5, "latency_ms": 60}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def mixed64(tmp_path: Path) -> Path:
    """64 A100/L4/T4 nodes in three regions joined by slow links."""
    mix = {"us-east": ["A100"] * 6 + ["L4"] * 10 + ["T4"] * 10, "us-west": ["L4"] * 10 + ["T4"] * 10,
           "eu": ["A100"] * 4 + ["T4"] * 14}
    nodes = [{"id": f"{r}-{g.lower()}-{i}", "gpu": g, "region": r} for r, gs in mix.items() for i, g in enumerate(gs)]
    return mixed_cluster(tmp_path, "mixed64", nodes)
