"""The simulated network: each directed link of ``cluster.resolved_links()`` is a FIFO server, and so
is every capacity links share (a region's uplink and downlink, a node's NIC: the cluster file's
``regions`` and nodes' ``nic_gbps``).

A message of ``n`` bytes occupies its link for ``n / bandwidth`` after the link's previous
message, then arrives ``latency`` later. A message that also crosses shared capacities (out of
its source's region into another region: that region's uplink and the other's downlink; out of a
node with a NIC, into one) queues ``n / bandwidth`` of work on each of them as well (each is a
FIFO server of its own: its work starts when it sent the messages before, or now) and arrives
once its link and every one of them are done, plus the latency: the messages through one uplink,
whatever their links, move at most its bandwidth together, and a message on a link slower than
the uplink's share it gets takes its link's time. The coordinator's messages count in its
region's uplink and downlink (its own ``nic_gbps`` is not modelled). Without shared capacities a
message sees its link alone, as the paper's simulator.
What the messages carry is the engine's (:mod:`simulator.engine`): token ids from the
coordinator, activations between nodes, tokens back to the coordinator.
"""

from __future__ import annotations

from helix.errors import ConfigError
from helix.spec import ClusterSpec
from helix.units import gbps_to_bytes_per_s


class Links:
    """When each message sent on a link arrives."""

    __slots__ = ("_links", "_shared", "_via")

    def __init__(self, cluster: ClusterSpec) -> None:
        self._links: dict[tuple[str, str], list[float]] = {}  # (src, dst) -> [free from (s), bytes/s, latency (s)]
        self._shared: dict[str, list[float]] = {}  # "region R uplink", "node N NIC in" ... -> [free from (s), bytes/s]
        self._via: dict[tuple[str, str], list[list[float]]] = {}  # (src, dst) -> the shared capacities it crosses
        self.add(cluster)

    def add(self, cluster: ClusterSpec) -> None:
        """The links of ``cluster`` not known yet (a node joined)."""
        shared = bool(cluster.regions) or any(n.nic_gbps is not None for n in cluster.nodes)
        for key, link in cluster.resolved_links().items():
            if key not in self._links:
                self._links[key] = [0.0, gbps_to_bytes_per_s(link.bandwidth_gbps), link.latency_ms / 1000.0]
                self._via[key] = [self._server(what, gbps) for what, gbps in _shared_on(cluster, *key)] if shared else []

    def _server(self, what: str, gbps: float) -> list[float]:
        if what not in self._shared:
            self._shared[what] = [0.0, gbps_to_bytes_per_s(gbps)]
        return self._shared[what]

    def arrival(self, src: str, dst: str, nbytes: float, now: float) -> float:
        """Send ``nbytes`` from ``src`` to ``dst`` at ``now``: when the message arrives."""
        link = self._links.get((src, dst))
        if link is None:
            raise ConfigError(f"no link {src} -> {dst} for a planned hop")
        start = now if now > link[0] else link[0]
        link[0] = done = start + nbytes / link[1]
        for server in self._via[(src, dst)]:
            server[0] = (now if now > server[0] else server[0]) + nbytes / server[1]
            done = done if done > server[0] else server[0]
        return done + link[2]


def _shared_on(cluster: ClusterSpec, src: str, dst: str) -> list[tuple[str, float]]:
    """The shared capacities (name, Gbit/s) a message ``src -> dst`` crosses."""
    out: list[tuple[str, float]] = []
    if cluster.crosses_regions(src, dst):
        rs, rd = cluster.region_of(src), cluster.region_of(dst)
        if rs in cluster.regions:
            out.append((f"region {rs} uplink", cluster.regions[rs].up_gbps))
        if rd in cluster.regions:
            out.append((f"region {rd} downlink", cluster.regions[rd].down_gbps))
    coord = cluster.coordinator.id
    for end, way in ((src, "out"), (dst, "in")):
        nic = cluster.node(end).nic_gbps if end != coord else None
        if nic is not None:
            out.append((f"node {end} NIC {way}", nic))
    return out
