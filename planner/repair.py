"""Re-planning's warm start: the current placement made valid for a changed membership.

:func:`warm_start` takes the ranges the remaining nodes hold now and returns a placement of the
new cluster that covers every layer while moving as few layers as it can:

1. nodes that left are dropped; a node whose layer limit shrank keeps the start of its range;
2. every node that joins (or held nothing) takes the window of its ``max_layers`` layers where
   the layers are thinnest — Petals' rule: the window whose per-layer tokens/s, sorted, are
   lexicographically least — which puts it in the holes first;
3. layers that no node holds any more are covered greedily: the node and window that cover the
   most uncovered layers, without uncovering others, for the fewest layers loaded; when no node
   can, a ripple along the chain of adjacent ranges (:func:`_ripple`: the neighbour of the hole
   slides over it, its neighbour over the layer it left, ... until one can grow instead); until
   none is left (:func:`cover`).

The search (``planner.replan``) starts from the result. Pure and deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping

from helix.domain import LayerRange, Placement
from planner.capacity import CapacityModel
from planner.moves import layers_moved


def warm_start(cap: CapacityModel, current: Mapping[str, tuple[int, int]]) -> tuple[Placement, list[int]]:
    """The placement to start from, and the layers it still leaves uncovered (none when it is valid)."""
    pl: Placement = {}
    for node in cap.nodes:
        if node in current:
            s, e = current[node]
            s, e = min(s, cap.num_layers - 1), min(e, cap.num_layers)
            pl[node] = LayerRange(s, min(e, s + cap.max_layers[node]))
    for node in cap.nodes:
        if node not in pl:
            pl[node] = thinnest_window(cap, pl, cap.max_layers[node])
    return cover(cap, pl, current)


def thinnest_window(cap: CapacityModel, pl: Placement, k: int) -> LayerRange:
    """The ``k`` layers whose sorted coverage is lexicographically least (first such window)."""
    cov = cap.coverage(pl)
    k = min(k, cap.num_layers)
    best = min(range(cap.num_layers - k + 1), key=lambda s: (sorted(cov[s:s + k]), s))
    return LayerRange(best, best + k)


def _holders(pl: Placement, num_layers: int) -> list[int]:
    count = [0] * num_layers
    for s, e in pl.values():
        for layer in range(s, e):
            count[layer] += 1
    return count


def cover(cap: CapacityModel, pl: Placement, current: Mapping[str, tuple[int, int]]) -> tuple[Placement, list[int]]:
    """Cover the layers no node holds, one node at a time (module docstring); what stays uncovered."""
    pl = dict(pl)
    while True:
        count = _holders(pl, cap.num_layers)
        holes = {layer for layer, c in enumerate(count) if c == 0}
        if not holes:
            return pl, []
        best: tuple[tuple[int, int, int, str], str, LayerRange] | None = None
        for node in cap.nodes:
            s, e = pl[node]
            only = {layer for layer in range(s, e) if count[layer] == 1}  # uncovered if the node leaves them
            for k in sorted({e - s, cap.max_layers[node]}):
                for a in range(max(0, min(holes) - k + 1), min(max(holes), cap.num_layers - k) + 1):
                    window = LayerRange(a, a + k)
                    gain = len(holes & set(range(a, a + k))) - len(only - set(range(a, a + k)))
                    if gain <= 0:
                        continue
                    loaded = layers_moved(current, {node: window}) - layers_moved(current, {node: pl[node]})
                    key = (gain, -loaded, -k, node)
                    if best is None or key > best[0]:
                        best = (key, node, window)
        if best is not None:
            pl[best[1]] = best[2]
            continue
        rippled = [r for step in (-1, 1) if (r := _ripple(cap, pl, min(holes), step)) is not None]
        if not rippled:
            return pl, sorted(holes)
        pl = min(rippled, key=lambda r: layers_moved(current, r))


def _ripple(cap: CapacityModel, pl: Placement, hole: int, step: int) -> Placement | None:
    """Fill layer ``hole`` from the side ``step`` points away from (-1: the node that ends where the hole
    is): that node grows over it, or, at its limit, slides over it by one and leaves its own far layer
    to the node before it, and so on until a node can grow or the slid-off layer has other holders.
    None when the chain ends first."""
    moved, seen, edge = dict(pl), set(), hole
    while True:
        nxt = sorted(n for n, (s, e) in moved.items() if n not in seen and (e == edge if step < 0 else s == edge + 1))
        if not nxt:
            return None
        n = nxt[0]
        seen.add(n)
        a, b = moved[n]
        if b - a < cap.max_layers[n]:
            moved[n] = LayerRange(a, b + 1) if step < 0 else LayerRange(a - 1, b)
            return moved
        moved[n] = LayerRange(a + 1, b + 1) if step < 0 else LayerRange(a - 1, b - 1)
        edge = a if step < 0 else b - 1  # the layer it slid off
        if any(s <= edge < e for m, (s, e) in moved.items() if m != n):
            return moved
