"""The optimizer's view of one planning problem: nodes, GPU types, capacity and KV tables.

:class:`Instance` is built once per ``optimize`` call from a ClusterSpec + ProfileSet (through
``planner.graph.CapacityModel``) and holds everything the search needs as plain lists, so the
inner loops never touch pydantic objects:

* per GPU type (nodes with their own ``max_layers`` cap form a type of their own): ``tok_s[k-1]`` (the paper's node capacity ``T(k)``), ``max_layers``,
  ``kv_entries[k-1]`` (KV entries - one token in one layer - that fit next to ``k`` layers;
  from ``kv_capacity_tokens_by_layers`` or, when absent, from VRAM minus weights) and the
  latency curves when the profile has both per-layer ones (``curves``, read by
  :mod:`helix.perf_model`, with the optional per-step costs and context cost) and the batch
  limits of one iteration (``decode_max_batch``, ``prompt_max_tokens``);
* per node: its GPU type and region; per directed link: tokens/s and latency.

``coverage`` is the network-free relaxation used throughout: the tokens/s each layer gets
from the nodes holding it. With fast links and partial hand-offs the exact max flow equals
its minimum (every source-sink path passes a node holding layer l, so min_l coverage bounds
the max flow, and the bound is attained when links do not bind; checked in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helix.perf_model import NodeCurves
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner.graph import CapacityModel

Placement = dict[str, tuple[int, int]]

KV_VRAM_USABLE = 0.9  # share of VRAM usable for weights + KV when no KV table is profiled


@dataclass(slots=True)
class GpuType:
    name: str
    max_layers: int
    tok_s: list[float]
    kv_entries: list[float]
    curves: NodeCurves | None  # None: the profile gives tok_s without both per-layer curves
    decode_max_batch: list[int] | None
    prompt_max_tokens: list[int] | None = None  # prompt tokens one iteration may carry, by layers held


@dataclass(slots=True)
class Instance:
    cap: CapacityModel
    num_layers: int
    coordinator: str
    nodes: list[str]
    gpu_of: dict[str, str]
    region_of: dict[str, str | None]
    gpus: dict[str, GpuType]
    type_nodes: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def build(cls, cluster: ClusterSpec, profiles: ProfileSet) -> Instance:
        cap = CapacityModel.build(cluster, profiles)
        model = profiles.models[cluster.model]
        gpus: dict[str, GpuType] = {}
        type_of = {n.id: n.kind for n in cluster.nodes}
        for node in cluster.nodes:
            if type_of[node.id] in gpus:
                continue
            tp = profiles.throughput(node.gpu, cluster.model)
            top = cap.max_layers[node.id]
            if tp.kv_capacity_tokens_by_layers is not None:
                kv = [float(x) for x in tp.kv_capacity_tokens_by_layers]
            else:
                vram = profiles.gpus[node.gpu].vram_gb * 1e9 * KV_VRAM_USABLE
                kv = [
                    max(0.0, vram - k * model.layer_weight_bytes) / model.kv_bytes_per_token_per_layer
                    for k in range(1, tp.max_layers + 1)
                ]
            gpus[type_of[node.id]] = GpuType(
                name=type_of[node.id],
                max_layers=top,
                tok_s=cap.node_tok_s[node.id],
                kv_entries=kv[:top],
                curves=tp.curves(),
                decode_max_batch=list(tp.decode_max_tokens_by_layers[:top]) if tp.decode_max_tokens_by_layers else None,
                prompt_max_tokens=list(tp.prompt_max_tokens_by_layers[:top]) if tp.prompt_max_tokens_by_layers else None,
            )
        inst = cls(
            cap=cap,
            num_layers=cap.num_layers,
            coordinator=cap.coordinator,
            nodes=[n.id for n in cluster.nodes],
            gpu_of=type_of,
            region_of={n.id: n.region for n in cluster.nodes},
            gpus=gpus,
        )
        for n in inst.nodes:
            inst.type_nodes.setdefault(inst.gpu_of[n], []).append(n)
        return inst

    # -- capacities --------------------------------------------------------------------

    @property
    def types(self) -> list[str]:
        return sorted(self.type_nodes)

    def counts(self) -> dict[str, int]:
        return {t: len(v) for t, v in self.type_nodes.items()}

    def node_tok_s(self, node: str, layers: int) -> float:
        return self.gpus[self.gpu_of[node]].tok_s[layers - 1]

    def max_layers(self, node: str) -> int:
        return self.gpus[self.gpu_of[node]].max_layers

    def coverage(self, placement: Placement) -> list[float]:
        """tokens/s each layer gets from the nodes holding it (the network-free relaxation)."""
        cov = [0.0] * self.num_layers
        for node, (s, e) in placement.items():
            t = self.node_tok_s(node, e - s)
            for layer in range(s, e):
                cov[layer] += t
        return cov

    def coverage_min(self, placement: Placement) -> float:
        return min(self.coverage(placement)) if placement else 0.0

    def latency_ms(self, src: str, dst: str) -> float | None:
        return self.cap.latency_ms.get((src, dst))

    def regions(self) -> list[str | None]:
        seen: list[str | None] = []
        for n in self.nodes:
            if self.region_of[n] not in seen:
                seen.append(self.region_of[n])
        return seen

    def links_uniform(self) -> bool:
        """True when every node pair and coordinator link exists with one bandwidth (links never
        restrict which node may follow which)."""
        bws = set(self.cap.links.values())
        n = len(self.nodes)
        return len(bws) == 1 and len(self.cap.links) >= n * (n - 1) + 2 * n

    # -- derived instances ---------------------------------------------------------------

    def subset(self, nodes: list[str]) -> Instance:
        """The same problem restricted to ``nodes`` (e.g. one region)."""
        keep = set(nodes)
        inst = Instance(
            cap=self.cap,
            num_layers=self.num_layers,
            coordinator=self.coordinator,
            nodes=[n for n in self.nodes if n in keep],
            gpu_of={n: g for n, g in self.gpu_of.items() if n in keep},
            region_of={n: r for n, r in self.region_of.items() if n in keep},
            gpus=self.gpus,
        )
        for n in inst.nodes:
            inst.type_nodes.setdefault(inst.gpu_of[n], []).append(n)
        return inst

    def pruned(self, frac: float) -> Instance:
        """Drop the slowest ``frac`` of every node's outgoing node-to-node links (ties: higher
        latency first, then name), as the paper's cluster pruning does; coordinator links stay."""
        import math
        from dataclasses import replace

        if not 0.0 < frac < 1.0:
            return self
        coord, cap = self.coordinator, self.cap
        keep: dict[tuple[str, str], float] = {}
        by_src: dict[str, list[tuple[str, str]]] = {}
        for (a, b), bw in cap.links.items():
            if coord in (a, b):
                keep[(a, b)] = bw
            else:
                by_src.setdefault(a, []).append((a, b))
        for edges in by_src.values():
            edges.sort(key=lambda e: (-cap.links[e], cap.latency_ms.get(e, 0.0), e[1]))
            for e in edges[: max(1, math.ceil(len(edges) * (1.0 - frac)))]:
                keep[e] = cap.links[e]
        new_cap = replace(cap, links=keep, latency_ms={e: cap.latency_ms.get(e, 0.0) for e in keep})
        inst = self.subset(self.nodes)
        inst.cap = new_cap
        return inst
