"""The simulated network: each directed link of ``cluster.resolved_links()`` is a FIFO server.

A message of ``n`` bytes occupies its link for ``n / bandwidth`` after the link's previous
message, then arrives ``latency`` later. What the messages carry is the engine's
(:mod:`simulator.engine`): token ids from the coordinator, activations between nodes, tokens
back to the coordinator.
"""

from __future__ import annotations

from helix.errors import ConfigError
from helix.spec import ClusterSpec
from helix.units import gbps_to_bytes_per_s


class Links:
    """When each message sent on a link arrives."""

    __slots__ = ("_links",)

    def __init__(self, cluster: ClusterSpec) -> None:
        self._links: dict[tuple[str, str], list[float]] = {}  # (src, dst) -> [free from (s), bytes/s, latency (s)]
        self.add(cluster)

    def add(self, cluster: ClusterSpec) -> None:
        """The links of ``cluster`` not known yet (a node joined)."""
        for key, link in cluster.resolved_links().items():
            if key not in self._links:
                self._links[key] = [0.0, gbps_to_bytes_per_s(link.bandwidth_gbps), link.latency_ms / 1000.0]

    def arrival(self, src: str, dst: str, nbytes: float, now: float) -> float:
        """Send ``nbytes`` from ``src`` to ``dst`` at ``now``: when the message arrives."""
        link = self._links.get((src, dst))
        if link is None:
            raise ConfigError(f"no link {src} -> {dst} for a planned hop")
        start = now if now > link[0] else link[0]
        link[0] = start + nbytes / link[1]
        return link[0] + link[2]
