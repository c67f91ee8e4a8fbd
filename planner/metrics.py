"""Serving-relevant facts about a placement beyond its max flow: pipeline depth and KV per layer.

* **Pipeline depth** — how many nodes (stages) a request passes through. Flows form a DAG
  (every hand-off moves strictly forward in the model), so along paths that carry flow the
  shortest and longest stage counts are path lengths in that DAG, and the flow-weighted mean
  is ``sum_i flow_through_i / F`` (each unit of flow visits that many nodes on average).
* **KV per layer** — tokens of context the cluster can keep for one layer: the sum over the
  nodes holding that layer of ``kv_capacity_tokens_by_layers[k-1] / k``; the minimum over
  layers limits how many requests fit at once.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cache

from helix.domain import Placement
from helix.plan import FlowEdge
from helix.profile import ProfileSet
from helix.spec import ClusterSpec


def pipeline_depths(flows: list[FlowEdge], coordinator: str) -> dict[str, float]:
    """``{"min": .., "mean": .., "max": ..}`` stages along paths that carry flow (0s if none)."""
    succ: dict[str, list[str]] = defaultdict(list)
    through: dict[str, float] = defaultdict(float)
    total = 0.0
    for e in flows:
        if e.tok_s <= 1e-9:
            continue
        succ[e.src].append(e.dst)
        if e.src == coordinator:
            total += e.tok_s
        if e.dst != coordinator:
            through[e.dst] += e.tok_s
    if total <= 0:
        return {"min": 0.0, "mean": 0.0, "max": 0.0}

    @cache
    def span(v: str) -> tuple[int, int]:
        lo, hi = 10**9, -1
        for w in succ[v]:
            if w == coordinator:
                lo, hi = min(lo, 0), max(hi, 0)
            else:
                a, b = span(w)
                lo, hi = min(lo, a + 1), max(hi, b + 1)
        return lo, hi

    lo, hi = 10**9, -1
    for w in succ[coordinator]:
        a, b = span(w)
        lo, hi = min(lo, a + 1), max(hi, b + 1)
    return {"min": float(lo), "mean": sum(through.values()) / total, "max": float(hi)}


def kv_tokens_per_layer(cluster: ClusterSpec, profiles: ProfileSet, placement: Placement) -> list[float] | None:
    """Tokens of KV each layer's holders can keep, per layer (None if a GPU has no KV profile)."""
    num = profiles.models[cluster.model].num_layers
    per_layer = [0.0] * num
    gpu = {n.id: n.gpu for n in cluster.nodes}
    for node, (s, e) in placement.items():
        kv = profiles.throughput(gpu[node], cluster.model).kv_tokens_per_layer(e - s)
        if kv is None:
            return None
        for layer in range(s, e):
            per_layer[layer] += kv
    return per_layer


def placement_stats(
    cluster: ClusterSpec, profiles: ProfileSet, placement: Placement, flows: list[FlowEdge]
) -> dict[str, float]:
    """The numbers the CLI and the bench print beside the max flow."""
    depth = pipeline_depths(flows, cluster.coordinator.id)
    out = {"depth_min": depth["min"], "depth_mean": depth["mean"], "depth_max": depth["max"]}
    kv = kv_tokens_per_layer(cluster, profiles, placement)
    if kv is not None:
        out["kv_tokens_min_layer"] = min(kv)
    return out
