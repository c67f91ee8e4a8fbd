"""Region chains: stage plans for geo-distributed clusters, where the slow links between regions bind.

A node pair joined by a 0.1 Gbit/s link carries about 763 activation tokens/s (LLaMA-2 70B), a third of
what one A100 holding 8 layers computes. A placement whose requests hop between regions at every stage
is then limited by the few node pairs that meet at each crossing. A *region chain* visits each region it
uses once, as one block of stages held by that region's nodes: it crosses the slow links as few times as
the regions it needs, and at every crossing it puts groups of nodes on both sides, so that enough node
pairs (``exit nodes x entry nodes x link``) carry the flow.

For a target flow F (:func:`chains_at`):

1. per region and (entry size, exit size), its best block of stages (``planner.region_blocks``: groups of
   its nodes, each stage reaching F, the most layers);
2. over every order of every subset of regions (a DP over subsets, last region and its block), the chain
   whose crossings all carry F: from the coordinator into the first entry group, from every exit group into
   the next entry group (``exit nodes x entry nodes x link``, each node at most its own capacity) and back
   to the coordinator, each also capped by the regions' shared uplinks where the cluster has them (a region
   pair's link: its slowest node pair's). A chain is feasible when its blocks hold at
   least L layers. Of the orders of one subset that are feasible, the chain takes the one with the least
   link latency from the coordinator through its regions and back (the max flow does not care; requests do).

:func:`chain_candidates` bisects F and turns the feasible chains into placements (:func:`to_placement`):
layers beyond L are taken from the weakest stages (raising their capacity), unused nodes join the weakest
stage they can hold, of their own region first. :func:`parallel_candidates` puts separate chains on disjoint
sets of regions side by side (fewer crossings per request). The caller scores each exactly
(``planner.graph``); the model here only proposes (within a region it assumes the links are fast).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from helix.domain import LayerRange, Placement
from helix.units import link_tokens_per_s
from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.graph import max_flow_value
from planner.region_blocks import Block, RegionNodes, Tile, region_blocks

MAX_CHAINS = 4  # chains built per target flow (the best per region subset)
SHALLOW_TARGETS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)  # serving: shallow chains at these shares of the best target
MAX_ORDERED_REGIONS = 5  # a chain of at most this many regions takes the order of least link latency
MAX_PARALLEL_REGIONS = 5  # separate chains side by side only on clusters of at most this many regions


@dataclass(frozen=True, slots=True)
class ChainStage:
    """One stage of a chain: ``layers`` consecutive layers held by ``members`` (kind -> nodes) of ``region``."""

    region: str | None
    members: tuple[tuple[str, int], ...]
    layers: int
    rails: tuple[tuple[str, int], ...] = ()  # staggered strips (kind, strip length): planner.region_blocks.Tile


@dataclass(frozen=True, slots=True)
class Chain:
    """A region chain at a target flow: its stages in pipeline order and the layers they can hold (>= L)."""

    flow: float
    stages: tuple[ChainStage, ...]
    layers: int

    @property
    def regions(self) -> tuple[str | None, ...]:
        out: list[str | None] = []
        for st in self.stages:
            if not out or out[-1] != st.region:
                out.append(st.region)
        return tuple(out)


# -- links between regions ------------------------------------------------------------------------


def _pair_tok_s(cap: CapacityModel, src: list[str], dst: list[str], *, tokens: bool) -> float:
    """The slowest link from any of ``src`` to any of ``dst`` in tokens/s (0 when one is missing)."""
    worst = math.inf
    for a in src:
        for b in dst:
            if a == b:
                continue
            got = cap.token_link_tok_s(a, b) if tokens else cap.activation_link_tok_s(a, b)
            worst = min(worst, got or 0.0)
    return 0.0 if worst == math.inf else worst


def _shared_tok_s(cap: CapacityModel, src: str | None, dst: str | None, nbytes: int) -> float:
    """What the shared uplink of ``src``'s region and downlink of ``dst``'s carry, in tokens/s (inf: none;
    traffic between the same region, or to or from no region, crosses none: ``CapacityModel.crosses_regions``)."""
    if src is None or dst is None or src == dst:
        return math.inf
    got = math.inf
    for gbps in (cap.region_uplink_gbps.get(src), cap.region_downlink_gbps.get(dst)):
        if gbps is not None:
            got = min(got, link_tokens_per_s(gbps, nbytes))
    return got


@dataclass(slots=True)
class _Links:
    """Per region pair, the per-node-pair link (tokens/s) and the shared cap of one crossing."""

    pair: list[list[float]]  # activations, region i -> region j
    shared: list[list[float]]
    from_coord: list[float]  # token ids, per node pair; and the shared cap
    from_coord_shared: list[float]
    to_coord: list[float]
    to_coord_shared: list[float]
    latency_ms: list[list[float]]  # mean over node pairs, region i -> region j
    from_coord_ms: list[float]
    to_coord_ms: list[float]

    @classmethod
    def build(cls, cap: CapacityModel, regions: list[str | None]) -> _Links:
        members = {r: [n for n in cap.nodes if cap.region_of[n] == r] for r in regions}
        coord = [cap.coordinator]
        creg = cap.coordinator_region
        return cls(
            pair=[[_pair_tok_s(cap, members[a], members[b], tokens=False) for b in regions] for a in regions],
            shared=[[_shared_tok_s(cap, a, b, cap.activation_bytes) for b in regions] for a in regions],
            from_coord=[_pair_tok_s(cap, coord, members[r], tokens=True) for r in regions],
            from_coord_shared=[_shared_tok_s(cap, creg, r, cap.token_bytes) for r in regions],
            to_coord=[_pair_tok_s(cap, members[r], coord, tokens=True) for r in regions],
            to_coord_shared=[_shared_tok_s(cap, r, creg, cap.token_bytes) for r in regions],
            latency_ms=[[_mean_latency_ms(cap, members[a], members[b]) for b in regions] for a in regions],
            from_coord_ms=[_mean_latency_ms(cap, coord, members[r]) for r in regions],
            to_coord_ms=[_mean_latency_ms(cap, members[r], coord) for r in regions],
        )

    def into(self, r: int, entry: tuple[float, ...]) -> float:
        """Tokens/s the coordinator's links into region ``r``'s entry group (nodes' capacities) carry."""
        return min(sum(min(c, self.from_coord[r]) for c in entry), self.from_coord_shared[r])

    def out_of(self, r: int, exit_: tuple[float, ...]) -> float:
        """Tokens/s region ``r``'s exit group passes back to the coordinator."""
        return min(sum(min(c, self.to_coord[r]) for c in exit_), self.to_coord_shared[r])

    def across(self, r: int, r2: int, exit_: tuple[float, ...], entry: tuple[float, ...]) -> float:
        """Tokens/s from region ``r``'s exit group to ``r2``'s entry group: every pair's link, each node at most
        its own capacity, the shared uplinks (each side's nodes against all the other side's links)."""
        bw = self.pair[r][r2]
        return min(sum(min(c, len(exit_) * bw) for c in entry), sum(min(c, len(entry) * bw) for c in exit_),
                   self.shared[r][r2])

    def latency(self, order: tuple[int, ...]) -> float:
        """A request's link latency along a chain of regions (coordinator to coordinator)."""
        hops = sum(self.latency_ms[a][b] for a, b in zip(order, order[1:], strict=False))
        return self.from_coord_ms[order[0]] + hops + self.to_coord_ms[order[-1]]


def _mean_latency_ms(cap: CapacityModel, src: list[str], dst: list[str]) -> float:
    got = [cap.latency_ms.get((a, b), 0.0) for a in src for b in dst if a != b]
    return sum(got) / len(got) if got else 0.0


# -- chains -----------------------------------------------------------------------------------------


def chains_at(cap: CapacityModel, flow: float, *, links: _Links | None = None, regions: list[RegionNodes] | None = None,
              limit: int = MAX_CHAINS) -> list[Chain]:
    """The feasible region chains at ``flow`` (module docstring): the best per region subset, fewest regions
    first, then most layers; at most ``limit``."""
    regions = regions if regions is not None else [RegionNodes(cap, r) for r in cap.regions()]
    links = links if links is not None else _Links.build(cap, [r.name for r in regions])
    blocks = [region_blocks(r, flow) for r in regions]
    ok = flow - 1e-9
    # state (mask, last region, its block) -> (layers, previous state)
    State = tuple[int, int, int]
    table: dict[State, tuple[int, State | None]] = {}
    for r, bl in enumerate(blocks):
        for j, b in enumerate(bl):
            if links.into(r, b.entry_caps) >= ok:
                table[(1 << r, r, j)] = (b.layers, None)
    for mask in range(1, 1 << len(regions)):
        for (m, r, j), (layers, _) in [(k, v) for k, v in table.items() if k[0] == mask]:
            out = blocks[r][j].exit_caps
            for r2, bl in enumerate(blocks):
                if mask & (1 << r2):
                    continue
                for j2, b in enumerate(bl):
                    key = (m | (1 << r2), r2, j2)
                    if layers + b.layers > table.get(key, (-1,))[0] and links.across(r, r2, out, b.entry_caps) >= ok:
                        table[key] = (layers + b.layers, (m, r, j))
    finals: dict[int, tuple[int, State]] = {}  # mask -> best feasible end state
    for key, (layers, _) in table.items():
        mask, r, j = key
        if layers >= cap.num_layers and links.out_of(r, blocks[r][j].exit_caps) >= ok:
            if layers > finals.get(mask, (-1,))[0]:
                finals[mask] = (layers, key)
    ranked = sorted(finals.values(), key=lambda v: (bin(v[1][0]).count("1"), -v[0], v[1]))[:limit]
    chains = []
    for layers, key in ranked:
        picks: list[tuple[int, Block]] = []
        state: State | None = key
        while state is not None:
            picks.insert(0, (state[1], blocks[state[1]][state[2]]))
            state = table[state][1]
        members = tuple(r for r, _ in picks)
        if len(members) <= MAX_ORDERED_REGIONS:  # the same regions in the order of least latency
            orders = (_along(order, blocks, links, ok) for order in itertools.permutations(members))
            feasible = [got for got in orders if got is not None and got[0] >= cap.num_layers]
            layers, picks = min(feasible, key=lambda g: (links.latency(tuple(r for r, _ in g[1])), -g[0]))
        stages = [_stage(regions[r], t) for r, block in picks for t in block.tiles]
        chains.append(Chain(flow, tuple(stages), layers))
    return chains


def _stage(region: RegionNodes, tile: Tile) -> ChainStage:
    return ChainStage(region.name, tuple((region.kinds[i], c) for i, c in enumerate(tile.counts) if c), tile.layers,
                      tuple((region.kinds[i], k) for i, k in tile.rails))


def _along(order: tuple[int, ...], blocks: list[list[Block]], links: _Links,
           ok: float) -> tuple[int, list[tuple[int, Block]]] | None:
    """The most layers a chain through the regions ``order`` holds with every crossing carrying ``ok``
    (and its blocks), None when no choice of blocks lets it."""
    first, last = order[0], order[-1]
    cur: list[tuple[int, list[tuple[int, Block]]]] = [  # per block of the last region: (layers, blocks so far)
        (b.layers, [(first, b)]) if links.into(first, b.entry_caps) >= ok else (-1, []) for b in blocks[first]]
    for r, r2 in zip(order, order[1:], strict=False):
        nxt: list[tuple[int, list[tuple[int, Block]]]] = [(-1, []) for _ in blocks[r2]]
        for layers, picks in cur:
            if layers < 0:
                continue
            for j2, b in enumerate(blocks[r2]):
                if layers + b.layers > nxt[j2][0] and links.across(r, r2, picks[-1][1].exit_caps, b.entry_caps) >= ok:
                    nxt[j2] = (layers + b.layers, [*picks, (r2, b)])
        cur = nxt
    ends = [got for got in cur if got[0] >= 0 and links.out_of(last, got[1][-1][1].exit_caps) >= ok]
    return max(ends, key=lambda g: g[0], default=None)


def to_placement(cap: CapacityModel, chain: Chain, *, shallow: bool = False) -> Placement:
    """Node ranges for a chain: the layers beyond L come off the weakest stages, one at a time; every
    node the chain leaves out joins the weakest stage that it can hold (its own region's first).
    ``shallow``: first drop whole inner stages (neither end of a region's block), the shortest first,
    while the layers beyond L allow it; their nodes join other stages (a shorter pipeline). Staggered
    tiles keep their width and take no leftovers."""
    free = {t: list(v) for t, v in cap.kind_nodes.items()}

    def take(kind: str, count: int, region: str | None) -> list[str]:
        got = [n for n in free[kind] if cap.region_of[n] == region][:count]
        for n in got:
            free[kind].remove(n)
        return got

    stages = list(chain.stages)
    groups = [[n for kind, k in st.rails for n in take(kind, st.layers // k, st.region)] if st.rails
              else [n for kind, count in st.members for n in take(kind, count, st.region)] for st in stages]
    layers = [st.layers for st in stages]
    if shallow:
        regions = [st.region for st in stages]
        inner = [j for j in range(1, len(regions) - 1) if regions[j - 1] == regions[j] == regions[j + 1]]
        surplus = sum(layers) - cap.num_layers
        for j in sorted(inner, key=lambda j: (layers[j], j)):
            if layers[j] <= surplus:
                surplus -= layers[j]
                for n in groups[j]:
                    free[cap.kind_of[n]].append(n)
                groups[j], layers[j] = [], 0
        keep = [j for j in range(len(layers)) if layers[j]]
        stages, groups, layers = [stages[j] for j in keep], [groups[j] for j in keep], [layers[j] for j in keep]

    def capacity(j: int) -> float:
        return sum(cap.node_capacity(n, layers[j]) for n in groups[j])

    plain = [j for j, st in enumerate(stages) if not st.rails]
    for _ in range(sum(layers) - cap.num_layers):
        trim = [j for j in plain if layers[j] > 1]
        if not trim:
            break  # what is left over is cut off the end below
        layers[min(trim, key=capacity)] -= 1
    left = sorted((n for v in free.values() for n in v), key=lambda n: (-cap.node_capacity(n, 1), cap.nodes.index(n)))
    for n in left:
        fits = [j for j in plain if layers[j] <= cap.max_layers[n]]
        own = [j for j in fits if stages[j].region == cap.region_of[n]]
        if fits:
            groups[min(own or fits, key=capacity)].append(n)
    placement: Placement = {}
    start = 0
    for st, group, m in zip(stages, groups, layers, strict=True):
        if st.rails:
            nodes = iter(group)
            for _, k in st.rails:
                for a in range(start, start + m, k):
                    placement[next(nodes)] = LayerRange(a, a + k)
        else:
            for n in group:
                placement[n] = LayerRange(start, start + m)
        start += m
    return {n: LayerRange(r.start, min(r.end, cap.num_layers)) for n, r in placement.items() if r.start < cap.num_layers}


def chain_candidates(cap: CapacityModel, *, deadline: Deadline, lo: float, hi: float, rel_tol: float = 1e-3,
                     serving: bool = False) -> list[Placement]:
    """Placements of the best chains found by bisection on the target flow in ``[lo, hi]`` (the chains of
    every feasible target tried, best target first). ``serving``: shallow chains (:func:`to_placement`) at
    :data:`SHALLOW_TARGETS` of the best target first, then the best chain of every feasible target."""
    regions = [RegionNodes(cap, r) for r in cap.regions()]
    links = _Links.build(cap, [r.name for r in regions])
    found: list[tuple[float, list[Chain]]] = []
    while hi - lo > rel_tol * max(hi, 1.0) and not deadline.expired():
        mid = (lo + hi) / 2
        got = chains_at(cap, mid, links=links, regions=regions)
        if got:
            found.append((mid, got))
            lo = mid
        else:
            hi = mid
    out: list[Placement] = []
    if serving and found:
        top = max(f for f, _ in found)
        for share in SHALLOW_TARGETS:
            if deadline.expired():
                break
            got = chains_at(cap, share * top, links=links, regions=regions, limit=1)
            if got:
                out.append(to_placement(cap, got[0], shallow=True))
    for _, chains in sorted(found, key=lambda f: -f[0]):
        out.extend(to_placement(cap, c) for c in (chains[:1] if serving else chains))
    return out


def parallel_candidates(cap: CapacityModel, *, deadline: Deadline, serving: bool = False,
                        limit: int = 3) -> list[Placement]:
    """Separate chains on disjoint sets of regions, side by side (each request runs one of them): every
    subset of the regions that can hold the model gets its best chain (:func:`chain_candidates` on its
    nodes; ``serving``: its shallow one), and the ``limit`` packings of two or more disjoint subsets with the
    highest summed max flow are joined into placements (``serving``: also the packing of the most chains).
    A request then crosses fewer regions; nodes of regions outside a packing stay idle."""
    names = cap.regions()
    if not 2 <= len(names) <= MAX_PARALLEL_REGIONS:
        return []
    best: dict[frozenset[str | None], tuple[float, Placement]] = {}
    for k in range(1, len(names)):
        for subset in itertools.combinations(names, k):
            if deadline.expired():
                break
            sub = cap.subset([n for n in cap.nodes if cap.region_of[n] in subset])
            if sum(sub.max_layers.values()) < cap.num_layers:
                continue
            hi = sum(max((k + 1) * t for k, t in enumerate(sub.node_tok_s[n])) for n in sub.nodes) / cap.num_layers
            got = chain_candidates(sub, deadline=deadline, lo=0.0, hi=hi, serving=serving)
            if got:
                best[frozenset(subset)] = (max_flow_value(sub, got[0]), got[0])
    packings: list[list[frozenset[str | None]]] = []

    def pack(chosen: list[frozenset[str | None]], used: frozenset[str | None], rest: list[frozenset[str | None]]) -> None:
        if len(chosen) >= 2:
            packings.append(list(chosen))
        for i, s in enumerate(rest):
            if not s & used:
                pack([*chosen, s], used | s, rest[i + 1:])

    pack([], frozenset(), sorted(best, key=lambda s: sorted(str(r) for r in s)))
    ranked = sorted(packings, key=lambda p: -sum(best[s][0] for s in p))
    picked = ranked[:limit]
    if serving and ranked:
        most = max(ranked, key=lambda p: (len(p), sum(best[s][0] for s in p)))
        if most not in picked:
            picked.append(most)
    return [{n: r for s in p for n, r in best[s][1].items()} for p in picked]
