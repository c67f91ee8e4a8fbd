"""The domain vocabulary every package speaks: layer ranges, stages, pipelines, placements, and
how a request ends.

* :class:`LayerRange` — a half-open range of transformer layers ``[start, end)``. It is a tuple,
  so ``start, end = r`` and ``r == (0, 12)`` work where plain pairs were used before.
* :data:`Placement` — node id -> the :class:`LayerRange` it holds (what ``plan.json`` stores).
* :class:`Stage` — one hop of a request's pipeline: a node running ``[layer_start, layer_end)``
  (fewer layers than it holds when the previous stage already ran some: partial hand-offs).
* :class:`Pipeline` — the stages of one request, coordinator -> stages -> coordinator.
* :class:`FinishReason` and :class:`ErrorCode` — why a request ended and why a stage refused or
  failed it; their values are the strings on the wire and in the OpenAI responses.

Pure data: no logic beyond invariants and descriptions. The planner makes placements, the router
turns them into pipelines, the wire carries stages (plus an address), the simulator replays them.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class LayerRange(NamedTuple):
    """Layers ``[start, end)`` (0-based, half-open)."""

    start: int
    end: int

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def __contains__(self, layer: object) -> bool:  # type: ignore[override]
        return isinstance(layer, int) and self.start <= layer < self.end

    def describe(self) -> str:
        return f"[{self.start}, {self.end})"


Placement = dict[str, LayerRange]
"""Node id -> the layers it holds."""


def as_placement(ranges: Mapping[str, tuple[int, int]]) -> Placement:
    """A :data:`Placement` from any mapping of node id -> ``(start, end)`` pairs."""
    return {node: LayerRange(int(s), int(e)) for node, (s, e) in ranges.items()}


@dataclass(slots=True, frozen=True)
class Stage:
    """One hop of a pipeline: ``node`` runs layers ``[layer_start, layer_end)``."""

    node: str
    layer_start: int
    layer_end: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def layers(self) -> LayerRange:
        return LayerRange(self.layer_start, self.layer_end)


@dataclass(slots=True, frozen=True)
class Pipeline:
    """The stages of one request, in order; together they run every layer exactly once."""

    stages: tuple[Stage, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(s.node for s in self.stages)

    @property
    def first(self) -> Stage:
        return self.stages[0]

    def __len__(self) -> int:
        return len(self.stages)

    def layers_on(self, node: str) -> int:
        return sum(s.num_layers for s in self.stages if s.node == node)

    def check(self, num_layers: int) -> None:
        """Invariant: consecutive, non-empty ranges covering ``[0, num_layers)``."""
        at = 0
        for s in self.stages:
            assert s.layer_start == at and s.layer_end > s.layer_start, f"bad stage {s} after layer {at}"
            at = s.layer_end
        assert at == num_layers, f"pipeline ends at layer {at}, model has {num_layers}"

    def describe(self) -> str:
        return " -> ".join(f"{s.node}[{s.layer_start},{s.layer_end})" for s in self.stages)


class FinishReason(StrEnum):
    """Why a request (or one attempt of it on a pipeline) ended."""

    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the client went away, or the coordinator abandoned the attempt
    ERROR = "error"  # see the ErrorCode


def token_finish(token: int, num_generated: int, max_tokens: int, stop_token_ids: Container[int]) -> FinishReason | None:
    """The one rule for whether a sampled token ends its request: STOP on a stop token, LENGTH once
    ``max_tokens`` are generated (``num_generated`` counts this token), else None. The last stage
    applies it as it samples (to free its KV at once); the coordinator core applies it to every token
    it receives, with stop strings on top."""
    if token in stop_token_ids:
        return FinishReason.STOP
    if num_generated >= max_tokens:
        return FinishReason.LENGTH
    return None


class ErrorCode(StrEnum):
    """Why a stage refused a request or a request's attempt failed."""

    CAPACITY = "capacity"  # can never fit in some stage's KV cache
    BAD_REQUEST = "bad_request"  # a stage rejected the request's contents
    AGENT_DEAD = "agent_dead"  # a stage's heartbeats stopped
    UNREACHABLE = "unreachable"  # a stage did not take the message
    LEAVING = "leaving"  # the stage drains before it stops (SIGTERM): it takes no new request, and
    # refuses those still running when its drain time is up
    LAYERS_MOVED = "layers_moved"  # the stage does not hold (or is releasing) the layers the request
    # needs there: the plan changed under it

    @property
    def retryable(self) -> bool:
        """Whether another pipeline may succeed where this one failed (failover)."""
        return self in (ErrorCode.AGENT_DEAD, ErrorCode.UNREACHABLE, ErrorCode.LEAVING, ErrorCode.LAYERS_MOVED)
