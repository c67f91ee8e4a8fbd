"""The planning problem: what every node and link of a cluster can carry, built once per cluster.

:class:`CapacityModel` is what every planner module reads (the max-flow graph, the paper's MILP,
the baselines, the bounds, the stage patterns, the local search, the serving model), built from a
ClusterSpec + ProfileSet by :meth:`CapacityModel.build` and held as plain dicts and lists, so the
inner loops never touch pydantic objects:

* per node: ``node_tok_s[node][k-1]`` (the paper's node capacity ``T_i(k)``, tokens/s through
  ``k`` layers), ``max_layers[node]``, its GPU type (``gpu_of``), its kind (``kind_of``) and region;
* per kind (:class:`NodeKind`: nodes of one GPU type and layer cap are interchangeable): the same
  ``tok_s`` table, ``kv_entries[k-1]`` (KV entries - one token in one layer - that fit next to
  ``k`` layers; from ``kv_capacity_tokens_by_layers`` or, when absent, from VRAM minus weights),
  the latency curves when the profile has both per-layer ones (``curves``, read by
  :mod:`helix.perf_model`) and the batch limits of one iteration;
* per directed link: bandwidth (``links``) and latency; the coordinator's NIC; the bytes of a
  token id and of one token's activations;
* the capacities links share (the cluster file's ``regions`` and nodes' ``nic_gbps``): a region's
  uplink / downlink caps the total of its links to / from other regions, a node's NIC the total of
  its links each way (:meth:`~CapacityModel.region_uplink_tok_s`, :meth:`~CapacityModel.node_nic_tok_s`;
  :mod:`planner.shared_links` turns them into constraints on the flows);
* the cluster's fine-tuned tasks (``task_mix``: PET type -> tasks of it, from the cluster file's
  ``tasks:``), whose per-task cost the serving model prices (their memory is already out of the
  profiles' KV and layer limits: :mod:`helix.task_memory`).

``coverage`` is the network-free relaxation used throughout: the tokens/s each layer gets from
the nodes holding it. With fast links and partial hand-offs the exact max flow equals its
minimum (every source-sink path passes a node holding layer l, so min_l coverage bounds the max
flow, and the bound is attained when links do not bind; checked in the tests).

:meth:`~CapacityModel.subset` (one region's nodes) and :meth:`~CapacityModel.pruned` (the
paper's link pruning) derive smaller problems.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TypeVar

from helix.domain import Placement
from helix.errors import ConfigError
from helix.perf_model import NodeCurves
from helix.profile import ModelProfile, ProfileSet, ThroughputProfile, node_max_layers
from helix.spec import ClusterSpec
from helix.task_memory import task_memory
from helix.units import link_tokens_per_s

V = TypeVar("V")

KV_VRAM_USABLE = 0.9  # share of VRAM usable for weights + KV when no KV table is profiled


@dataclass(slots=True, frozen=True)
class NodeKind:
    """One kind of node (GPU type and layer cap): its tables, up to its ``max_layers``."""

    name: str
    max_layers: int
    tok_s: list[float]
    kv_entries: list[float]
    curves: NodeCurves | None  # None: the profile gives tok_s without both per-layer curves
    decode_max_batch: list[int] | None
    prompt_max_tokens: list[int] | None = None  # prompt tokens one iteration may carry, by layers held

    @classmethod
    def build(cls, name: str, tp: ThroughputProfile, top: int, tok_s: list[float], vram_gb: float,
              model: ModelProfile) -> NodeKind:
        """The kind's tables from its GPU's profile, cut at ``top`` layers (the kind's cap)."""
        if tp.kv_capacity_tokens_by_layers is not None:
            kv = [float(x) for x in tp.kv_capacity_tokens_by_layers]
        else:
            vram = vram_gb * 1e9 * KV_VRAM_USABLE
            kv = [
                max(0.0, vram - k * model.layer_weight_bytes) / model.kv_bytes_per_token_per_layer
                for k in range(1, tp.max_layers + 1)
            ]
        return cls(
            name=name,
            max_layers=top,
            tok_s=tok_s,
            kv_entries=kv[:top],
            curves=tp.curves(),
            decode_max_batch=list(tp.decode_max_tokens_by_layers[:top]) if tp.decode_max_tokens_by_layers else None,
            prompt_max_tokens=list(tp.prompt_max_tokens_by_layers[:top]) if tp.prompt_max_tokens_by_layers else None,
        )


@dataclass(slots=True, frozen=True)
class CapacityModel:
    """One planning problem: the cluster's nodes, kinds and links as the planner reads them."""

    coordinator: str
    num_layers: int
    nodes: list[str]  # in the cluster file's order
    node_tok_s: dict[str, list[float]]  # node -> tok_s[k-1]
    max_layers: dict[str, int]
    gpu_of: dict[str, str]  # node -> GPU type
    kind_of: dict[str, str]  # node -> kind (GPU type and layer cap, helix.spec.NodeSpec.kind)
    region_of: dict[str, str | None]
    kinds: dict[str, NodeKind]
    kind_nodes: dict[str, list[str]]  # kind -> its nodes, in the cluster's order
    links: dict[tuple[str, str], float]  # (src, dst) -> bandwidth_gbps
    latency_ms: dict[tuple[str, str], float]
    token_bytes: int
    activation_bytes: int
    nic_gbps: float | None
    task_mix: dict[str, int] = field(default_factory=dict)  # PET type -> the cluster's tasks of it; empty: none
    coordinator_region: str | None = None  # None: the same region as every node
    region_uplink_gbps: dict[str, float] = field(default_factory=dict)  # region -> its uplink; absent: none shared
    region_downlink_gbps: dict[str, float] = field(default_factory=dict)  # region -> its downlink
    node_nic_gbps: dict[str, float] = field(default_factory=dict)  # node -> its NIC (each way); absent: no cap

    @classmethod
    def build(cls, cluster: ClusterSpec, profiles: ProfileSet) -> CapacityModel:
        model = profiles.models[cluster.model]
        node_tok_s: dict[str, list[float]] = {}
        max_layers: dict[str, int] = {}
        tables: dict[str, list[float]] = {}
        kinds: dict[str, NodeKind] = {}
        for node in cluster.nodes:
            tp = profiles.throughput(node.gpu, cluster.model)
            if node.gpu not in tables:
                tables[node.gpu] = tp.tok_s_table(model)
            max_layers[node.id] = node_max_layers(node, tp)
            node_tok_s[node.id] = tables[node.gpu][: max_layers[node.id]]
            if node.kind not in kinds:
                kinds[node.kind] = NodeKind.build(node.kind, tp, max_layers[node.id], node_tok_s[node.id],
                                                  profiles.gpus[node.gpu].vram_gb, model)
        resolved = cluster.resolved_links()
        nodes = [n.id for n in cluster.nodes]
        kind_of = {n.id: n.kind for n in cluster.nodes}
        tasks = task_memory(cluster, model.num_layers, model.dtype_bytes)
        return cls(
            coordinator=cluster.coordinator.id,
            num_layers=model.num_layers,
            nodes=nodes,
            node_tok_s=node_tok_s,
            max_layers=max_layers,
            gpu_of={n.id: n.gpu for n in cluster.nodes},
            kind_of=kind_of,
            region_of={n.id: n.region for n in cluster.nodes},
            kinds=kinds,
            kind_nodes=_kind_nodes(nodes, kind_of),
            links={k: v.bandwidth_gbps for k, v in resolved.items()},
            latency_ms={k: v.latency_ms for k, v in resolved.items()},
            token_bytes=model.token_bytes,
            activation_bytes=model.activation_bytes_per_token,
            nic_gbps=cluster.coordinator.nic_gbps,
            task_mix=dict(tasks.pet_types) if tasks is not None else {},
            coordinator_region=cluster.coordinator.region,
            region_uplink_gbps={r: spec.up_gbps for r, spec in cluster.regions.items()},
            region_downlink_gbps={r: spec.down_gbps for r, spec in cluster.regions.items()},
            node_nic_gbps={n.id: n.nic_gbps for n in cluster.nodes if n.nic_gbps is not None},
        )

    # -- nodes and kinds ---------------------------------------------------------------------

    def node_capacity(self, node: str, layers: int) -> float:
        """``T_i(k)``: tokens/s through ``node`` holding ``layers`` layers."""
        return self.node_tok_s[node][layers - 1]

    def kind(self, node: str) -> NodeKind:
        return self.kinds[self.kind_of[node]]

    @property
    def kind_names(self) -> list[str]:
        """The kinds of this problem's nodes, sorted."""
        return sorted(self.kind_nodes)

    def kind_counts(self) -> dict[str, int]:
        return {t: len(v) for t, v in self.kind_nodes.items()}

    def regions(self) -> list[str | None]:
        seen: list[str | None] = []
        for n in self.nodes:
            if self.region_of[n] not in seen:
                seen.append(self.region_of[n])
        return seen

    def coverage(self, placement: Placement) -> list[float]:
        """tokens/s each layer gets from the nodes holding it (the network-free relaxation)."""
        cov = [0.0] * self.num_layers
        for node, (s, e) in placement.items():
            t = self.node_capacity(node, e - s)
            for layer in range(s, e):
                cov[layer] += t
        return cov

    def coverage_min(self, placement: Placement) -> float:
        return min(self.coverage(placement)) if placement else 0.0

    # -- links -------------------------------------------------------------------------------

    def token_link_tok_s(self, src: str, dst: str) -> float | None:
        bw = self.links.get((src, dst))
        return None if bw is None else link_tokens_per_s(bw, self.token_bytes)

    def activation_link_tok_s(self, src: str, dst: str) -> float | None:
        bw = self.links.get((src, dst))
        return None if bw is None else link_tokens_per_s(bw, self.activation_bytes)

    def link_latency_ms(self, src: str, dst: str) -> float | None:
        return self.latency_ms.get((src, dst))

    # -- capacities links share --------------------------------------------------------------
    #
    # In tokens/s of activations (``activation_bytes`` a token), as the node-to-node links are. The
    # traffic they cap is counted in bytes: activations at ``activation_bytes`` a token, the
    # coordinator's token ids and sampled tokens at ``token_bytes`` (planner.shared_links).

    def vertex_region(self, vertex: str) -> str | None:
        """A node's region, or the coordinator's."""
        return self.coordinator_region if vertex == self.coordinator else self.region_of.get(vertex)

    def crosses_regions(self, src: str, dst: str) -> bool:
        """Whether traffic ``src -> dst`` leaves one region for another (both ends have a region and they
        differ); it then counts in the uplink of ``src``'s region and the downlink of ``dst``'s."""
        rs, rd = self.vertex_region(src), self.vertex_region(dst)
        return rs is not None and rd is not None and rs != rd

    def region_uplink_tok_s(self, region: str | None) -> float | None:
        """Tokens/s of activations all links from ``region`` to other regions carry together; None: no shared
        uplink (each link carries its own bandwidth)."""
        bw = self.region_uplink_gbps.get(region) if region is not None else None
        return None if bw is None else link_tokens_per_s(bw, self.activation_bytes)

    def region_downlink_tok_s(self, region: str | None) -> float | None:
        """Tokens/s of activations all links into ``region`` from other regions carry together; None: none shared."""
        bw = self.region_downlink_gbps.get(region) if region is not None else None
        return None if bw is None else link_tokens_per_s(bw, self.activation_bytes)

    def node_nic_tok_s(self, node: str) -> float | None:
        """Tokens/s of activations a node's NIC carries each way (all its links in, all its links out, together);
        None: no NIC cap. The coordinator's NIC is ``nic_gbps`` (token ids, a cap of its own)."""
        bw = self.node_nic_gbps.get(node)
        return None if bw is None else link_tokens_per_s(bw, self.activation_bytes)

    @property
    def has_shared_links(self) -> bool:
        """Whether any region uplink/downlink or node NIC caps a group of links."""
        return bool(self.region_uplink_gbps or self.region_downlink_gbps or self.node_nic_gbps)

    def links_uniform(self) -> bool:
        """True when every node pair and coordinator link exists with one bandwidth and no capacity is
        shared (links never restrict which node may follow which)."""
        bws = set(self.links.values())
        n = len(self.nodes)
        return not self.has_shared_links and len(bws) == 1 and len(self.links) >= n * (n - 1) + 2 * n

    # -- derived problems --------------------------------------------------------------------

    def subset(self, nodes: list[str]) -> CapacityModel:
        """The same problem restricted to ``nodes`` (e.g. one region); links and kinds stay whole."""
        keep = set(nodes)
        kept = [n for n in self.nodes if n in keep]
        return replace(self, nodes=kept, node_tok_s=_only(self.node_tok_s, keep),
                       max_layers=_only(self.max_layers, keep),
                       gpu_of=_only(self.gpu_of, keep), kind_of=_only(self.kind_of, keep),
                       region_of=_only(self.region_of, keep), kind_nodes=_kind_nodes(kept, self.kind_of),
                       node_nic_gbps=_only(self.node_nic_gbps, keep))  # fmt: skip

    def pruned(self, frac: float) -> CapacityModel:
        """Drop the slowest ``frac`` of every node's outgoing node-to-node links (coordinator links
        stay), as the paper's cluster pruning does. Ties (equal bandwidth) go by higher latency
        first, then by name, so the result is deterministic. ``frac = 0`` keeps everything."""
        if not 0.0 <= frac < 1.0:
            raise ConfigError(f"link pruning fraction must be in [0, 1), got {frac}", field="--prune-links")
        if frac == 0.0:
            return self
        coord = self.coordinator
        keep: dict[tuple[str, str], float] = {}
        by_src: dict[str, list[tuple[str, str]]] = {}
        for (a, b), bw in self.links.items():
            if coord in (a, b):
                keep[(a, b)] = bw
            else:
                by_src.setdefault(a, []).append((a, b))
        for edges in by_src.values():
            edges.sort(key=lambda e: (-self.links[e], self.latency_ms.get(e, 0.0), e[1]))
            for e in edges[: max(1, math.ceil(len(edges) * (1.0 - frac)))]:
                keep[e] = self.links[e]
        return replace(self, links=keep, latency_ms={e: self.latency_ms.get(e, 0.0) for e in keep})


def _only(table: dict[str, V], keep: set[str]) -> dict[str, V]:
    return {n: v for n, v in table.items() if n in keep}


def _kind_nodes(nodes: list[str], kind_of: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in nodes:
        out.setdefault(kind_of[n], []).append(n)
    return out
