"""A region's blocks of stages at a target flow (``planner.region_chains`` joins them into chains).

A *group* is how many nodes of each of a region's kinds hold one stage; at a target flow F its longest
stage is ``m*(c) = max{m : sum_t c_t T_t(m) >= F}``. A *block* (:class:`Block`) is the run of stages a
region holds in a chain: an entry group first (the nodes the previous region hands off to), an exit group
last (the nodes that hand off to the next), inner groups between. :func:`region_blocks` gives a region's
best block, the most layers, for every (entry size, exit size, balanced ends or not):

* the inner tiles (:class:`Tile`): the minimal groups (one node fewer of any kind holds fewer layers) and
  staggered pairs of rails (strips of two lengths side by side, boundaries apart: with partial hand-offs the
  network-free optimum often needs them, e.g. T4s holding 2 and 3 layers cover 1.2 layers a node where a
  T4 alone covers 1), packed by a knapsack over the region's node counts (numpy, one array axis per kind;
  any number of each tile);
* the entry and exit groups: at most two kinds and :data:`MAX_BOUNDARY_NODES` nodes, each as long as it can
  be and, where shorter, *balanced* (every node carries at least its share of F: a crossing then carries
  ``exit nodes x entry nodes x link``; a T4 holding 4 layers beside an L4 would cap its links at 758); a
  block may also be one group alone (its entry and exit); a block carries its end groups' node capacities
  (``planner.region_chains`` prices crossings with them);
* a block that another beats in entry size, exit size and layers at once is dropped (a balanced one only by
  a balanced one).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from planner.capacity import CapacityModel

MAX_BOUNDARY_NODES = 8  # the largest entry/exit group considered
MAX_INNER_GROUPS = 400  # the knapsack's groups per region (the smallest that reach F, shortest stage last)
MAX_TILE_LAYERS = 12  # the widest staggered tile (the least common multiple of its two strip lengths)

Vec = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Tile:
    """``layers`` consecutive layers of a block held by ``counts`` nodes (per kind of the region). No
    ``rails``: one group, every node holds all the layers (a stage). ``rails`` (kind index, strip length):
    staggered strips, each rail a run of single nodes of its kind each holding ``strip length`` layers, the
    rails' boundaries apart (a 2-layer rail beside a 3-layer one covers 6 layers with 5 nodes); every layer
    then gets one strip of every rail, and with partial hand-offs a request moves on through whichever
    holds its next layer."""

    counts: Vec
    layers: int
    rails: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class Block:
    """A region's block for one (entry size, exit size): its layers and tiles (entry group, inner..., exit group)."""

    entry: int
    exit: int
    layers: int
    tiles: list[Tile]
    entry_caps: tuple[float, ...]  # tokens/s of every node of the entry group and of the exit group
    exit_caps: tuple[float, ...]


class RegionNodes:
    """One region's nodes as kind counts, and its groups' longest stages at a target flow."""

    def __init__(self, cap: CapacityModel, name: str | None) -> None:
        self.name = name
        nodes = [n for n in cap.nodes if cap.region_of[n] == name]
        self.kinds = sorted({cap.kind_of[n] for n in nodes})
        self.counts: Vec = tuple(sum(1 for n in nodes if cap.kind_of[n] == t) for t in self.kinds)
        self.tables = [cap.kinds[t].tok_s for t in self.kinds]  # tok_s[m-1], up to the kind's layer cap

    def longest(self, group: Vec, flow: float, *, balanced: bool = False) -> int:
        """``m*``: the most layers ``group`` can hold as one stage of capacity >= ``flow`` (0: none).
        ``balanced``: every node also carries its share, ``flow / size`` (a crossing's group: each node then
        takes what its links to the other side bring, so the crossing carries ``nodes x nodes x link``)."""
        top = min((len(self.tables[i]) for i, c in enumerate(group) if c), default=0)
        share = flow / max(1, sum(group)) - 1e-9 if balanced else 0.0
        best = 0
        for m in range(1, top + 1):
            heights = [self.tables[i][m - 1] for i, c in enumerate(group) if c]
            if sum(c * self.tables[i][m - 1] for i, c in enumerate(group) if c) >= flow - 1e-9 and min(heights) >= share:
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
            for group, total in _groups_reaching(self, able, m, flow):
                held = [i for i in range(k) if group[i]]
                if total - min(self.tables[i][m - 1] for i in held) >= flow - 1e-9:
                    continue  # a node fewer reaches the flow too
                if m < min(len(self.tables[i]) for i in held) and \
                        sum(group[i] * self.tables[i][m] for i in held) >= flow - 1e-9:
                    continue  # it holds a layer more (found again at m + 1)
                out.append((group, m))
                if len(out) >= MAX_INNER_GROUPS:
                    return out
        return out

    def staggered(self, flow: float) -> list[Tile]:
        """Two rails of single nodes (kinds i, j; strips of k1 != k2 layers, neither alone reaching ``flow``)
        whose strips together reach it, over ``lcm(k1, k2)`` layers (at most :data:`MAX_TILE_LAYERS`)."""
        out: list[Tile] = []
        k = len(self.kinds)
        for i, j in itertools.combinations_with_replacement(range(k), 2):
            for k1 in range(1, len(self.tables[i]) + 1):
                for k2 in range(1, len(self.tables[j]) + 1):
                    if k1 == k2 or (i == j and k1 > k2):
                        continue
                    h1, h2 = self.tables[i][k1 - 1], self.tables[j][k2 - 1]
                    w = math.lcm(k1, k2)
                    if max(h1, h2) >= flow - 1e-9 or h1 + h2 < flow - 1e-9 or w > MAX_TILE_LAYERS:
                        continue
                    counts = [0] * k
                    counts[i] += w // k1
                    counts[j] += w // k2
                    if all(c <= n for c, n in zip(counts, self.counts, strict=True)):
                        out.append(Tile(tuple(counts), w, ((i, k1), (j, k2))))
        return out

    def node_caps(self, tile: Tile) -> tuple[float, ...]:
        """Every node's tokens/s in a group tile (what it can pass on across a crossing)."""
        return tuple(self.tables[i][tile.layers - 1] for i, c in enumerate(tile.counts) for _ in range(c))

    def boundary_groups(self, flow: float, most: int) -> list[tuple[Tile, bool]]:
        """Groups of at most two kinds and ``most`` nodes that hold >= 1 layer at ``flow``, each as long as it
        can (``False``) and, where that differs, as long as it can balanced (:meth:`longest`; ``True``)."""
        k = len(self.kinds)
        seen: dict[Vec, list[tuple[Tile, bool]]] = {}
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
                        m, mb = self.longest(g, flow), self.longest(g, flow, balanced=True)
                        seen[g] = ([(Tile(g, m), False)] if m > mb else []) + ([(Tile(g, mb), True)] if mb else [])
        return [end for ends in seen.values() for end in ends]


def _groups_reaching(region: RegionNodes, able: list[int], m: int, flow: float) -> list[tuple[Vec, float]]:
    """Groups of the kinds ``able`` (within the region's counts) whose capacity at ``m`` layers first
    reaches ``flow`` when nodes are added in kind order (every minimal group among them), with that capacity."""
    k = len(region.kinds)
    heights = {i: region.tables[i][m - 1] for i in able}
    out: list[tuple[Vec, float]] = []
    cur = [0] * k

    def rec(pos: int, total: float) -> None:
        if total >= flow - 1e-9:
            out.append((tuple(cur), total))
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


def _knapsack(counts: Vec, items: list[Tile]) -> np.ndarray:
    """``dp[v]``: the most layers tiles of ``items`` (any number of each) hold with at most ``v`` nodes of each
    kind."""
    dp = np.zeros(tuple(c + 1 for c in counts), dtype=np.int32)
    for item in items:
        group, m = item.counts, item.layers
        copies = min(counts[i] // c for i, c in enumerate(group) if c)
        src = tuple(slice(0, n + 1 - c) for n, c in zip(counts, group, strict=True))
        dst = tuple(slice(c, n + 1) for n, c in zip(counts, group, strict=True))
        for _ in range(copies):
            grown = np.maximum(dp[dst], dp[src] + m)
            if np.array_equal(grown, dp[dst]):
                break
            dp[dst] = grown
    return dp


def _unpack(dp: np.ndarray, items: list[Tile], v: Vec) -> list[Tile]:
    """The tiles of a knapsack optimum at ``v`` (backtracking ``dp``)."""
    out: list[Tile] = []
    while dp[v] > 0:
        for item in items:
            rest = tuple(a - b for a, b in zip(v, item.counts, strict=True))
            if min(rest) >= 0 and dp[rest] + item.layers == dp[v]:
                out.append(item)
                v = rest
                break
        else:  # unreachable: the optimum's last group always matches
            raise AssertionError("knapsack backtrack found no group")
    return out


def region_blocks(region: RegionNodes, flow: float, most: int = MAX_BOUNDARY_NODES) -> list[Block]:
    """The region's best block per (entry size, exit size, whether both ends are balanced), dominated ones
    dropped (a balanced block is beaten only by a balanced one)."""
    inner = [Tile(g, m) for g, m in region.inner_groups(flow)] + region.staggered(flow)
    dp = _knapsack(region.counts, inner) if inner else None
    ends = region.boundary_groups(flow, most)
    if not ends:
        return []
    best: dict[tuple[int, int, bool], tuple[int, Tile, Tile | None]] = {}

    def offer(key: tuple[int, int, bool], layers: int, e: Tile, x: Tile | None) -> None:
        if layers > best.get(key, (0,))[0]:
            best[key] = (layers, e, x)

    exits = np.array([t.counts for t, _ in ends], dtype=np.int64)  # every boundary group as an exit, at once
    exit_layers = np.array([t.layers for t, _ in ends], dtype=np.int64)
    exit_keys = 2 * exits.sum(axis=1) + np.array([ok for _, ok in ends], dtype=np.int64)  # size, balanced
    counts = np.array(region.counts, dtype=np.int64)
    for e, e_ok in ends:
        a = sum(e.counts)
        offer((a, a, e_ok), e.layers, e, None)
        left = counts - np.array(e.counts, dtype=np.int64) - exits
        fits = np.nonzero((left >= 0).all(axis=1))[0]
        if not len(fits):
            continue
        inside = dp[tuple(left[fits].T)] if dp is not None else 0
        totals = e.layers + exit_layers[fits] + inside
        ranked = np.argsort(-totals, kind="stable")
        _, firsts = np.unique(exit_keys[fits][ranked], return_index=True)  # the best exit of every key
        for f in firsts:
            x, x_ok = ends[int(fits[ranked[f]])]
            offer((a, sum(x.counts), e_ok and x_ok), int(totals[ranked[f]]), e, x)
    out: list[Block] = []
    for (a, b, ok), (layers, first, last) in best.items():
        if any(a2 >= a and b2 >= b and l2 >= layers and (ok2 or not ok) and (a2, b2, ok2) != (a, b, ok)
               for (a2, b2, ok2), (l2, _, _) in best.items()):
            continue
        tiles = [first]
        if last is not None:
            rest = tuple(n - p - q for n, p, q in zip(region.counts, first.counts, last.counts, strict=True))
            tiles += _unpack(dp, inner, rest) if dp is not None else []
            tiles.append(last)
        out.append(Block(a, b, layers, tiles, region.node_caps(first), region.node_caps(last or first)))
    return out
