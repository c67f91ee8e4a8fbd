"""KV-cache estimation per node and high-watermark masking (Helix section 4.2).

The coordinator cannot see the nodes' KV caches, so it estimates them: when a request is
admitted on a pipeline, every stage reserves ``(prompt + expected output tokens) x layers run
there`` KV *entries* (one token in one layer, the unit of
``kv_capacity_tokens_by_layers``); the reservation is released when the request finishes.
Agents' reports (``used``, ``reserved``, ``capacity``) correct the estimate upward only: the
estimate used for masking is ``max(own reservations, reported use)``, so an underestimate
(outputs longer than expected) is caught while stale low reports never let a node overfill.

Masking: a candidate next hop is skipped when its estimate plus the new reservation would
pass ``watermark x capacity``. :meth:`KVEstimator.bottleneck_usage` gives the fullest layer
of the model across all its holders (what an offline feeder throttles on).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from helix.errors import CapacityError

DEFAULT_WATERMARK = 0.85


@dataclass(slots=True)
class NodeKV:
    """The coordinator's view of one node's KV cache, in entries (token x layer)."""

    capacity: float
    reserved: float = 0.0
    reported_used: float = 0.0

    @property
    def estimate(self) -> float:
        return self.reserved if self.reserved >= self.reported_used else self.reported_used


class KVEstimator:
    """Reservations per request and node; masking against a high watermark."""

    __slots__ = ("nodes", "watermark", "expected_output_tokens", "_held", "peak_estimate")

    def __init__(
        self,
        capacity_entries: Mapping[str, float],
        *,
        watermark: float = DEFAULT_WATERMARK,
        expected_output_tokens: float = 232.0,
    ) -> None:
        if not 0 < watermark <= 1:
            raise ValueError("watermark must be in (0, 1]")
        self.nodes: dict[str, NodeKV] = {n: NodeKV(capacity=float(c)) for n, c in capacity_entries.items()}
        self.watermark = watermark
        self.expected_output_tokens = expected_output_tokens
        self._held: dict[object, list[tuple[str, float]]] = {}
        self.peak_estimate: dict[str, float] = dict.fromkeys(self.nodes, 0.0)

    def tokens_for(self, prompt_tokens: int, expected_output_tokens: float | None = None) -> float:
        """Tokens a request is expected to hold at its peak (prompt + expected output)."""
        out = self.expected_output_tokens if expected_output_tokens is None else expected_output_tokens
        return prompt_tokens + out

    def fits(self, node: str, entries: float) -> bool:
        """Whether reserving ``entries`` more on ``node`` stays under the watermark."""
        kv = self.nodes.get(node)
        if kv is None:
            return True  # a node we know no capacity for is never masked
        return kv.estimate + entries <= self.watermark * kv.capacity

    def check_can_ever_fit(self, node: str, entries: float) -> None:
        kv = self.nodes.get(node)
        if kv is not None and entries > kv.capacity:
            raise CapacityError(f"a request needs {entries:.0f} KV entries on {node}, which holds {kv.capacity:.0f}")

    def reserve(self, request_id: object, stages: Iterable[tuple[str, int]], tokens: float) -> None:
        """Reserve ``tokens x layers`` on every ``(node, layers)`` of the request's pipeline."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds a reservation")
        held: list[tuple[str, float]] = []
        for node, layers in stages:
            entries = tokens * layers
            kv = self.nodes.get(node)
            if kv is not None:
                kv.reserved += entries
                if kv.estimate > self.peak_estimate[node]:
                    self.peak_estimate[node] = kv.estimate
            held.append((node, entries))
        self._held[request_id] = held

    def release(self, request_id: object) -> bool:
        """Release a request's reservations; False when it held none (already released)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        for node, entries in held:
            kv = self.nodes.get(node)
            if kv is not None:
                kv.reserved = max(0.0, kv.reserved - entries)
        return True

    def adopt(self, other: KVEstimator) -> None:
        """Take over ``other``'s reservations (a re-plan: requests in flight keep theirs) on the nodes known here."""
        for request_id, held in other._held.items():
            if request_id in self._held:
                continue
            for node, entries in held:
                kv = self.nodes.get(node)
                if kv is not None:
                    kv.reserved += entries
            self._held[request_id] = held

    def holds(self, request_id: object) -> bool:
        return request_id in self._held

    def requests_by_node(self) -> dict[str, int]:
        """How many requests hold a reservation on each node now: its requests in flight, queued or running."""
        out: dict[str, int] = {}
        for held in self._held.values():
            for node in {node for node, _ in held}:
                out[node] = out.get(node, 0) + 1
        return out

    def report(self, node: str, *, used: float, reserved: float | None = None, capacity: float | None = None) -> None:
        """An agent's report of its real KV use (entries); corrects the estimate upward."""
        kv = self.nodes.get(node)
        if kv is None:
            if capacity is None:
                return
            kv = self.nodes[node] = NodeKV(capacity=capacity)
            self.peak_estimate[node] = 0.0
        if capacity is not None:
            kv.capacity = capacity
        kv.reported_used = max(used, reserved or 0.0)

    def usage(self, node: str) -> float:
        """Estimated fraction of the node's KV capacity in use."""
        kv = self.nodes[node]
        return kv.estimate / kv.capacity if kv.capacity > 0 else 1.0

    def bottleneck_usage(self, placement: Mapping[str, tuple[int, int]], num_layers: int) -> float:
        """The fullest layer: max over layers of (estimated entries / capacity entries) summed
        over the nodes holding that layer (each node's KV spread evenly over its layers)."""
        used = [0.0] * (num_layers + 1)
        total = [0.0] * (num_layers + 1)
        for node, (s, e) in placement.items():
            kv = self.nodes.get(node)
            if kv is None:
                continue
            k = e - s
            u, c = kv.estimate / k, kv.capacity / k
            used[s] += u
            used[e] -= u
            total[s] += c
            total[e] -= c
        worst = 0.0
        cu = ct = 0.0
        for layer in range(num_layers):
            cu += used[layer]
            ct += total[layer]
            if ct > 0:
                worst = max(worst, cu / ct)
        return worst
