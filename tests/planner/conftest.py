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
