"""The optimizer on synthetic geo clusters: 5 GPU types, 3 regions, slow inter-region links.

``synthetic(n)`` is the recipe behind the 100-node figures in docs/notes/planner-results.md
(there: 12 A100, 16 V100, 20 A10, 24 L4, 28 T4, seed 42); the test runs a 40-node one.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import yaml

from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner.api import baseline_placements
from planner.capacity import CapacityModel
from planner.graph import max_flow_value
from planner.optimize import optimize
from planner.options import PlannerOptions

PROFILES = Path(__file__).resolve().parents[2] / "clusters" / "helix-paper-single24" / "profiles-llama70b.yaml"
MODEL = "llama-2-70b"


def _scaled(gpus: dict[str, Any], src: str, speed: float, vram: float, max_layers: int, kv_scale: float) -> dict[str, Any]:
    t = copy.deepcopy(gpus[src]["throughput"][MODEL])
    tok = [x * speed for x in t["tok_s"]]
    while len(tok) < max_layers:  # extend with k*T(k) shrinking like the real tables
        tok.append(tok[-1] * len(tok) / (len(tok) + 1))
    t["max_layers"] = max_layers
    t["tok_s"] = tok[:max_layers]
    for key in ("prefill_ms_per_layer", "decode_ms_per_layer"):
        t[key] = [[a, b / speed] for a, b in t[key]]
    kv = [x * kv_scale for x in t["kv_capacity_tokens_by_layers"]]
    while len(kv) < max_layers:
        kv.append(kv[-1] * 0.9)
    t["kv_capacity_tokens_by_layers"] = kv[:max_layers]
    for key in ("prompt_max_tokens_by_layers", "decode_max_tokens_by_layers"):
        if t.get(key):
            v = t[key] + [t[key][-1]] * max_layers
            t[key] = v[:max_layers]
    return {"vram_gb": vram, "throughput": {MODEL: t}}


def synthetic(mix: dict[str, int], *, seed: int = 42) -> tuple[ClusterSpec, ProfileSet]:
    data = yaml.safe_load(PROFILES.read_text())
    gpus = data["gpus"]
    gpus["V100"] = _scaled(gpus, "A100", 0.55, 32, 10, 0.75)
    gpus["A10"] = _scaled(gpus, "L4", 1.35, 24, 7, 1.0)
    profiles = ProfileSet.model_validate(data)
    rng = random.Random(seed)
    regions = ["us-east", "us-west", "eu-west"]
    nodes = [{"id": f"{g.lower()}-{i}", "gpu": g, "region": regions[rng.randrange(3)]}
             for g, n in mix.items() for i in range(n)]
    cluster = ClusterSpec.model_validate({
        "name": f"synthetic-{len(nodes)}", "model": MODEL, "profiles": "unused.yaml",
        "coordinator": {"id": "coordinator", "region": "us-east", "nic_gbps": 10},
        "nodes": nodes,
        "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 1},
                     "inter_region": {"bandwidth_gbps": 0.5, "latency_ms": 60}},
    })
    return cluster, profiles


def test_synthetic_geo_cluster_beats_the_best_baseline() -> None:
    cluster, profiles = synthetic({"A100": 5, "V100": 6, "A10": 8, "L4": 9, "T4": 12})
    cap = CapacityModel.build(cluster, profiles)
    best_baseline = max(max_flow_value(cap, p) for p in baseline_placements(cluster, profiles, cap).values())
    res = optimize(cluster, profiles, PlannerOptions(objective="max-flow", time_limit_s=20, threads=2))
    assert res.max_flow_tok_s == max_flow_value(cap, res.placement)
    assert res.max_flow_tok_s >= best_baseline
    assert res.max_flow_tok_s <= res.upper_bound_tok_s * (1 + 1e-9)
    assert res.upper_bound_tok_s < sum(max(k * t for k, t in enumerate(cap.node_tok_s[n], 1)) for n in cap.node_tok_s) / 80
