"""The cluster file (``clusters/*.yaml``): nodes, coordinator, links, link defaults and regions.

:class:`ClusterSpec` is the contract of DESIGN.md. :func:`load_cluster` reads and validates
one file; :meth:`ClusterSpec.resolved_links` expands ``defaults`` into the full set of
directed links (explicit links win). Capacities several links share - a region's uplink and
downlink to the other regions (``regions``), a node's NIC (``nic_gbps``) - cap the sum of
those links' traffic on top of each link's own bandwidth. Validation errors name the file and
the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from helix.errors import ConfigError
from helix.keys import check_z85_key
from helix.loading import load_model
from helix.tasks import TaskSpec

COORDINATOR_DEFAULT_ID = "coordinator"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CoordinatorSpec(_Strict):
    """The coordinator: source of token ids and sink of sampled tokens."""

    id: str = Field(default=COORDINATOR_DEFAULT_ID, description="the name links use for the coordinator")
    nic_gbps: float | None = Field(
        default=None, gt=0, description="Gbit/s (10^9 bits/s): caps the coordinator's total traffic each way; absent: no cap"
    )
    region: str | None = Field(default=None, description="region for `defaults` (absent: same region as every node)")
    address: str | None = Field(
        default=None,
        description='where agents send tokens, e.g. "tcp://10.0.0.2:5550" (`helix serve` binds its result sink on this '
        "host, port `*`: any); agents send results to no other host (absent: loopback)",
    )
    public_key: str | None = Field(
        default=None, description="the coordinator's CURVE public key (40 Z85 characters; `helix keys` writes it); "
        "see `keys_dir`",
    )

    @field_validator("public_key")
    @classmethod
    def _z85(cls, key: str | None) -> str | None:
        return key if key is None else check_z85_key(key)


class NodeSpec(_Strict):
    """One compute node (one GPU, or one CPU process in the local demo)."""

    id: str = Field(min_length=1, description="any name, unique in the cluster (not the coordinator's)")
    gpu: str = Field(min_length=1, description="GPU type: a key of `gpus` in the profiles")
    region: str | None = Field(
        default=None, description="any name; `defaults` link nodes of one region by `intra_region`, others by `inter_region`"
    )
    address: str | None = Field(
        default=None,
        description='where the node\'s agent listens, e.g. "tcp://10.0.0.7:5555" (absent: a loopback port); its data '
        "socket binds the same host, and peers send it activations on no other host",
    )
    public_key: str | None = Field(
        default=None, description="the node's CURVE public key (40 Z85 characters; `helix keys` writes it); see `keys_dir`"
    )
    max_layers: int | None = Field(
        default=None, gt=0,
        description="layers: hold at most this many; may only lower the GPU profile's `max_layers` (higher is an error)",
    )
    nic_gbps: float | None = Field(
        default=None, gt=0,
        description="Gbit/s (10^9 bits/s): the node's NIC; caps the total of its links each way (activations and "
        "tokens in, activations and tokens out); absent: no cap beyond each link's own",
    )
    backend: Literal["torch", "vllm"] = Field(
        default="torch",
        description="what runs the node's layers: `torch` (Helix's engine) or `vllm` (vLLM's layers; needs vLLM "
        "installed on the node, see docs/gpu.md); `helix agent --backend` overrides it",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="weights, activations and KV cache on the node; `helix agent --dtype` overrides it"
    )
    device: Literal["cpu", "cuda"] = Field(
        default="cpu",
        description="where the node computes (`cuda`: its GPU; the vLLM backend needs the device its vLLM build "
        "runs on); `helix agent --device` overrides it",
    )

    @field_validator("public_key")
    @classmethod
    def _z85(cls, key: str | None) -> str | None:
        return key if key is None else check_z85_key(key)

    @property
    def kind(self) -> str:
        """Nodes of the same kind (GPU type and layer cap) are interchangeable for the planner."""
        return self.gpu if self.max_layers is None else f"{self.gpu}<={self.max_layers}"


class LinkParams(_Strict):
    """A link's speed (also the form of `defaults.intra_region` / `defaults.inter_region`)."""

    bandwidth_gbps: float = Field(gt=0, description="Gbit/s: 10^9 bits per second")
    latency_ms: float = Field(default=0.0, ge=0, description="milliseconds, one way")


class LinkSpec(LinkParams):
    """An explicit link; ``bidirectional`` adds the reverse direction with the same numbers."""

    src: str = Field(description="a node id or the coordinator's id: where data leaves")
    dst: str = Field(description="a node id or the coordinator's id: where data arrives")
    bidirectional: bool = Field(default=False, description="also add dst -> src with the same numbers")


class LinkDefaults(_Strict):
    """Links for every pair not listed explicitly; absent means not connected."""

    intra_region: LinkParams | None = Field(
        default=None, description="every unlisted pair in one region (or where either has no region); absent: not connected"
    )
    inter_region: LinkParams | None = Field(
        default=None, description="every unlisted pair in two different regions; absent: not connected"
    )


class RegionSpec(_Strict):
    """A region's shared connection to the other regions: every link leaving the region for another
    one shares `uplink_gbps`, every link entering it from another one shares `downlink_gbps`."""

    uplink_gbps: float | None = Field(
        default=None, gt=0,
        description="Gbit/s (10^9 bits/s): total traffic from this region to all other regions; absent: "
        "`downlink_gbps`",
    )
    downlink_gbps: float | None = Field(
        default=None, gt=0,
        description="Gbit/s: total traffic into this region from all other regions; absent: `uplink_gbps`",
    )

    @model_validator(mode="after")
    def _one_given(self) -> RegionSpec:
        if self.uplink_gbps is None and self.downlink_gbps is None:
            raise ValueError("give uplink_gbps or downlink_gbps (or both)")
        return self

    @property
    def up_gbps(self) -> float:
        """The uplink in Gbit/s (the downlink when only that is given)."""
        value = self.uplink_gbps if self.uplink_gbps is not None else self.downlink_gbps
        assert value is not None  # _one_given
        return value

    @property
    def down_gbps(self) -> float:
        """The downlink in Gbit/s (the uplink when only that is given)."""
        value = self.downlink_gbps if self.downlink_gbps is not None else self.uplink_gbps
        assert value is not None  # _one_given
        return value


class ResolvedLink(_Strict):
    """A directed link after defaults were applied."""

    src: str
    dst: str
    bandwidth_gbps: float
    latency_ms: float


class ClusterSpec(_Strict):
    """A cluster file. ``profiles`` paths are relative to the file itself."""

    name: str = Field(description="the cluster's name (plans carry it)")
    model: str = Field(description="the model to serve: a key of `models` in the profiles")
    profiles: str | list[str] = Field(
        description="profiles file(s), relative to this file; several are merged (a later file wins per GPU and model)"
    )
    coordinator: CoordinatorSpec = Field(default=CoordinatorSpec(), description="the coordinator (all its fields have defaults)")
    nodes: list[NodeSpec] = Field(min_length=1, description="the compute nodes, one per GPU")
    links: list[LinkSpec] = Field(default=[], description="explicit directed links; they win over `defaults`")
    defaults: LinkDefaults | None = Field(
        default=None, description="links for every pair not in `links`; absent: only listed links exist"
    )
    regions: dict[str, RegionSpec] = Field(
        default={},
        description="per region (a `region` of the nodes or the coordinator): the uplink and downlink its links to "
        "other regions share; a region not listed (or no table): each link carries its own bandwidth, no more",
    )
    tasks: list[TaskSpec] = Field(
        default=[], description="fine-tuned tasks of `model` served from start (docs/pets.md); more can be loaded "
        "and unloaded at runtime through the coordinator"
    )

    keys_dir: str | None = Field(
        default=None,
        description="directory of CURVE public certificates `<id>.key` (relative to this file; `helix keys` writes "
        "them); with it or any `public_key`, every socket is encrypted and authenticated (docs/gpu.md); a `public_key` "
        "wins; absent with no `public_key`: no CURVE",
    )

    _source: str = PrivateAttr(default="<cluster>")

    @model_validator(mode="after")
    def _check_ids(self) -> ClusterSpec:
        seen: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if node.id == self.coordinator.id:
                raise ValueError(f"nodes[{i}].id: {node.id!r} is the coordinator's id")
            if node.id in seen:
                raise ValueError(f"nodes[{i}].id: duplicate id {node.id!r} (also nodes[{seen[node.id]}])")
            seen[node.id] = i
        known = set(seen) | {self.coordinator.id}
        for i, link in enumerate(self.links):
            for end in ("src", "dst"):
                if getattr(link, end) not in known:
                    raise ValueError(f"links[{i}].{end}: unknown node {getattr(link, end)!r}")
            if link.src == link.dst:
                raise ValueError(f"links[{i}]: a link from {link.src!r} to itself")
        used = {n.region for n in self.nodes} | {self.coordinator.region}
        for name in self.regions:
            if name not in used:
                known_regions = sorted(r for r in used if r is not None)
                raise ValueError(f"regions.{name}: no node or coordinator is in region {name!r} "
                                 f"(regions: {', '.join(known_regions) or 'none'})")
        names: dict[str, int] = {}
        for i, task in enumerate(self.tasks):
            if task.name in names:
                raise ValueError(f"tasks[{i}].name: duplicate task {task.name!r} (also tasks[{names[task.name]}])")
            if task.name == self.model:
                raise ValueError(f"tasks[{i}].name: {task.name!r} is the base model's name")
            names[task.name] = i
        return self

    def task_paths(self) -> list[tuple[str, str]]:
        """``(name, directory)`` of every task in `tasks`, directories resolved against this file's folder."""
        base = Path(self.source).parent
        return [(t.name, str((base / t.path).resolve())) for t in self.tasks]

    # -- derived views -------------------------------------------------------------------

    @property
    def source(self) -> str:
        """The file this cluster was loaded from (for error messages)."""
        return self._source

    @property
    def node_ids(self) -> list[str]:
        return [n.id for n in self.nodes]

    def node(self, node_id: str) -> NodeSpec:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise ConfigError(f"unknown node {node_id!r}", source=self.source, field="nodes")

    def region_of(self, vertex: str) -> str | None:
        if vertex == self.coordinator.id:
            return self.coordinator.region
        return self.node(vertex).region

    def crosses_regions(self, src: str, dst: str) -> bool:
        """Whether traffic ``src -> dst`` leaves one region for another (both ends have a region, and they
        differ): it then counts in ``regions``' uplink of the one and downlink of the other."""
        rs, rd = self.region_of(src), self.region_of(dst)
        return rs is not None and rd is not None and rs != rd

    def profile_paths(self) -> list[Path]:
        base = Path(self.source).parent
        names = [self.profiles] if isinstance(self.profiles, str) else self.profiles
        return [base / p for p in names]

    def resolved_links(self) -> dict[tuple[str, str], ResolvedLink]:
        """Every directed link: explicit ones, then defaults for the remaining pairs."""
        out: dict[tuple[str, str], ResolvedLink] = {}
        for link in self.links:
            pairs = [(link.src, link.dst)] + ([(link.dst, link.src)] if link.bidirectional else [])
            for src, dst in pairs:
                out[(src, dst)] = ResolvedLink(
                    src=src, dst=dst, bandwidth_gbps=link.bandwidth_gbps, latency_ms=link.latency_ms
                )
        if self.defaults is None:
            return out
        vertices = [self.coordinator.id, *self.node_ids]
        for src in vertices:
            for dst in vertices:
                if src == dst or (src, dst) in out:
                    continue
                params = self.defaults.inter_region if self.crosses_regions(src, dst) else self.defaults.intra_region
                if params is not None:
                    out[(src, dst)] = ResolvedLink(
                        src=src, dst=dst, bandwidth_gbps=params.bandwidth_gbps, latency_ms=params.latency_ms
                    )
        return out

    def check_connectivity(self) -> None:
        """The coordinator must reach some node and hear from some node; every node must be reachable."""
        links = self.resolved_links()
        coord = self.coordinator.id
        if not any(src == coord for src, _ in links):
            raise ConfigError("the coordinator has no outgoing link to any node", source=self.source, field="links")
        if not any(dst == coord for _, dst in links):
            raise ConfigError("no node has a link back to the coordinator", source=self.source, field="links")
        reached = {coord}
        frontier = [coord]
        while frontier:
            v = frontier.pop()
            for src, dst in links:
                if src == v and dst not in reached:
                    reached.add(dst)
                    frontier.append(dst)
        for i, node in enumerate(self.nodes):
            if node.id not in reached:
                raise ConfigError(
                    f"node {node.id!r} is not reachable from the coordinator by any link",
                    source=self.source,
                    field=f"nodes[{i}]",
                )


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read a cluster file and check that it is connected."""
    spec = load_model(ClusterSpec, path)
    spec._source = str(path)
    spec.check_connectivity()
    return spec
