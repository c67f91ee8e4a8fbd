"""The plan file (``plan.json`` or ``.yaml``): a placement and the flows that come with it.

A :class:`Plan` is what the planner writes and the router, agents, simulator and notebooks
read. :func:`check_plan` is the one structural invariant checker (ranges, coverage, layer
limits, flow conservation); the planner adds the capacity check (``planner.graph``) when it
has the profiles at hand. Both run on every plan produced or loaded.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from helix.errors import ConfigError
from helix.loading import read_document, validate

FLOW_TOLERANCE = 1e-6


class FlowEdge(BaseModel):
    """The flow on one directed link of the cluster graph (an entry of `flows`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    src: str = Field(description="a node id or the coordinator's id")
    dst: str = Field(description="a node id or the coordinator's id")
    tok_s: float = Field(ge=0, description="tokens/s the plan routes along this link")


class Plan(BaseModel):
    """Placement as half-open layer ranges ``[start, end)`` plus its max flow and how it was found."""

    model_config = ConfigDict(extra="forbid")

    cluster: str = Field(description="the cluster file's `name`")
    model: str = Field(description="the cluster file's `model`")
    method: str = Field(description="how the placement was found: helix, paper-milp, petals, swarm, separate, uniform, given")
    placement: dict[str, tuple[int, int]] = Field(
        description="per node id: the half-open layer range [start, end) it holds; nodes not listed hold nothing"
    )
    max_flow_tok_s: float = Field(ge=0, description="tokens/s: the max flow (serving throughput) of this placement")
    upper_bound_tok_s: float | None = Field(default=None, description="tokens/s no placement can beat, if proven")
    bound_method: str | None = Field(default=None, description="how the upper bound was proven")
    flows: list[FlowEdge] = Field(default=[], description="tokens/s on every link that carries flow")
    bottleneck: list[str] = Field(default=[], description="a minimum cut: the nodes and links that limit the max flow")
    status: str = Field(default="feasible", description="optimal | max_flow_optimal | feasible | heuristic | ...")
    stop_reason: str | None = Field(
        default=None, description="why the search stopped: bound_met | stalled | time_limit (absent: no search)"
    )
    wall_s: float = Field(default=0.0, description="seconds planning took")
    solver: str | None = Field(default=None, description="the MILP solver and its version, if one ran")
    objective: str | None = Field(default=None, description="what was optimised: serving | max-flow")
    partial_handoffs: bool = Field(
        default=True, description="a request may go on to a node whose range starts inside the last one's (runs the rest)"
    )
    score: dict[str, float] = Field(default={}, description="the serving estimate's figures (objective serving)")
    stats: dict[str, Any] = Field(default={}, description="pipeline depth, KV per layer and the search's own figures")

    @field_validator("placement")
    @classmethod
    def _ranges(cls, v: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        for node, (start, end) in v.items():
            if not 0 <= start < end:
                raise ValueError(f"{node}: layer range [{start}, {end}) is empty or negative")
        return v

    def layers_held(self, node: str) -> int:
        start, end = self.placement[node]
        return end - start

    def stages(self) -> list[tuple[str, int, int]]:
        """Nodes with their ranges, ordered by start layer."""
        return sorted(((n, s, e) for n, (s, e) in self.placement.items()), key=lambda x: (x[1], x[2], x[0]))

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2)

    def save(self, path: str | Path) -> None:
        p = Path(path)
        if p.suffix in (".yaml", ".yml"):
            import yaml

            p.write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))
        else:
            p.write_text(self.to_json() + "\n")


def node_inflow(flows: list[FlowEdge], coordinator: str) -> dict[str, float]:
    """tokens/s entering each node (the flow through it), from a plan's edge flows."""
    through: dict[str, float] = defaultdict(float)
    for edge in flows:
        if edge.dst != coordinator:
            through[edge.dst] += edge.tok_s
    return dict(through)


def check_plan(
    plan: Plan,
    *,
    num_layers: int,
    node_ids: list[str],
    max_layers: dict[str, int] | None = None,
    coordinator: str = "coordinator",
    source: str = "<plan>",
) -> None:
    """Structural invariants: known nodes, ranges inside the model, layer limits, every layer
    covered, flows conserved at every node and summing to ``max_flow_tok_s``."""
    known = set(node_ids)
    for node, (start, end) in plan.placement.items():
        field = f"placement.{node}"
        if node not in known:
            raise ConfigError(f"node {node!r} is not in the cluster", source=source, field=field)
        if end > num_layers:
            raise ConfigError(f"range [{start}, {end}) goes past the model's {num_layers} layers", source=source, field=field)
        if max_layers is not None and end - start > max_layers[node]:
            raise ConfigError(
                f"holds {end - start} layers but this node fits at most {max_layers[node]}", source=source, field=field
            )
    covered = [False] * num_layers
    for start, end in plan.placement.values():
        for layer in range(start, end):
            covered[layer] = True
    missing = [i for i, c in enumerate(covered) if not c]
    if missing:
        raise ConfigError(
            f"layers {_ranges_text(missing)} are held by no node: the plan does not cover all {num_layers} layers",
            source=source,
            field="placement",
        )
    if not plan.flows:
        return
    balance: dict[str, float] = defaultdict(float)
    for i, edge in enumerate(plan.flows):
        for end_name in (edge.src, edge.dst):
            if end_name != coordinator and end_name not in plan.placement:
                raise ConfigError(f"flow on an edge to {end_name!r}, which holds no layers", source=source, field=f"flows[{i}]")
        balance[edge.src] -= edge.tok_s
        balance[edge.dst] += edge.tok_s
    scale = max(1.0, plan.max_flow_tok_s)
    for node, net in balance.items():
        if node != coordinator and abs(net) > FLOW_TOLERANCE * scale:
            raise ConfigError(f"flow into {node!r} differs from flow out by {net:.6g} tok/s", source=source, field="flows")
    out_of_source = sum(e.tok_s for e in plan.flows if e.src == coordinator)
    if abs(out_of_source - plan.max_flow_tok_s) > 1e-4 * scale:
        raise ConfigError(
            f"flows leave the coordinator at {out_of_source:.6g} tok/s but max_flow_tok_s is {plan.max_flow_tok_s:.6g}",
            source=source,
            field="max_flow_tok_s",
        )


def _ranges_text(layers: list[int]) -> str:
    parts: list[str] = []
    start = prev = layers[0]
    for x in layers[1:] + [None]:  # type: ignore[list-item]
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(parts)


def parse_plan(data: Any, source: str = "<plan>") -> Plan:
    return validate(Plan, data, source)


def load_plan(path: str | Path) -> Plan:
    """Read a plan file (JSON or YAML). Callers run :func:`check_plan` against their cluster."""
    p = Path(path)
    return parse_plan(read_document(p), str(p))


def load_placement(path: str | Path, *, cluster: str, model: str) -> Plan:
    """Read a file whose placement is to be evaluated: a complete plan, or a hand-written one
    with just ``placement`` (and usually ``cluster``, ``model``). What evaluation computes or
    does not need may be missing: ``method`` reads ``"given"`` and ``cluster`` / ``model``
    the given ones; without ``max_flow_tok_s`` it reads 0 and the file's flows are ignored
    (evaluation computes both). Unknown fields are still errors. Plans read for serving
    use :func:`load_plan`: they must be complete."""
    p = Path(path)
    data = read_document(p)
    if isinstance(data, dict):
        data = {"cluster": cluster, "model": model, "method": "given", **data}
        if "max_flow_tok_s" not in data:
            data.update(max_flow_tok_s=0.0, flows=[])
    return parse_plan(data, str(p))
