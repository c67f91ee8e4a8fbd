"""The request paths the serving model (``planner.serving_model``) prices on one placement.

* :func:`decompose` — the plan's flows as source->sink paths, each with the flow it carries (the
  router splits requests over them in that proportion);
* :func:`fastest_paths` — for every node, the lowest-latency source->sink path through it (the
  ``routing="free"`` variant offers them to the LP too);
* :class:`Routes` — the paths with what the estimate reads of them: the layers each node runs on
  a path (fewer than it holds after a partial hand-off), which paths cross each node and hop, the
  layer segments with their KV, and how forks split the convoys requests move in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from helix.domain import Placement
from planner.capacity import CapacityModel
from planner.graph import hands_off

MAX_PATHS = 400

Segment = tuple[int, int]  # layers [a, b) held by the same nodes


@dataclass(slots=True)
class Routes:
    """The paths requests take through one placement, and what the estimate reads of them."""

    placement: Placement
    paths: list[list[str]]
    weights: list[float]  # the flow each decomposed path carries (the router's split)
    runs: list[list[int]]  # per path, the layers each of its nodes runs
    through: dict[str, list[int]]  # node -> the paths through it
    over: dict[tuple[str, str], list[int]]  # hop (the coordinator's included) -> the paths over it
    last: dict[str, bool]  # the node holds the model's last layer (pays the profile's head_ms)
    segments: list[tuple[Segment, list[str]]]  # layer segments with their holders
    layer_kv: dict[Segment, float]  # KV entries per layer of a segment, summed over its holders
    convoy_share: dict[str, float]  # see convoy_shape
    convoy_width: float

    @classmethod
    def build(cls, cap: CapacityModel, placement: Placement, flows: dict[tuple[str, str], float],
              paths: list[list[str]], weights: list[float]) -> Routes:
        coord = cap.coordinator
        through: dict[str, list[int]] = {}
        over: dict[tuple[str, str], list[int]] = {}
        for j, p in enumerate(paths):
            for n in p:
                through.setdefault(n, []).append(j)
            for link in zip([coord, *p], [*p, coord], strict=True):
                over.setdefault(link, []).append(j)
        segments, layer_kv = layer_segments(cap, placement)
        share, width = convoy_shape(flows)
        return cls(placement, paths, weights, [layers_run(placement, p) for p in paths], through, over,
                   {n: e == cap.num_layers for n, (_, e) in placement.items()}, segments, layer_kv, share, width)


def decompose(flows: dict[tuple[str, str], float], coord: str) -> list[tuple[list[str], float]]:
    """Source->sink paths (node lists) carrying ``flows``, widest hop first, at most :data:`MAX_PATHS`."""
    # rounded, and ties broken by name, so the paths do not depend on float noise in the flows
    rest = {e: round(f, 3) for e, f in flows.items() if f > 1e-3}
    out_edges: dict[str, list[str]] = {}
    for a, b in rest:
        out_edges.setdefault(a, []).append(b)
    paths: list[tuple[list[str], float]] = []
    while len(paths) < MAX_PATHS:
        v, amount = coord, float("inf")
        path: list[str] = []
        steps = 0
        while True:
            nxt = [w for w in out_edges.get(v, []) if rest.get((v, w), 0.0) > 1e-6]
            if not nxt or steps > 10_000:
                path = []
                break
            w = max(nxt, key=lambda cand: (rest[(v, cand)], cand))  # noqa: B023 - used at once
            amount = min(amount, rest[(v, w)])
            steps += 1
            if w == coord:
                break
            path.append(w)
            v = w
        if not path:
            break
        prev = coord
        for node in [*path, coord]:
            rest[(prev, node)] -= amount
            prev = node
        paths.append((path, amount))
    return paths


def layers_run(placement: Placement, path: list[str]) -> list[int]:
    """The layers each node of ``path`` runs: from where the previous node stopped to its end."""
    out, done = [], 0
    for node in path:
        s, e = placement[node]
        out.append(e - max(s, done))
        done = e
    return out


def fastest_paths(cap: CapacityModel, placement: Placement, node_s: dict[str, float],
                  link_s: Callable[[str, str], float]) -> list[list[str]]:
    """For every node, the lowest-latency source->sink path through it (DP on the DAG), a node
    costing ``node_s[node]`` and a hop ``link_s(a, b)`` seconds."""
    coord, L, cost = cap.coordinator, cap.num_layers, node_s
    order = sorted(placement, key=lambda n: placement[n][1])
    fwd: dict[str, tuple[float, str | None]] = {}
    for n in order:
        s, e = placement[n]
        best: tuple[float, str | None] = (float("inf"), None)
        if s == 0 and cap.link_latency_ms(coord, n) is not None:
            best = (link_s(coord, n), None)
        for m in order:
            if placement[m][1] >= e:
                break
            if m in fwd and hands_off(placement[m], placement[n], True) and cap.link_latency_ms(m, n) is not None:
                c = fwd[m][0] + cost[m] + link_s(m, n)
                if c < best[0]:
                    best = (c, m)
        if best[0] < float("inf"):
            fwd[n] = best
    bwd: dict[str, tuple[float, str | None]] = {}
    for n in reversed(order):
        s, e = placement[n]
        best = (float("inf"), None)
        if e == L and cap.link_latency_ms(n, coord) is not None:
            best = (link_s(n, coord) + cost[n], None)
        for m in order:
            if m in bwd and hands_off(placement[n], placement[m], True) and cap.link_latency_ms(n, m) is not None:
                c = bwd[m][0] + cost[n] + link_s(n, m)
                if c < best[0]:
                    best = (c, m)
        if best[0] < float("inf"):
            bwd[n] = best
    paths: list[list[str]] = []
    for n in placement:
        if n not in fwd or n not in bwd:
            continue
        head: list[str] = []
        v: str | None = fwd[n][1]
        while v is not None:
            head.append(v)
            v = fwd[v][1]
        tail: list[str] = []
        v = bwd[n][1]
        while v is not None:
            tail.append(v)
            v = bwd[v][1]
        p = [*reversed(head), n, *tail]
        if p not in paths:
            paths.append(p)
    return paths


def convoy_shape(flows: dict[tuple[str, str], float]) -> tuple[dict[str, float], float]:
    """How the flows split convoys at forks: ``width``, the largest participation ratio
    ``(sum f)^2 / sum f^2`` of any vertex's out-flows, the coordinator's included (3 for a node
    feeding three parallel nodes equally, ~1 where one next hop carries nearly all), and per
    node ``min(1, width x its largest share of a predecessor's out-flow)``: 1 for a node of an
    even split, less for one that gets a small part of every convoy."""
    out: dict[str, list[tuple[str, float]]] = {}
    for (src, dst), f in flows.items():
        if f > 0:
            out.setdefault(src, []).append((dst, f))
    width = 1.0
    share: dict[str, float] = {}
    for hops in out.values():
        total = sum(f for _, f in hops)
        width = max(width, total * total / sum(f * f for _, f in hops))
        for dst, f in hops:
            share[dst] = max(share.get(dst, 0.0), f / total)
    return {n: min(1.0, width * x) for n, x in share.items()}, width


def layer_segments(cap: CapacityModel,
                   placement: Placement) -> tuple[list[tuple[Segment, list[str]]], dict[Segment, float]]:
    """The placement's layers cut at every range boundary, each with the nodes holding it, and KV
    entries per layer of each (summed over the holders, each node's KV spread evenly over its
    layers, as ``router.kv`` counts it)."""
    cuts = sorted({x for s, e in placement.values() for x in (s, e)})
    segments = [((a, b), [n for n, (s, e) in placement.items() if s <= a and e >= b])
                for a, b in zip(cuts, cuts[1:], strict=False)]  # fmt: skip
    kv: dict[Segment, float] = {}
    for seg, holders in segments:
        total = 0.0
        for n in holders:
            s, e = placement[n]
            total += cap.kind(n).kv_entries[e - s - 1] / (e - s)
        kv[seg] = total
    return segments, kv
