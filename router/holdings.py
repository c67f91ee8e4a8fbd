"""What the coordinator core knows of each connected agent: where its data plane is, the layer spans
it holds (from its WELCOME, then from its LAYERS answers to SET_LAYERS / RELEASE_LAYERS) and its KV
capacity; whether it can serve a plan's range now. Pure bookkeeping for :mod:`router.core`."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from helix import wire

log = logging.getLogger(__name__)


class AgentHoldings:
    """Connected agents' data addresses, held layers and KV capacity, by node."""

    __slots__ = ("addresses", "held", "kv_tokens")

    def __init__(self) -> None:
        self.addresses: dict[str, str] = {}  # node -> its data plane (kept after it disconnects)
        self.held: dict[str, tuple[tuple[int, int], ...]] = {}  # connected node -> the spans its agent holds
        self.kv_tokens: dict[str, int] = {}  # node -> its KV capacity in tokens (per layer it holds)

    def joined(self, node: str, welcome: wire.Welcome) -> None:
        self.addresses[node] = welcome.data_address
        self.kv_tokens[node] = welcome.kv_capacity_tokens
        self.held[node] = spans(welcome.held, welcome.layer_start, welcome.layer_end)

    def reported(self, msg: wire.Layers) -> bool:
        """Fold in a LAYERS answer; True when it changed what a connected agent holds."""
        if msg.node_id not in self.held or not (msg.ok or msg.layer_end):
            return False
        self.held[msg.node_id] = spans(msg.held, msg.layer_start, msg.layer_end)
        return True

    def gone(self, node: str) -> None:
        self.held.pop(node, None)

    def serves(self, node: str, start: int, end: int) -> float | None:
        """``node``'s KV capacity in entries for layers ``[start, end)`` if it is connected and holds
        them all; None (and a warning when it is connected) if not."""
        held = self.held.get(node)
        if held is None:
            return None
        if not any(s <= start and end <= e for s, e in held):
            log.warning("agent %s holds layers %s but the plan gives it [%d, %d): not routing through it", node,
                        list(held), start, end)  # fmt: skip
            return None
        return float(self.kv_tokens.get(node, 0) * (end - start))


def spans(held: Iterable[wire.LayerSpan], start: int, end: int) -> tuple[tuple[int, int], ...]:
    """The layer spans an agent holds: ``held``, or its own range when it lists none (none when empty)."""
    out = tuple((h.start, h.end) for h in held)
    return out or (((start, end),) if end > start else ())
