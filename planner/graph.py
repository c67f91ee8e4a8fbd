"""The max-flow abstraction of a placed cluster (Helix section 3.2), evaluated with networkx.

Vertices: the coordinator appears as ``SOURCE`` and ``SINK``; each compute node ``i`` as
``i/in`` -> ``i/out`` with capacity ``T_i(k_i)`` (tokens/s through the ``k_i`` layers it
holds). Edges, each with capacity = link bandwidth / bytes per token:

* ``SOURCE -> i/in`` when ``i`` holds layer 0 (token ids, ``token_bytes`` each);
* ``i/out -> SINK`` when ``i`` holds the last layer (sampled tokens, ``token_bytes`` each);
* ``i/out -> j/in`` when ``j`` holds the layer needed right after ``i``'s last one:
  ``s_j <= e_i < e_j`` with partial-layer hand-offs (``j`` runs only layers not yet run),
  ``e_i == s_j`` without (activations, ``hidden_size * dtype_bytes`` each).

If the coordinator has ``nic_gbps``, its NIC caps the total flow in each direction.
Capacities links share (a region's uplink / downlink, a node's NIC) are side constraints on the
flow, kept on the graph (``g.graph["shared"]``, :mod:`planner.shared_links`): when networkx's max
flow overloads one, the max flow is that of the graph :func:`planner.shared_links.restricted`
returns (:func:`flow_graph`), so no extra vertex appears and the flows stay links between nodes.
The max flow is the cluster's serving throughput for that placement; the min cut is its
bottleneck. The capacities come from the planning problem (:class:`planner.capacity.CapacityModel`);
a placement is any mapping of node id -> ``(start, end)`` (a :data:`helix.domain.Placement`, or a
plan file's ``placement``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import networkx as nx

from helix.errors import ConfigError
from helix.plan import FlowEdge, node_inflow
from helix.units import link_tokens_per_s
from planner.capacity import CapacityModel
from planner.shared_links import graph_edge_flows, restricted, shared_capacities

SOURCE = "__source__"
SINK = "__sink__"
_NIC_OUT = "__nic_out__"
_NIC_IN = "__nic_in__"


def hands_off(src_range: tuple[int, int], dst_range: tuple[int, int], partial_handoffs: bool) -> bool:
    """Whether a request leaving ``src`` can continue on ``dst`` (section 3.2, case 3)."""
    e_i = src_range[1]
    s_j, e_j = dst_range
    if partial_handoffs:
        return s_j <= e_i < e_j
    return e_i == s_j


def build_graph(cap: CapacityModel, placement: Mapping[str, tuple[int, int]], *,
                partial_handoffs: bool = True) -> nx.DiGraph:
    g = nx.DiGraph()
    coord = cap.coordinator
    src_v, sink_v = SOURCE, SINK
    if cap.nic_gbps is not None:
        nic = link_tokens_per_s(cap.nic_gbps, cap.token_bytes)
        g.add_edge(SOURCE, _NIC_OUT, capacity=nic)
        g.add_edge(_NIC_IN, SINK, capacity=nic)
        src_v, sink_v = _NIC_OUT, _NIC_IN
    for node, (start, end) in placement.items():
        g.add_edge(f"{node}/in", f"{node}/out", capacity=cap.node_capacity(node, end - start))
        if start == 0:
            c = cap.token_link_tok_s(coord, node)
            if c is not None:
                g.add_edge(src_v, f"{node}/in", capacity=c)
        if end == cap.num_layers:
            c = cap.token_link_tok_s(node, coord)
            if c is not None:
                g.add_edge(f"{node}/out", sink_v, capacity=c)
    for a, ra in placement.items():
        for b, rb in placement.items():
            if a != b and hands_off(ra, rb, partial_handoffs):
                c = cap.activation_link_tok_s(a, b)
                if c is not None:
                    g.add_edge(f"{a}/out", f"{b}/in", capacity=c)
    g.add_nodes_from([SOURCE, SINK])
    if cap.has_shared_links:
        g.graph["shared"] = shared_capacities(cap, (((u, v), _vertex_name(u, coord), _vertex_name(v, coord))
                                                    for u, v in g.edges if _is_link(u, v)))
    return g


def _is_link(u: str, v: str) -> bool:
    """Whether a graph edge is a link (not a node's compute edge nor the coordinator's NIC edges)."""
    if (u == SOURCE and v == _NIC_OUT) or (u == _NIC_IN and v == SINK):
        return False
    return not (u.endswith("/in") and v.endswith("/out") and u[:-3] == v[:-4])


def _max_flow(g: nx.DiGraph) -> tuple[float, dict[str, dict[str, float]], nx.DiGraph]:
    """The max flow of ``g`` within its shared capacities: value, flow dict and the graph it is a plain
    max flow of (``g`` itself unless a shared capacity binds)."""
    value, flow = nx.maximum_flow(g, SOURCE, SINK, flow_func=nx.algorithms.flow.preflow_push)
    rows = g.graph.get("shared")
    if not rows or value <= 0:
        return float(value), flow, g
    loads = graph_edge_flows(flow, rows)
    if not any(row.overloaded(loads) for row in rows):
        return float(value), flow, g
    full_only, every = restricted(g, rows, SOURCE, SINK, float(value))
    # not preflow-push: on capacities an LP wrote (saturated exactly, to the last bit) networkx's
    # preflow-push can overrun its height levels (IndexError); augmenting paths have no such state
    value, flow = nx.maximum_flow(full_only, SOURCE, SINK, flow_func=nx.algorithms.flow.edmonds_karp)
    if not any(row.overloaded(graph_edge_flows(flow, rows)) for row in rows):
        return float(value), flow, full_only
    value, flow = nx.maximum_flow(every, SOURCE, SINK, flow_func=nx.algorithms.flow.edmonds_karp)
    return float(value), flow, every


def flow_graph(cap: CapacityModel, placement: Mapping[str, tuple[int, int]], *,
               partial_handoffs: bool = True) -> nx.DiGraph:
    """The graph whose plain max flow and min cut are the placement's (:func:`build_graph`'s, restricted
    to the shared capacities' LP flows when one binds): what views of the min cut read."""
    return _max_flow(build_graph(cap, placement, partial_handoffs=partial_handoffs))[2]


@dataclass(slots=True)
class FlowResult:
    max_flow_tok_s: float
    flows: list[FlowEdge]
    bottleneck: list[str]


def _vertex_name(v: str, coord: str) -> str:
    if v in (SOURCE, SINK, _NIC_IN, _NIC_OUT):
        return coord
    return v.rsplit("/", 1)[0]


def flow_edges(edge_flows: Iterable[tuple[str, str, float]], coordinator: str, *, min_tok_s: float = 0.0) -> list[FlowEdge]:
    """Graph-edge flows as the plan's edges: links between nodes and to/from the coordinator
    (a node's own compute edge and the coordinator's NIC edges are not links)."""
    edges: list[FlowEdge] = []
    for u, v, f in edge_flows:
        if f <= min_tok_s or (u == SOURCE and v == _NIC_OUT) or (u == _NIC_IN and v == SINK):
            continue
        if u.endswith("/in") and v.endswith("/out") and u[:-3] == v[:-4]:
            continue
        edges.append(FlowEdge(src=_vertex_name(u, coordinator), dst=_vertex_name(v, coordinator), tok_s=float(f)))
    return edges


def evaluate(
    cap: CapacityModel, placement: Mapping[str, tuple[int, int]], *, partial_handoffs: bool = True,
    with_cut: bool = True,
) -> FlowResult:
    """Max flow of a placement, the flow on every node-to-node edge, and the min cut."""
    value, flow, g = _max_flow(build_graph(cap, placement, partial_handoffs=partial_handoffs))
    edges = flow_edges(((u, v, f) for u, outs in flow.items() for v, f in outs.items()), cap.coordinator)
    bottleneck = min_cut_description(g, cap) if with_cut and value > 0 else []
    return FlowResult(max_flow_tok_s=float(value), flows=edges, bottleneck=bottleneck)


def max_flow_value(cap: CapacityModel, placement: Mapping[str, tuple[int, int]], *,
                   partial_handoffs: bool = True) -> float:
    g = build_graph(cap, placement, partial_handoffs=partial_handoffs)
    if g.graph.get("shared"):
        return _max_flow(g)[0]
    return float(nx.maximum_flow_value(g, SOURCE, SINK, flow_func=nx.algorithms.flow.preflow_push))


def min_cut_description(g: nx.DiGraph, cap: CapacityModel) -> list[str]:
    """Human-readable edges of a minimum cut: the nodes and links that limit throughput."""
    # a graph with shared capacities may carry LP-written capacities: augmenting paths (see _max_flow)
    func = nx.algorithms.flow.edmonds_karp if g.graph.get("shared") else nx.algorithms.flow.preflow_push
    _, (reach, _) = nx.minimum_cut(g, SOURCE, SINK, flow_func=func)
    coord = cap.coordinator
    out: list[str] = []
    for u in reach:
        for v, data in g[u].items():
            if v in reach:
                continue
            c = data["capacity"]
            if u.endswith("/in") and v.endswith("/out"):
                out.append(f"node {u[:-3]} compute ({c:.1f} tok/s)")
            elif u == SOURCE and v == _NIC_OUT or u == _NIC_IN and v == SINK:
                out.append(f"coordinator NIC ({c:.1f} tok/s)")
            elif "shared" in data:
                out.append(f"link {_vertex_name(u, coord)} -> {_vertex_name(v, coord)} ({c:.1f} tok/s: {data['shared']} full)")
            else:
                out.append(f"link {_vertex_name(u, coord)} -> {_vertex_name(v, coord)} ({c:.1f} tok/s)")
    return sorted(out)


def check_flows(cap: CapacityModel, placement: Mapping[str, tuple[int, int]], flows: list[FlowEdge], *,
                partial_handoffs: bool = True) -> None:
    """Every flow runs on a valid edge and within its capacity, every group of links within the capacity it
    shares (the plan's capacity invariant)."""
    coord = cap.coordinator
    for i, e in enumerate(flows):
        if e.src == coord:
            c = cap.token_link_tok_s(coord, e.dst) if placement.get(e.dst, (1, 1))[0] == 0 else None
        elif e.dst == coord:
            c = cap.token_link_tok_s(e.src, coord) if placement.get(e.src, (0, 0))[1] == cap.num_layers else None
        elif e.src in placement and e.dst in placement and hands_off(placement[e.src], placement[e.dst], partial_handoffs):
            c = cap.activation_link_tok_s(e.src, e.dst)
        else:
            c = None
        if c is None:
            raise ConfigError(f"flow on {e.src} -> {e.dst}, which is not a valid edge of this placement", field=f"flows[{i}]")
        if e.tok_s > c * (1 + 1e-6):
            raise ConfigError(f"flow {e.tok_s:.6g} on {e.src} -> {e.dst} exceeds its capacity {c:.6g}", field=f"flows[{i}]")
    for node, f in node_inflow(flows, coord).items():
        start, end = placement[node]
        c = cap.node_capacity(node, end - start)
        if f > c * (1 + 1e-6):
            raise ConfigError(f"flow {f:.6g} through node {node} exceeds its capacity {c:.6g}", field="flows")
    on_flow = {i: e.tok_s for i, e in enumerate(flows)}
    for row in shared_capacities(cap, ((i, e.src, e.dst) for i, e in enumerate(flows))):
        if row.overloaded(on_flow):
            raise ConfigError(f"flows across the {row.what} carry {row.load(on_flow) * 8 / 1e9:.6g} Gbit/s, more than its "
                              f"{row.bytes_per_s * 8 / 1e9:.6g}", field="flows")
