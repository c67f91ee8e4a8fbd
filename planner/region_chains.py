"""Region chains: stage plans for geo-distributed clusters, where the slow links between regions bind.

A node pair joined by a 0.1 Gbit/s link carries about 763 activation tokens/s (LLaMA-2 70B), a third of
what one A100 holding 8 layers computes. A placement whose requests hop between regions at every stage
is then limited by the few node pairs that meet at each crossing. A *region chain* visits each region it
uses once, as one block of stages held by that region's nodes: it crosses the slow links as few times as
the regions it needs, and at every crossing it puts groups of nodes on both sides, so that enough node
pairs (``exit nodes x entry nodes x link``) carry the flow.

For a target flow F (:func:`chains_at`):

1. per region, every *group* (how many nodes of each of the region's kinds) gets its longest stage
   ``m*(c) = max{m : sum_t c_t T_t(m) >= F}``; a knapsack over the region's node counts (numpy, one array
   axis per kind) gives the most layers its inner stages can hold with any subset of its nodes;
2. per region and every (entry group, exit group) of at most two kinds and a few nodes: the most layers of
   a block that starts with the entry group and ends with the exit group (one group alone is a block too);
3. over every order of every subset of regions (a DP over subsets, last region and exit size), the chain
   whose crossings all carry F: ``a_1 x coordinator link``, ``b_i x a_(i+1) x link(r_i, r_(i+1))`` and
   ``b_k x link to the coordinator``, each also capped by the regions' shared uplinks where the cluster has
   them (a region pair's link: its slowest node pair's). A chain is feasible when its blocks hold at
   least L layers.

:func:`chain_candidates` bisects F and turns the feasible chains into placements (:func:`to_placement`):
layers beyond L are taken from the weakest stages (raising their capacity), unused nodes join the weakest
stage they can hold, of their own region first. The caller scores each exactly (``planner.graph``); the
model here only proposes (within a region it assumes the links are fast).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from helix.domain import LayerRange, Placement
from helix.units import link_tokens_per_s
from planner.budget import Deadline
from planner.capacity import CapacityModel

MAX_BOUNDARY_NODES = 8  # the largest entry/exit group considered
MAX_INNER_GROUPS = 400  # the knapsack's groups per region (the smallest that reach F, shortest stage last)
MAX_CHAINS = 4  # chains built per target flow (the best per region subset)


@dataclass(frozen=True, slots=True)
class ChainStage:
    """One stage of a chain: ``layers`` consecutive layers held by ``members`` (kind -> nodes) of ``region``."""

    region: str | None
    members: tuple[tuple[str, int], ...]
    layers: int


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


Vec = tuple[int, ...]


@dataclass(slots=True)
class _Block:
    """A region's block for one (entry size, exit size): its layers and groups (entry, inner..., exit)."""

    entry: int
    exit: int
    layers: int
    groups: list[tuple[Vec, int]]


class _Region:
    """One region's nodes as kind counts, and its groups' longest stages at a target flow."""

    def __init__(self, cap: CapacityModel, name: str | None) -> None:
        self.name = name
        nodes = [n for n in cap.nodes if cap.region_of[n] == name]
        self.kinds = sorted({cap.kind_of[n] for n in nodes})
        self.counts: Vec = tuple(sum(1 for n in nodes if cap.kind_of[n] == t) for t in self.kinds)
        self.tables = [cap.kinds[t].tok_s for t in self.kinds]  # tok_s[m-1], up to the kind's layer cap

    def longest(self, group: Vec, flow: float) -> int:
        """``m*``: the most layers ``group`` can hold as one stage of capacity >= ``flow`` (0: none)."""
        top = min((len(self.tables[i]) for i, c in enumerate(group) if c), default=0)
        best = 0
        for m in range(1, top + 1):
            if sum(c * self.tables[i][m - 1] for i, c in enumerate(group) if c) >= flow - 1e-9:
                best = m
            else:
                break
        return best

    def inner_groups(self, flow: float) -> list[tuple[Vec, int]]:
        """Minimal groups (one node fewer of any kind holds fewer layers) with their longest stage."""
        out: list[tuple[Vec, int]] = []
        k = len(self.kinds)
        for m in range(1, max(len(t) for t in self.tables) + 1):
            able = [i for i in range(k) if len(self.tables[i]) >= m]
            for group in _groups_reaching(self, able, m, flow):
                got = self.longest(group, flow)
                if got == m and all(self.longest(_minus_one(group, i), flow) < m for i in range(k) if group[i]):
                    out.append((group, m))
                if len(out) >= MAX_INNER_GROUPS:
                    return out
        return out

    def boundary_groups(self, flow: float, most: int) -> list[tuple[Vec, int]]:
        """Groups of at most two kinds and ``most`` nodes that hold >= 1 layer at ``flow``."""
        k = len(self.kinds)
        seen: dict[Vec, int] = {}
        for i, j in itertools.combinations_with_replacement(range(k), 2):
            for ci in range(0, min(most, self.counts[i]) + 1):
                for cj in range(0, min(most - ci, self.counts[j]) + 1) if j != i else (0,):
                    if ci + cj == 0:
                        continue
                    group = [0] * k
                    group[i] += ci
                    group[j] += cj
                    g = tuple(group)
                    if g not in seen:
                        m = self.longest(g, flow)
                        if m:
                            seen[g] = m
        return list(seen.items())


def _minus_one(group: Vec, i: int) -> Vec:
    return tuple(c - 1 if j == i else c for j, c in enumerate(group))


def _groups_reaching(region: _Region, able: list[int], m: int, flow: float) -> list[Vec]:
    """Groups of the kinds ``able`` (within the region's counts) whose capacity at ``m`` layers first
    reaches ``flow`` when nodes are added in kind order (the candidates for minimal groups)."""
    k = len(region.kinds)
    heights = {i: region.tables[i][m - 1] for i in able}
    out: list[Vec] = []
    cur = [0] * k

    def rec(pos: int, total: float) -> None:
        if total >= flow - 1e-9:
            out.append(tuple(cur))
            return
        if len(out) >= MAX_INNER_GROUPS:
            return
        if total + sum(heights[i] * (region.counts[i] - cur[i]) for i in able[pos:]) < flow - 1e-9:
            return
        for p in range(pos, len(able)):
            i = able[p]
            if cur[i] < region.counts[i]:
                cur[i] += 1
                rec(p, total + heights[i])
                cur[i] -= 1

    rec(0, 0.0)
    return out


def _knapsack(counts: Vec, items: list[tuple[Vec, int]]) -> np.ndarray:
    """``dp[v]``: the most layers stages of ``items`` (group, layers; any number of each) hold with at most
    ``v`` nodes of each kind."""
    dp = np.zeros(tuple(c + 1 for c in counts), dtype=np.int32)
    for group, m in items:
        copies = min(counts[i] // c for i, c in enumerate(group) if c)
        src = tuple(slice(0, n + 1 - c) for n, c in zip(counts, group, strict=True))
        dst = tuple(slice(c, n + 1) for n, c in zip(counts, group, strict=True))
        for _ in range(copies):
            grown = np.maximum(dp[dst], dp[src] + m)
            if np.array_equal(grown, dp[dst]):
                break
            dp[dst] = grown
    return dp


def _unpack(dp: np.ndarray, items: list[tuple[Vec, int]], v: Vec) -> list[tuple[Vec, int]]:
    """The groups of a knapsack optimum at ``v`` (backtracking ``dp``)."""
    out: list[tuple[Vec, int]] = []
    while dp[v] > 0:
        for group, m in items:
            rest = tuple(a - b for a, b in zip(v, group, strict=True))
            if min(rest) >= 0 and dp[rest] + m == dp[v]:
                out.append((group, m))
                v = rest
                break
        else:  # unreachable: the optimum's last group always matches
            raise AssertionError("knapsack backtrack found no group")
    return out


def _blocks(region: _Region, flow: float, most: int) -> list[_Block]:
    """The region's best block per (entry size, exit size), dominated ones dropped."""
    inner = region.inner_groups(flow)
    dp = _knapsack(region.counts, inner) if inner else None
    ends = region.boundary_groups(flow, most)
    best: dict[tuple[int, int], tuple[int, Vec, Vec | None]] = {}

    def offer(a: int, b: int, layers: int, e: Vec, x: Vec | None) -> None:
        if layers > best.get((a, b), (0,))[0]:
            best[(a, b)] = (layers, e, x)

    for e, me in ends:
        offer(sum(e), sum(e), me, e, None)
        for x, mx in ends:
            rest = tuple(n - p - q for n, p, q in zip(region.counts, e, x, strict=True))
            if min(rest) < 0:
                continue
            offer(sum(e), sum(x), me + mx + (int(dp[rest]) if dp is not None else 0), e, x)
    out: list[_Block] = []
    for (a, b), (layers, first, last) in best.items():
        if any(a2 >= a and b2 >= b and l2 >= layers and (a2, b2) != (a, b) for (a2, b2), (l2, _, _) in best.items()):
            continue
        groups = [(first, region.longest(first, flow))]
        if last is not None:
            rest = tuple(n - p - q for n, p, q in zip(region.counts, first, last, strict=True))
            groups += _unpack(dp, inner, rest) if dp is not None else []
            groups.append((last, region.longest(last, flow)))
        out.append(_Block(a, b, layers, groups))
    return out


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
    """What the shared uplink of ``src``'s region and downlink of ``dst``'s carry, in tokens/s (inf: none)."""
    if src == dst:
        return math.inf
    got = math.inf
    up = getattr(cap, "region_uplink_gbps", {}) or {}
    down = getattr(cap, "region_downlink_gbps", {}) or {}
    for gbps in (up.get(src or ""), down.get(dst or "")):
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

    @classmethod
    def build(cls, cap: CapacityModel, regions: list[str | None]) -> _Links:
        members = {r: [n for n in cap.nodes if cap.region_of[n] == r] for r in regions}
        coord = [cap.coordinator]
        creg = getattr(cap, "coordinator_region", None)
        return cls(
            pair=[[_pair_tok_s(cap, members[a], members[b], tokens=False) for b in regions] for a in regions],
            shared=[[_shared_tok_s(cap, a, b, cap.activation_bytes) for b in regions] for a in regions],
            from_coord=[_pair_tok_s(cap, coord, members[r], tokens=True) for r in regions],
            from_coord_shared=[_shared_tok_s(cap, creg, r, cap.token_bytes) for r in regions],
            to_coord=[_pair_tok_s(cap, members[r], coord, tokens=True) for r in regions],
            to_coord_shared=[_shared_tok_s(cap, r, creg, cap.token_bytes) for r in regions],
        )


# -- chains -----------------------------------------------------------------------------------------


def chains_at(cap: CapacityModel, flow: float, *, links: _Links | None = None, regions: list[_Region] | None = None,
              limit: int = MAX_CHAINS) -> list[Chain]:
    """The feasible region chains at ``flow`` (module docstring): the best per region subset, fewest regions
    first, then most layers; at most ``limit``."""
    regions = regions if regions is not None else [_Region(cap, r) for r in cap.regions()]
    links = links if links is not None else _Links.build(cap, [r.name for r in regions])
    most = MAX_BOUNDARY_NODES
    blocks = [_blocks(r, flow, most) for r in regions]
    ok = flow - 1e-9
    # state (mask, last region, exit size) -> (layers, previous state, block)
    State = tuple[int, int, int]
    table: dict[State, tuple[int, State | None, _Block]] = {}
    for r, bl in enumerate(blocks):
        for b in bl:
            if min(b.entry * links.from_coord[r], links.from_coord_shared[r]) >= ok:
                key = (1 << r, r, b.exit)
                if b.layers > table.get(key, (-1,))[0]:
                    table[key] = (b.layers, None, b)
    for mask in range(1, 1 << len(regions)):
        for (m, r, out), (layers, _, _) in [(k, v) for k, v in table.items() if k[0] == mask]:
            for r2, bl in enumerate(blocks):
                if mask & (1 << r2):
                    continue
                for b in bl:
                    if min(out * b.entry * links.pair[r][r2], links.shared[r][r2]) < ok:
                        continue
                    key = (m | (1 << r2), r2, b.exit)
                    if layers + b.layers > table.get(key, (-1,))[0]:
                        table[key] = (layers + b.layers, (m, r, out), b)
    finals: dict[int, tuple[int, State]] = {}  # mask -> best feasible end state
    for key, (layers, _, _) in table.items():
        mask, r, out = key
        if layers >= cap.num_layers and min(out * links.to_coord[r], links.to_coord_shared[r]) >= ok:
            if layers > finals.get(mask, (-1,))[0]:
                finals[mask] = (layers, key)
    ranked = sorted(finals.values(), key=lambda v: (bin(v[1][0]).count("1"), -v[0], v[1]))[:limit]
    chains = []
    for layers, key in ranked:
        stages: list[ChainStage] = []
        state: State | None = key
        while state is not None:
            _, prev, block = table[state]
            reg = regions[state[1]]
            stages[:0] = [ChainStage(reg.name, tuple((reg.kinds[i], c) for i, c in enumerate(g) if c), m)
                          for g, m in block.groups]
            state = prev
        chains.append(Chain(flow, tuple(stages), layers))
    return chains


def to_placement(cap: CapacityModel, chain: Chain) -> Placement:
    """Node ranges for a chain: the layers beyond L come off the weakest stages, one at a time; every
    node the chain leaves out joins the weakest stage that it can hold (its own region's first)."""
    free = {t: list(v) for t, v in cap.kind_nodes.items()}
    groups: list[list[str]] = []
    for st in chain.stages:
        group: list[str] = []
        for kind, count in st.members:
            pool = [n for n in free[kind] if cap.region_of[n] == st.region][:count]
            for n in pool:
                free[kind].remove(n)
            group.extend(pool)
        groups.append(group)
    layers = [st.layers for st in chain.stages]

    def capacity(j: int) -> float:
        return sum(cap.node_capacity(n, layers[j]) for n in groups[j])

    for _ in range(sum(layers) - cap.num_layers):
        j = min((j for j in range(len(layers)) if layers[j] > 1), key=capacity)
        layers[j] -= 1
    left = sorted((n for v in free.values() for n in v), key=lambda n: (-cap.node_capacity(n, 1), cap.nodes.index(n)))
    for n in left:
        fits = [j for j in range(len(layers)) if layers[j] <= cap.max_layers[n]]
        own = [j for j in fits if chain.stages[j].region == cap.region_of[n]]
        if fits:
            groups[min(own or fits, key=capacity)].append(n)
    placement: Placement = {}
    start = 0
    for group, m in zip(groups, layers, strict=True):
        for n in group:
            placement[n] = LayerRange(start, start + m)
        start += m
    return placement


def chain_candidates(cap: CapacityModel, *, deadline: Deadline, lo: float, hi: float,
                     rel_tol: float = 1e-3) -> list[Placement]:
    """Placements of the best chains found by bisection on the target flow in ``[lo, hi]`` (the chains of
    every feasible target tried, best target first)."""
    regions = [_Region(cap, r) for r in cap.regions()]
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
    for _, chains in sorted(found, key=lambda f: -f[0]):
        out.extend(to_placement(cap, c) for c in chains)
    return out
