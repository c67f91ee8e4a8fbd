"""Capacities several links share: a region's uplink and downlink, a node's NIC (the cluster file's
``regions`` and nodes' ``nic_gbps``), as constraints on a flow.

Every link already has its own capacity (an edge of the max-flow graph, :mod:`planner.graph`). A
shared capacity caps a *group* of links together, in bytes/s::

    sum over the group's links e of  bytes_e * f_e  <=  limit

where ``f_e`` is the link's flow in tokens/s and ``bytes_e`` is ``activation_bytes`` between nodes and
``token_bytes`` on the coordinator's links (token ids out, sampled tokens back). The groups
(:func:`shared_capacities`):

* ``region R uplink``: every link from a vertex in R to a vertex in another region (both ends with a
  region; the coordinator counts in its ``region``, none = no region boundary), the coordinator's too;
* ``region R downlink``: every link into R from another region;
* ``node N NIC out`` / ``node N NIC in``: every link leaving / entering node N.

They are side constraints, not vertices: merging the links of different hand-offs into one vertex
would let flow leave a node for one it may not hand off to (a path that skips layers), so the max
flow with them is an LP. :func:`restricted` solves it (HiGHS, through :mod:`planner.solvers`) and
returns the graph with grouped links' capacities lowered to their flows in that LP: a plain max flow
of that graph is the constrained max flow (the LP's flow fits it; any flow of it keeps every group
within its limit), so networkx's flows and min cut keep working on it. The graph module only calls
it when networkx's own max flow overloads a group. Without shared capacities nothing here runs.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import networkx as nx

from helix.errors import HelixError
from helix.units import gbps_to_bytes_per_s
from planner.capacity import CapacityModel

K = TypeVar("K", bound=Hashable)

SHARED_TOLERANCE = 1e-6  # relative: a group's load may exceed its limit by this much (solver round-off)
LP_ZERO = 1e-9  # an LP flow below this share of the unshared max flow is the solver's round-off: none


@dataclass(slots=True, frozen=True)
class SharedCapacity(Generic[K]):
    """One capacity a group of links shares: ``bytes_per_s`` over ``edges`` (edge key, bytes a token)."""

    what: str  # "region us-east uplink", "node t4-0 NIC in"
    bytes_per_s: float
    edges: tuple[tuple[K, int], ...]

    def load(self, flow: Mapping[K, float]) -> float:
        """Bytes/s the group carries under ``flow`` (tokens/s per edge key; missing keys carry none)."""
        return sum(nbytes * flow.get(key, 0.0) for key, nbytes in self.edges)

    def overloaded(self, flow: Mapping[K, float]) -> bool:
        return self.load(flow) > self.bytes_per_s * (1 + SHARED_TOLERANCE)


def shared_capacities(cap: CapacityModel, links: Iterable[tuple[K, str, str]]) -> list[SharedCapacity[K]]:
    """The groups over ``links`` (``(key, src, dst)``, ends cluster vertex ids: nodes or the coordinator)
    that some shared capacity caps; a group no link of ``links`` belongs to is left out."""
    if not cap.has_shared_links:
        return []
    coord = cap.coordinator
    limits: dict[str, float] = {}
    groups: dict[str, list[tuple[K, int]]] = {}

    def join(what: str, gbps: float | None, key: K, nbytes: int) -> None:
        if gbps is not None:
            limits[what] = gbps_to_bytes_per_s(gbps)
            groups.setdefault(what, []).append((key, nbytes))

    for key, src, dst in links:
        nbytes = cap.token_bytes if coord in (src, dst) else cap.activation_bytes
        if cap.crosses_regions(src, dst):
            rs, rd = cap.vertex_region(src), cap.vertex_region(dst)
            join(f"region {rs} uplink", cap.region_uplink_gbps.get(rs or ""), key, nbytes)
            join(f"region {rd} downlink", cap.region_downlink_gbps.get(rd or ""), key, nbytes)
        if src != coord:
            join(f"node {src} NIC out", cap.node_nic_gbps.get(src), key, nbytes)
        if dst != coord:
            join(f"node {dst} NIC in", cap.node_nic_gbps.get(dst), key, nbytes)
    return [SharedCapacity(what, limits[what], tuple(edges)) for what, edges in groups.items()]


def graph_edge_flows(flow: Mapping[str, Mapping[str, float]],
                     rows: list[SharedCapacity[tuple[str, str]]]) -> dict[tuple[str, str], float]:
    """networkx's flow dict on the grouped edges, keyed ``(u, v)``."""
    return {(u, v): flow[u][v] for row in rows for (u, v), _ in row.edges}


def restricted(g: nx.DiGraph, rows: list[SharedCapacity[tuple[str, str]]], source: str, sink: str,
               unshared_value: float) -> tuple[nx.DiGraph, nx.DiGraph]:
    """``g`` restricted to the max-flow LP with ``rows`` (module docstring), twice: with the edges of the
    groups the LP fills lowered to their LP flows (each carries ``shared=<the group>``), and with every
    grouped edge lowered. Both have the LP's max flow; only the second keeps *every* flow of it within
    the groups (a flow of the first may overload a group the LP left slack), but the first's min cut
    names the groups that bind. ``unshared_value``: ``g``'s max flow without the groups (no edge of an
    optimal flow carries more)."""
    from planner.solvers import Model  # HiGHS only when a group binds

    edges = list(g.edges(data="capacity"))
    idx = {(u, v): j for j, (u, v, _) in enumerate(edges)}
    scale = unshared_value  # solved in units of the unshared max flow: every column in [0, 1]
    m = Model(maximize=True)
    for u, _, c in edges:
        m.add_col(0.0, min(1.0, float(c) / scale) if c is not None else 1.0, cost=1.0 if u == source else 0.0)
    for v in g.nodes:
        if v in (source, sink):
            continue
        ins = [idx[(u, v)] for u in g.predecessors(v)]
        outs = [idx[(v, w)] for w in g.successors(v)]
        m.add_row(ins + outs, [1.0] * len(ins) + [-1.0] * len(outs), 0.0, 0.0)
    for row in rows:
        unit = max(nbytes for _, nbytes in row.edges)
        m.add_row([idx[key] for key, _ in row.edges], [nbytes / unit for _, nbytes in row.edges],
                  hi=row.bytes_per_s / unit / scale)  # fmt: skip
    sol = m.solve(time_limit_s=60.0, threads=1)
    if sol.status != "optimal" or len(sol.x) != len(edges):
        raise HelixError(f"the max-flow LP with shared link capacities: HiGHS ended {sol.status}")
    # the solver's round-off (flows of 1e-12) would become capacities networkx's preflow-push trips on
    lp_flow = {key: (x if x > LP_ZERO else 0.0) * scale for key, j in idx.items() for x in (sol.x[j],)}
    full_only, every = g.copy(), g.copy()
    for row in rows:
        full = row.load(lp_flow) >= row.bytes_per_s * (1 - SHARED_TOLERANCE)
        for key, _ in row.edges:
            for out in (full_only, every) if full else (every,):
                data = out.edges[key]
                data["capacity"] = min(float(data["capacity"]), lp_flow[key])
                if full:
                    data["shared"] = row.what
    return full_only, every
