"""Stages, pipelines and their hop-by-hop construction over a placement (Helix section 4.1).

Stages and pipelines are :mod:`helix.domain`'s (one node running a half-open layer range; the
ordered stages a request runs through, coordinator -> stages -> coordinator). The
:class:`Topology` holds, for the coordinator and for every node, the valid next hops of the
plan's max-flow graph (``planner.graph.hands_off``: node ``j`` may follow ``i`` when
``s_j <= e_i < e_j``, and the link ``i -> j`` exists). :func:`build_pipeline` walks it from the
coordinator: at every vertex a chooser (IWRR for the real router, baselines in the
simulator) names the next node, which then runs only the layers not yet run
(``[e_i, e_j)``). Candidates that a mask rejects are skipped; when a choice leads to a dead
end the walk backtracks to the next candidate, and when nothing is reachable it raises
:class:`~helix.errors.NoRouteError`.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping

from helix.domain import Pipeline, Stage
from helix.errors import NoRouteError
from planner.graph import hands_off

_NONE: frozenset[str] = frozenset()

# chooser(vertex, excluded, admissible) -> next node id (or the coordinator id for the sink) or None
Chooser = Callable[[str, Container[str], Callable[[str], bool]], str | None]


class Topology:
    """Valid next hops of every vertex for one placement (the max-flow graph's edges)."""

    __slots__ = ("coordinator", "num_layers", "placement", "successors")

    def __init__(
        self,
        coordinator: str,
        num_layers: int,
        placement: Mapping[str, tuple[int, int]],
        links: Container[tuple[str, str]],
        *,
        partial_handoffs: bool = True,
    ) -> None:
        self.coordinator = coordinator
        self.num_layers = num_layers
        self.placement: dict[str, tuple[int, int]] = {n: (int(s), int(e)) for n, (s, e) in placement.items()}
        succ: dict[str, tuple[str, ...]] = {}
        succ[coordinator] = tuple(n for n, (s, _) in self.placement.items() if s == 0 and (coordinator, n) in links)
        for a, ra in self.placement.items():
            if ra[1] == num_layers:
                succ[a] = (coordinator,) if (a, coordinator) in links else ()
            else:
                succ[a] = tuple(
                    b
                    for b, rb in self.placement.items()
                    if b != a and hands_off(ra, rb, partial_handoffs) and (a, b) in links
                )
        self.successors = succ


def build_pipeline(
    topology: Topology,
    choose: Chooser,
    admissible: Callable[[str, int, int], bool] | None = None,
) -> Pipeline:
    """Walk from the coordinator to the sink, one chosen hop at a time.

    ``admissible(node, layer_start, layer_end)`` masks a candidate (dead, or its KV would
    pass the watermark). Raises :class:`NoRouteError` when no complete pipeline exists.
    """
    coord = topology.coordinator
    placement = topology.placement
    num_layers = topology.num_layers
    failed: set[tuple[str, int]] = set()  # (node, layers done on entry) known to dead-end
    stages: list[Stage] = []
    stack: list[tuple[str, int, frozenset[str]]] = []
    vertex, done = coord, 0
    tried: frozenset[str] = _NONE

    def ok(candidate: str) -> bool:
        if candidate == coord:
            return done == num_layers
        if failed and (candidate, done) in failed:
            return False
        return admissible is None or admissible(candidate, done, placement[candidate][1])

    while True:
        nxt = choose(vertex, tried, ok)
        if nxt is None:
            if not stack:
                raise NoRouteError(
                    "no complete pipeline is available: every route is masked (KV watermark) or dead"
                )
            dead_end = stages.pop()
            failed.add((dead_end.node, dead_end.layer_start))
            vertex, done, tried = stack.pop()
            tried = tried | {dead_end.node}
            continue
        if nxt == coord:
            return Pipeline(tuple(stages))
        end = placement[nxt][1]
        stages.append(Stage(nxt, done, end))
        stack.append((vertex, done, tried))
        vertex, done, tried = nxt, end, _NONE
