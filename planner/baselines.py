"""The paper's baseline placements: Petals, Swarm, separate pipelines, and a uniform layout.

Each function takes the cluster's :class:`~planner.capacity.CapacityModel` and returns a
placement (node id -> :class:`~helix.domain.LayerRange`, half-open) that covers every layer and
respects every node's ``max_layers``, or raises :class:`~helix.errors.InfeasiblePlanError`
saying why the scheme cannot place the model on this cluster. They follow the descriptions
in the Helix paper (sections 5.1 and 5.6):

* **petals** — decentralised greedy: nodes join one at a time (strongest first) and each
  takes the contiguous block of ``max_layers`` layers whose per-layer served throughput is
  least (Petals' ``choose_best_start``: the window whose *sorted* per-layer throughputs are
  lexicographically smallest), then adds its own throughput to those layers.
* **swarm** — equal stages: the stage size is the most layers the weakest node holds
  (on single24: 4 layers, so 20 stages); nodes are assigned to stages so that every stage
  gets about the same compute (longest-processing-time greedy: strongest node first, onto
  the stage with the least throughput so far).
* **separate** — one homogeneous pipeline per GPU type (as many as that type's nodes
  allow), layers split evenly among a pipeline's nodes; node types that cannot form a
  pipeline stay idle.
* **uniform** — every node holds the same number of layers; ranges are laid end to end
  and wrap round to layer 0 when they reach the last layer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from helix.domain import LayerRange, Placement
from helix.errors import InfeasiblePlanError
from planner.capacity import CapacityModel

BASELINES = ("petals", "swarm", "separate", "uniform")


def _check_capacity(cap: CapacityModel, scheme: str) -> None:
    total = sum(cap.max_layers.values())
    if total < cap.num_layers:
        raise InfeasiblePlanError(
            f"{scheme}: the model has {cap.num_layers} layers but all nodes together hold at most {total}"
        )


def _strongest_first(cap: CapacityModel) -> list[str]:
    """Nodes by the tokens/s they push through a full load of layers, strongest first (stable)."""
    return sorted(
        cap.nodes,
        key=lambda n: -cap.max_layers[n] * cap.node_capacity(n, cap.max_layers[n]),
    )


def _covered(cap: CapacityModel, placement: Placement) -> bool:
    seen = [False] * cap.num_layers
    for s, e in placement.values():
        for layer in range(s, e):
            seen[layer] = True
    return all(seen)


def petals(cap: CapacityModel) -> Placement:
    """Petals' greedy: each node takes the block of the least-served layers it can hold."""
    _check_capacity(cap, "petals")
    num = cap.num_layers
    served = [0.0] * num
    placement: Placement = {}
    for node in _strongest_first(cap):
        k = min(cap.max_layers[node], num)
        start = min(range(num - k + 1), key=lambda s: (sorted(served[s : s + k]), s))
        placement[node] = LayerRange(start, start + k)
        t = cap.node_capacity(node, k)
        for layer in range(start, start + k):
            served[layer] += t
    if not _covered(cap, placement):
        raise InfeasiblePlanError("petals: the greedy left some layers uncovered on this cluster")
    return placement


def swarm(cap: CapacityModel) -> Placement:
    """Swarm: equal stages sized for the weakest node, nodes spread to balance stage compute."""
    _check_capacity(cap, "swarm")
    num = cap.num_layers
    size = min(min(cap.max_layers.values()), num)
    stages = -(-num // size)
    nodes = _strongest_first(cap)
    if len(nodes) < stages:
        raise InfeasiblePlanError(
            f"swarm: {stages} stages of at most {size} layers (the weakest node's limit) need "
            f"{stages} nodes but the cluster has {len(nodes)}"
        )
    base, extra = divmod(num, stages)
    bounds: list[LayerRange] = []
    pos = 0
    for i in range(stages):
        width = base + (1 if i < extra else 0)
        bounds.append(LayerRange(pos, pos + width))
        pos += width
    stage_tok_s = [0.0] * stages
    placement: Placement = {}
    for node in nodes:
        i = min(range(stages), key=lambda j: (stage_tok_s[j], j))
        s, e = bounds[i]
        placement[node] = bounds[i]
        stage_tok_s[i] += cap.node_capacity(node, e - s)
    return placement


def _gpu_groups(cap: CapacityModel) -> dict[tuple[str, int], list[str]]:
    """Interchangeable nodes: same GPU type and the same layer limit."""
    groups: dict[tuple[str, int], list[str]] = defaultdict(list)
    for node in cap.nodes:
        groups[(cap.gpu_of[node], cap.max_layers[node])].append(node)
    return groups


def separate(cap: CapacityModel) -> Placement:
    """Separate pipelines: per GPU type, as many homogeneous pipelines as its nodes allow."""
    _check_capacity(cap, "separate")
    num = cap.num_layers
    placement: Placement = {}
    why: list[str] = []
    for (gpu, limit), nodes in sorted(_gpu_groups(cap).items()):
        need = -(-num // limit)
        pipes = len(nodes) // need
        if pipes == 0:
            why.append(f"{gpu}: {len(nodes)} node(s) x {limit} layers = {len(nodes) * limit} < {num}")
            continue
        for p in range(pipes):
            members = nodes[p::pipes]
            base, extra = divmod(num, len(members))
            pos = 0
            for i, node in enumerate(members):
                width = base + (1 if i < extra else 0)
                placement[node] = LayerRange(pos, pos + width)
                pos += width
    if not placement:
        raise InfeasiblePlanError(
            "separate: no GPU type has enough nodes to hold the whole model on its own (" + "; ".join(why) + ")"
        )
    return placement


def uniform(cap: CapacityModel) -> Placement:
    """Every node holds the same number of layers, laid end to end, wrapping round."""
    _check_capacity(cap, "uniform")
    num = cap.num_layers
    nodes = list(cap.nodes)
    k = min(min(cap.max_layers.values()), num)
    if k * len(nodes) < num:
        raise InfeasiblePlanError(
            f"uniform: {len(nodes)} nodes x {k} layers (the weakest node's limit) = {k * len(nodes)} < {num} layers"
        )
    placement: Placement = {}
    pos = 0
    for node in nodes:
        if pos + k >= num:
            placement[node] = LayerRange(num - k, num)
            pos = 0
        else:
            placement[node] = LayerRange(pos, pos + k)
            pos += k
    return placement


def run_baseline(name: str, cap: CapacityModel) -> Placement:
    """Dispatch by name (one of :data:`BASELINES`)."""
    table: dict[str, Callable[[CapacityModel], Placement]] = {
        "petals": petals,
        "swarm": swarm,
        "separate": separate,
        "uniform": uniform,
    }
    if name not in table:
        raise ValueError(f"unknown baseline {name!r}")
    placement = table[name](cap)
    assert _covered(cap, placement), f"{name} produced a placement that misses layers"
    assert all(e - s <= cap.max_layers[n] for n, (s, e) in placement.items())
    return placement
