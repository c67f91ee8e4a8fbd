"""What changing a placement costs the nodes: the layers each one keeps, loads and drops.

Re-planning (``planner.replan``) prices a new placement by the layers it makes nodes load: a
node whose range goes from ``[s, e)`` to ``[s', e')`` keeps their overlap, loads the layers of
the new range it did not hold (weights to read and copy in) and drops the rest. A node that
joins loads its whole range; a node that leaves drops its whole range (nothing to load). The
count of *moved layers* is the sum of the layers loaded.

:func:`node_moves` lists the changes node by node, :func:`layers_moved` counts them (the inner
loop of the search: no objects), and :func:`relabel` permutes a placement among interchangeable
nodes (same kind, same region) so that it keeps as many layers where they are as it can: a plan
made from scratch does not know where layers were, and relabelling it is the fair way to say
what it would move. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx

from helix.domain import LayerRange, Placement

Ranges = Mapping[str, tuple[int, int]]


def _overlap(a: tuple[int, int] | None, b: tuple[int, int] | None) -> int:
    if a is None or b is None:
        return 0
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def _minus(a: tuple[int, int] | None, b: tuple[int, int] | None) -> list[LayerRange]:
    """The layers of ``a`` outside ``b``, as at most two ranges."""
    if a is None:
        return []
    if b is None or _overlap(a, b) == 0:
        return [LayerRange(*a)]
    out = []
    if a[0] < b[0]:
        out.append(LayerRange(a[0], b[0]))
    if b[1] < a[1]:
        out.append(LayerRange(b[1], a[1]))
    return out


@dataclass(frozen=True, slots=True)
class NodeMove:
    """One node's change: its range before and after (None: not in that placement)."""

    node: str
    before: LayerRange | None
    after: LayerRange | None

    @property
    def kept(self) -> LayerRange | None:
        """The layers it holds before and after."""
        if self.before is None or self.after is None or _overlap(self.before, self.after) == 0:
            return None
        return LayerRange(max(self.before[0], self.after[0]), min(self.before[1], self.after[1]))

    @property
    def load(self) -> list[LayerRange]:
        """The layers it must newly load."""
        return _minus(self.after, self.before)

    @property
    def drop(self) -> list[LayerRange]:
        """The layers it no longer holds."""
        return _minus(self.before, self.after)

    @property
    def loaded(self) -> int:
        return sum(r.num_layers for r in self.load)

    @property
    def dropped(self) -> int:
        return sum(r.num_layers for r in self.drop)

    @property
    def change(self) -> str:
        """``kept`` | ``moved`` | ``joins`` | ``leaves``."""
        if self.before is None:
            return "joins"
        if self.after is None:
            return "leaves"
        return "kept" if self.before == self.after else "moved"

    def to_dict(self) -> dict[str, Any]:
        """The plan file's form (``stats.replan.moves``): ranges as ``[start, end)`` pairs."""
        def pair(r: LayerRange | None) -> list[int] | None:
            return None if r is None else [r.start, r.end]

        return {"node": self.node, "before": pair(self.before), "after": pair(self.after),
                "kept": pair(self.kept), "load": [pair(r) for r in self.load],
                "drop": [pair(r) for r in self.drop], "layers_loaded": self.loaded}


def node_moves(before: Ranges, after: Ranges) -> list[NodeMove]:
    """Every node of either placement, in the order of ``after`` then the ones that left."""
    nodes = [*after, *(n for n in before if n not in after)]
    return [NodeMove(n, LayerRange(*before[n]) if n in before else None,
                     LayerRange(*after[n]) if n in after else None) for n in nodes]


def layers_moved(before: Ranges, after: Ranges) -> int:
    """Layers the nodes of ``after`` must load that they did not hold in ``before``."""
    total = 0
    for node, (s, e) in after.items():
        old = before.get(node)
        total += e - s - _overlap(old, (s, e))
    return total


def relabel(after: Ranges, before: Ranges, groups: Mapping[str, str]) -> dict[str, str]:
    """Which node's range in ``after`` each node of ``after`` should take instead (node -> node), the
    ranges permuted among the nodes of each group (``groups``: node -> the group of nodes it may swap
    with, e.g. its kind and region) so that the layers kept where they were are as many as possible
    (a maximum-weight matching per group; the identity wins ties). :func:`renamed` applies it."""
    members: dict[str, list[str]] = {}
    for node in after:
        members.setdefault(groups[node], []).append(node)
    out: dict[str, str] = {}
    for nodes in members.values():
        if len(nodes) == 1:
            out[nodes[0]] = nodes[0]
            continue
        g = nx.Graph()
        for i in nodes:  # weights > 0 so the matching is complete
            for j in nodes:
                g.add_edge(("node", i), ("range", j), weight=2 * _overlap(before.get(i), after[j]) + (1.5 if i == j else 1.0))
        for a, b in nx.max_weight_matching(g, maxcardinality=True):
            (_, i), (_, j) = (a, b) if a[0] == "node" else (b, a)
            out[i] = j
    return {n: out[n] for n in after}


def renamed(after: Ranges, takes: Mapping[str, str]) -> Placement:
    """``after`` with every node holding the range of the node it takes (:func:`relabel`)."""
    return {n: LayerRange(*after[takes[n]]) for n in after}
