"""The profiles file: model constants and, per GPU type, how fast it runs a model.

A GPU's throughput for a model comes in one of two forms (DESIGN.md):

* ``tok_s`` given directly: ``tok_s[k-1]`` is the tokens/s a node pushes through all ``k``
  layers it holds (this is how the paper's numbers come in);
* measured per-layer latency curves (what the profiler writes): ``prefill_ms_per_layer`` as
  ``[batch tokens, ms for one layer]`` points and ``decode_ms_per_layer`` as
  ``[batch size, ms for one layer]`` points, plus ``kv_capacity_tokens_by_layers``. From them
  :func:`derive_tok_s` computes the same table with this formula, for ``k`` layers::

      P(k) = max_t  t / (k * prefill_ms(t) / 1000)             prompt tokens/s
      b(k) = KV-limited decode batch = kv_capacity(k) / k / context_tokens
      D(k) = max_{b <= b(k)}  b / (k * decode_ms(b) / 1000)    decode tokens/s
      tok_s(k) = 1 / (f_prompt / P(k) + (1 - f_prompt) / D(k))

  with ``f_prompt`` the share of prompt tokens in the workload (763 of 763 + 232 on the
  Azure conversation trace the paper used) and ``context_tokens`` the mean context a
  decoding request holds (prompt + half the output).

  Curves are read, and an iteration priced, by :mod:`helix.perf_model` (linear between points,
  flat below the first, 0 for no work), as the planner and the simulator read them.

Optional per-step fixed costs (absent = 0, so profiles without them behave exactly as before):

* ``step_overhead_ms`` as ``[batch tokens, ms]`` points: paid **once per iteration** by every
  stage whatever the number of layers it runs (scheduling, gathering the batch, the engine's
  bookkeeping); batch tokens = prompt tokens + decoding requests in the iteration;
* ``head_ms`` as ``[batch size, ms]`` points: paid once per iteration by the stage holding the
  model's **last layer** only (final norm, LM head, sampling); batch size = sequences that
  sample a token in the iteration.

When they are given, the per-layer curves hold only the per-layer cost. :func:`derive_tok_s`
charges ``step_overhead_ms`` once per step and spreads ``head_ms`` over the model's layers
(``k / num_layers`` of it for ``k`` layers, as ``tok_s(k)`` does not know whether the node
holds the last layer; exact for a node holding the whole model)::

      P(k) = max_t  t / ((k * prefill_ms(t) + step(t) + k / L * head(1)) / 1000)
      D(k) = max_{b <= b(k)}  b / ((k * decode_ms(b) + step(b) + k / L * head(b)) / 1000)

The simulator and the planner's serving model charge them where they are paid.

Optional per-task cost (absent = 0; docs/pets.md): ``pet_ms_per_layer`` maps a PET type (``lora``,
``adapter``, ``bitfit``, ``diff``, ``mask``) to ``[rows, ms]`` points: what one layer pays more for
each task of that type a step touches, by that task's rows in the step (its prompt tokens and
decodes), beyond the shared op that runs once over every row. ``helix profile`` measures it.

The profiles loaded for a cluster (:func:`load_profiles_for`) carry its ``tasks:``' memory: each
GPU type's KV and layer limit less what the tasks' PETs take (:mod:`helix.task_memory`).

Optional context cost (absent = decode cost does not depend on context): the decode curve was
measured with every request holding ``decode_context_tokens`` of context;
``decode_ms_per_context_token`` is what one layer pays more per decoding request for every
token of context beyond that (less below it): attention reads every cached key and value, and
on a CPU a batch of long contexts reads as many bytes as the weights. :func:`derive_tok_s`
prices its mean context with it, the simulator every request's own.

Optional crowding (absent = a step costs the same however many of the host's nodes step with it):
``alone`` holds the per-layer curves again, measured with the node stepping alone on its host,
when the curves themselves were measured with ``together`` co-located nodes stepping at once
(``helix profile --concurrent``: they share the host's caches and memory bandwidth). The planner
reads the curves (every node busy, as at its max flow); the simulator prices an iteration between
the two by how many of the host's nodes step with it (:mod:`simulator.hosts`).

``kv_capacity_tokens_by_layers[k-1]`` counts KV *entries* (one token in one layer) that fit
when the node holds ``k`` layers; each layer then keeps ``value / k`` tokens of context.

Raising ``max_layers`` by hand: a KV list shorter than ``max_layers`` is extended when the
profiles are loaded, each more layer's weights taking their bytes from the KV space (the rule
the profiler's lists follow)::

    kv_capacity_tokens_by_layers[k] = kv_capacity_tokens_by_layers[k-1]
                                      - layer_weight_bytes / kv_bytes_per_token_per_layer

and ``prompt_max_tokens_by_layers`` / ``decode_max_tokens_by_layers`` repeat their last entry.
A ``max_layers`` whose extended KV would be empty is refused, naming the most layers that fit.
A longer list is fine (entries past ``max_layers`` are not used). A ``tok_s`` table cannot be
extended: it needs one entry per layer count.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from helix.errors import ConfigError, InfeasiblePlanError
from helix.loading import load_model
from helix.perf_model import CostCurve, NodeCurves
from helix.spec import ClusterSpec, NodeSpec
from helix.task_memory import task_memory, with_task_memory
from helix.tasks import PETTypeName

AZURE_MEAN_PROMPT_TOKENS = 763
AZURE_MEAN_OUTPUT_TOKENS = 232


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelProfile(_Strict):
    """One model's constants (``models.NAME``)."""

    num_layers: int = Field(gt=0, description="decoder layers (transformer blocks)")
    hidden_size: int = Field(gt=0, description="values per token in the activations between layers")
    dtype_bytes: int = Field(default=2, gt=0, description="bytes per value: an activation costs hidden_size x dtype_bytes per token")
    layer_weight_bytes: float = Field(gt=0, description="bytes of one layer's weights")
    kv_bytes_per_token_per_layer: float = Field(gt=0, description="bytes of KV cache one token takes in one layer (K and V)")
    token_bytes: int = Field(default=2, gt=0, description="bytes of one token id on coordinator links")

    @property
    def activation_bytes_per_token(self) -> int:
        return self.hidden_size * self.dtype_bytes


Curve = list[tuple[float, float]]


class SteppingAlone(_Strict):
    """The per-layer curves again, measured with the node stepping alone on its host (``alone:``
    under a throughput profile whose own curves ``helix profile --concurrent`` measured with
    ``together`` co-located nodes stepping at once). Steps that share a host's caches and memory
    bandwidth cost more than one that has them to itself; the simulator prices an iteration
    between the two by how many of the host's nodes step with it (:mod:`simulator.hosts`)."""

    together: int = Field(ge=2, description="nodes that stepped at once (at most one per core) when the throughput profile's own curves were measured")
    prefill_ms_per_layer: Curve = Field(description="as the throughput profile's, stepping alone")
    decode_ms_per_layer: Curve = Field(description="as the throughput profile's, stepping alone")
    step_overhead_ms: Curve | None = Field(default=None, description="as the throughput profile's, stepping alone; absent: 0")
    head_ms: Curve | None = Field(default=None, description="as the throughput profile's, stepping alone; absent: 0")
    decode_ms_per_context_token: float | None = Field(default=None, ge=0, description="as the throughput profile's, stepping alone; absent: 0")
    pet_ms_per_layer: dict[PETTypeName, Curve] | None = Field(default=None, description="as the throughput profile's, stepping alone; absent: 0")


class ThroughputProfile(_Strict):
    """How one GPU type runs one model."""

    max_layers: int = Field(gt=0, description="layers: the most one GPU of this type may hold of this model")
    tok_s: list[float] | None = Field(
        default=None, description="tokens/s through ALL k layers, k = 1..max_layers (one entry per k); or give the curves"
    )
    prefill_ms_per_layer: Curve | None = Field(
        default=None, description="[batch tokens, ms for ONE layer] points of a prefill step (needs decode_ms_per_layer)"
    )
    decode_ms_per_layer: Curve | None = Field(
        default=None, description="[batch size in requests, ms for ONE layer] points of a decode step"
    )
    kv_capacity_tokens_by_layers: list[float] | None = Field(
        default=None, description="KV entries (token x layer) that fit with k layers held, k = 1, 2, ...; short lists grow"
    )
    prompt_max_tokens_by_layers: list[int] | None = Field(
        default=None, description="largest prefill batch (tokens) per step with k layers held"
    )
    decode_max_tokens_by_layers: list[int] | None = Field(
        default=None, description="largest decode batch (requests) per step with k layers held"
    )
    step_overhead_ms: Curve | None = Field(
        default=None, description="[batch tokens, ms] paid once per iteration by every stage; absent: 0"
    )
    head_ms: Curve | None = Field(
        default=None, description="[batch size, ms] paid once per iteration by the stage with the last layer; absent: 0"
    )
    decode_context_tokens: float | None = Field(
        default=None, gt=0, description="tokens of context per request the decode curve was measured at"
    )
    decode_ms_per_context_token: float | None = Field(
        default=None, ge=0, description="ms one layer pays more per decoding request per context token beyond that"
    )
    pet_ms_per_layer: dict[PETTypeName, Curve] | None = Field(
        default=None, description="per PET type: [rows of one task in a step, ms it adds to ONE layer]; absent: 0"
    )
    alone: SteppingAlone | None = Field(
        default=None, description="the curves measured with the node stepping alone on its host, when these were measured "
                                  "with co-located nodes stepping together (helix profile --concurrent); absent: the same"
    )

    @model_validator(mode="after")
    def _check(self) -> ThroughputProfile:
        if self.tok_s is not None:
            if len(self.tok_s) != self.max_layers:
                raise ValueError(f"tok_s has {len(self.tok_s)} entries but max_layers is {self.max_layers}: give "
                                 "one entry per layer count k = 1..max_layers (tokens/s through all k layers)")
            if any(t <= 0 for t in self.tok_s):
                raise ValueError("tok_s entries must be positive")
        elif self.prefill_ms_per_layer is None or self.decode_ms_per_layer is None:
            raise ValueError("give tok_s, or both prefill_ms_per_layer and decode_ms_per_layer")
        if (self.decode_context_tokens is None) != (self.decode_ms_per_context_token is None):
            raise ValueError("give decode_context_tokens and decode_ms_per_context_token together")
        if self.alone is not None and self.prefill_ms_per_layer is None:
            raise ValueError("alone needs the curves it stands beside: give prefill_ms_per_layer and decode_ms_per_layer")
        for name in ("kv_capacity_tokens_by_layers", "prompt_max_tokens_by_layers", "decode_max_tokens_by_layers"):
            if getattr(self, name) == []:
                raise ValueError(f"{name} needs at least one entry (k = 1 layer held)")
        return self

    def extended(self, model: ModelProfile) -> ThroughputProfile:
        """This profile with its by-layers lists extended to ``max_layers`` (the module docstring's rule)."""
        update: dict[str, list[float] | list[int]] = {}
        kv = self.kv_capacity_tokens_by_layers
        if kv is not None and len(kv) < self.max_layers:
            per_layer = model.layer_weight_bytes / model.kv_bytes_per_token_per_layer
            more = [kv[-1] - per_layer * i for i in range(1, self.max_layers - len(kv) + 1)]
            if more[-1] <= 0:
                fits = len(kv) + sum(1 for v in more if v > 0)
                raise ValueError(
                    f"max_layers {self.max_layers} leaves no KV space: kv_capacity_tokens_by_layers ends at "
                    f"{kv[-1]:,.0f} entries with {len(kv)} layers and each more layer's weights take "
                    f"{per_layer:,.0f} (layer_weight_bytes / kv_bytes_per_token_per_layer), so at most {fits} "
                    "layers fit"
                )
            update["kv_capacity_tokens_by_layers"] = [*kv, *(float(round(v)) for v in more)]
        for name in ("prompt_max_tokens_by_layers", "decode_max_tokens_by_layers"):
            values = getattr(self, name)
            if values is not None and len(values) < self.max_layers:
                update[name] = values + [values[-1]] * (self.max_layers - len(values))
        return self.model_copy(update=update) if update else self

    def decode_context_ms(self, context_tokens: float) -> float:
        """Per layer and decoding request: what a context of ``context_tokens`` costs beyond
        (or, negative, below) the one the decode curve was measured at; 0 without the fields."""
        if self.decode_ms_per_context_token is None or self.decode_context_tokens is None:
            return 0.0
        return (context_tokens - self.decode_context_tokens) * self.decode_ms_per_context_token

    def curves(self) -> NodeCurves | None:
        """The latency curves as the performance model reads them (:mod:`helix.perf_model`);
        None without both per-layer curves."""
        if self.prefill_ms_per_layer is None or self.decode_ms_per_layer is None:
            return None
        return NodeCurves(
            prefill=CostCurve(self.prefill_ms_per_layer),
            decode=CostCurve(self.decode_ms_per_layer),
            step=CostCurve(self.step_overhead_ms) if self.step_overhead_ms else None,
            head=CostCurve(self.head_ms) if self.head_ms else None,
            context_ref_tokens=self.decode_context_tokens or 0.0,
            ms_per_context_token=self.decode_ms_per_context_token or 0.0,
            pet={t: CostCurve(c) for t, c in self.pet_ms_per_layer.items()} if self.pet_ms_per_layer else None,
        )

    def alone_curves(self) -> NodeCurves | None:
        """:meth:`curves` as measured stepping alone on the host (``alone``); None without them."""
        a = self.alone
        if a is None or self.decode_ms_per_layer is None:
            return None
        return NodeCurves(
            prefill=CostCurve(a.prefill_ms_per_layer),
            decode=CostCurve(a.decode_ms_per_layer),
            step=CostCurve(a.step_overhead_ms) if a.step_overhead_ms else None,
            head=CostCurve(a.head_ms) if a.head_ms else None,
            context_ref_tokens=self.decode_context_tokens or 0.0,
            ms_per_context_token=a.decode_ms_per_context_token or 0.0,
            pet={t: CostCurve(c) for t, c in a.pet_ms_per_layer.items()} if a.pet_ms_per_layer else None,
        )

    def tok_s_table(self, model: ModelProfile) -> list[float]:
        """tokens/s through all k layers, k = 1..max_layers (given, or derived from the curves)."""
        if self.tok_s is not None:
            return list(self.tok_s)
        return derive_tok_s(self, num_layers=model.num_layers)

    def kv_tokens_per_layer(self, k: int) -> float | None:
        """Tokens of context each layer can hold when the node holds k layers."""
        if self.kv_capacity_tokens_by_layers is None:
            return None
        return self.kv_capacity_tokens_by_layers[k - 1] / k


class GpuProfile(_Strict):
    """One GPU type (``gpus.NAME``)."""

    vram_gb: float = Field(gt=0, description="GB (10^9 bytes) of GPU memory")
    throughput: dict[str, ThroughputProfile] = Field(default={}, description="per model name: how fast it runs that model")


class ProfileSet(_Strict):
    """A profiles file: model constants and GPU types."""

    models: dict[str, ModelProfile] = Field(default={}, description="per model name: its constants")
    gpus: dict[str, GpuProfile] = Field(default={}, description="per GPU type (the `gpu` of nodes): its profile")

    @model_validator(mode="after")
    def _extend_by_layers_lists(self) -> ProfileSet:
        """Lists shorter than ``max_layers`` grow by the module docstring's rule (needs the model's
        constants; a GPU profiled for a model of another file grows when the files are merged)."""
        gpus = dict(self.gpus)
        for name, gpu in self.gpus.items():
            throughput = dict(gpu.throughput)
            for model, tp in gpu.throughput.items():
                if model in self.models:
                    try:
                        throughput[model] = tp.extended(self.models[model])
                    except ValueError as exc:
                        raise ValueError(f"gpus.{name}.throughput.{model}: {exc}") from None
            if throughput != gpu.throughput:
                gpus[name] = gpu.model_copy(update={"throughput": throughput})
        if gpus != self.gpus:
            object.__setattr__(self, "gpus", gpus)  # frozen model: set once, while validating
        return self

    def merged(self, other: ProfileSet) -> ProfileSet:
        gpus = dict(self.gpus)
        for name, gpu in other.gpus.items():
            if name in gpus:
                gpus[name] = GpuProfile(vram_gb=gpu.vram_gb, throughput={**gpus[name].throughput, **gpu.throughput})
            else:
                gpus[name] = gpu
        return ProfileSet(models={**self.models, **other.models}, gpus=gpus)

    def throughput(self, gpu: str, model: str) -> ThroughputProfile:
        return self.gpus[gpu].throughput[model]


def derive_tok_s(
    tp: ThroughputProfile,
    *,
    prompt_tokens: float = AZURE_MEAN_PROMPT_TOKENS,
    output_tokens: float = AZURE_MEAN_OUTPUT_TOKENS,
    num_layers: int | None = None,
) -> list[float]:
    """The module docstring's formula: tokens/s through k layers from per-layer latency curves
    (plus the optional per-step costs; ``num_layers`` spreads ``head_ms``, default max_layers)."""
    curves = tp.curves()
    assert curves is not None and tp.prefill_ms_per_layer is not None and tp.decode_ms_per_layer is not None
    f_prompt = prompt_tokens / (prompt_tokens + output_tokens)
    context = prompt_tokens + output_tokens / 2
    n_layers = num_layers or tp.max_layers

    def rate(tokens: float, ms: float) -> float:
        return tokens / (max(ms, 1e-6) / 1000)  # a free step (all-zero curves) is capped, not a division by 0

    out: list[float] = []
    for k in range(1, tp.max_layers + 1):
        share = k / n_layers  # of the head: tok_s(k) does not know whether the node holds the last layer
        prefill = max(rate(t, curves.iteration_ms(((k, t, 0, 0),), sampled=1, head_share=share))
                      for t, ms in tp.prefill_ms_per_layer if t > 0 and ms > 0)  # fmt: skip
        kv_per_layer = tp.kv_tokens_per_layer(k)
        max_batch = float("inf") if kv_per_layer is None else max(1.0, kv_per_layer / context)
        batches = [b for b, ms in tp.decode_ms_per_layer if 0 < b <= max_batch and ms > 0] or [max_batch]
        decode = max(rate(b, curves.iteration_ms(((k, 0, b, b * context),), sampled=b, head_share=share))
                     for b in batches)  # fmt: skip
        out.append(1.0 / (f_prompt / prefill + (1 - f_prompt) / decode))
    return out


def node_max_layers(node: NodeSpec, tp: ThroughputProfile) -> int:
    """The most layers a node may hold: its GPU profile's limit, or the node's own lower cap (a cap
    above the profile's limit is an error: :func:`check_profiles` names the file)."""
    if node.max_layers is None:
        return tp.max_layers
    if node.max_layers > tp.max_layers:
        raise ConfigError(f"node {node.id!r} has max_layers {node.max_layers} but the profile of GPU type "
                          f"{node.gpu!r} allows at most {tp.max_layers}; a node's max_layers may only lower it")
    return node.max_layers


def load_profile_file(path: str | Path) -> ProfileSet:
    return load_model(ProfileSet, path)


def load_profiles_for(cluster: ClusterSpec) -> ProfileSet:
    """Load (and merge) the cluster's profile files and check them against the cluster."""
    merged = ProfileSet()
    for path in cluster.profile_paths():
        merged = merged.merged(load_profile_file(path))
    merged = with_task_memory(merged, cluster)
    check_profiles(cluster, merged)
    return merged


def check_profiles(cluster: ClusterSpec, profiles: ProfileSet) -> None:
    """Every node's GPU is known and profiled for the model, and the model fits the cluster."""
    src = cluster.source
    if cluster.model not in profiles.models:
        known = ", ".join(sorted(profiles.models)) or "none"
        raise ConfigError(f"unknown model {cluster.model!r} (profiles know: {known})", source=src, field="model")
    for i, node in enumerate(cluster.nodes):
        if node.gpu not in profiles.gpus:
            known = ", ".join(sorted(profiles.gpus)) or "none"
            raise ConfigError(f"unknown GPU type {node.gpu!r} (profiles know: {known})", source=src, field=f"nodes[{i}].gpu")
        if cluster.model not in profiles.gpus[node.gpu].throughput:
            raise ConfigError(
                f"GPU type {node.gpu!r} has no throughput profile for model {cluster.model!r}",
                source=src,
                field=f"nodes[{i}].gpu",
            )
        node_cap, gpu_cap = node.max_layers, profiles.throughput(node.gpu, cluster.model).max_layers
        if node_cap is not None and node_cap > gpu_cap:
            files = ", ".join(str(p) for p in cluster.profile_paths())
            raise ConfigError(
                f"node {node.id!r} asks for max_layers {node_cap} but the profile of {node.gpu} for {cluster.model} "
                f"({files}) allows at most {gpu_cap}; a node's max_layers may only lower its GPU's limit: raise "
                f"max_layers of gpus.{node.gpu}.throughput.{cluster.model} in the profile (its KV list grows by the "
                "rule in docs/profiler.md) or re-estimate it with a smaller KV reserve",
                source=src, field=f"nodes[{i}].max_layers",
            )  # fmt: skip
    num_layers = profiles.models[cluster.model].num_layers
    total = sum(node_max_layers(n, profiles.throughput(n.gpu, cluster.model)) for n in cluster.nodes)
    if total < num_layers:
        lines = "\n".join(f"  {line}" for line in layer_limits(cluster, profiles))
        capped = [n.id for n in cluster.nodes if n.max_layers is not None]
        own = f"raise or remove the max_layers of nodes {', '.join(capped)} in {src}, " if capped else ""
        raise InfeasiblePlanError(
            f"{src}: model {cluster.model!r} has {num_layers} layers but all nodes together hold at most {total}:\n"
            f"{lines}\nto plan it: {own}raise max_layers in the profile (up to what the weights alone allow; its KV "
            "list grows by the rule in docs/profiler.md), re-estimate with a smaller KV reserve "
            "(helix profile --estimate --kv-requests N / --kv-reserve-gb GB), or add nodes"
        )


def layer_limits(cluster: ClusterSpec, profiles: ProfileSet) -> list[str]:
    """One line per node kind (GPU type and node cap): how many layers each node holds and why."""
    model = profiles.models[cluster.model]
    pets = task_memory(cluster, model.num_layers, model.dtype_bytes)
    kinds: dict[str, list[NodeSpec]] = {}
    for node in cluster.nodes:
        kinds.setdefault(node.kind, []).append(node)
    out = []
    for nodes in kinds.values():
        node = nodes[0]
        tp = profiles.throughput(node.gpu, cluster.model)
        held = node_max_layers(node, tp)
        ids = ", ".join(n.id for n in nodes)
        head = f"{len(nodes)} x {node.gpu} ({ids}): {held} layers each"
        if node.max_layers is not None:
            out.append(f"{head}: the nodes' own max_layers in the cluster file (the profile allows {tp.max_layers})")
            continue
        why = f"the profile's max_layers for {node.gpu}"
        kv = tp.kv_capacity_tokens_by_layers
        if kv:
            # the KV list's memory: entries next to one layer plus that layer's weights
            usable = kv[0] * model.kv_bytes_per_token_per_layer + model.layer_weight_bytes + (pets.held(1) if pets else 0)
            weights_only = int(usable // model.layer_weight_bytes)
            kv_left = kv[held - 1] * model.kv_bytes_per_token_per_layer
            why += (f"; its {usable / 1e9:.1f} GB for weights + KV hold the weights alone of {weights_only} layers "
                    f"({model.layer_weight_bytes / 1e9:.2f} GB each); with {held} it keeps {kv_left / 1e9:.1f} GB "
                    f"for KV ({kv[held - 1] / held:,.0f} tokens per layer)")  # fmt: skip
            if pets:
                why += f", after the {pets.tasks} tasks' PETs ({pets.held(held) / 1e9:.2f} GB of {held} layers)"
        else:
            why += f" ({profiles.gpus[node.gpu].vram_gb:g} GB VRAM; no kv_capacity_tokens_by_layers)"
        out.append(f"{head}: {why}")
    return out
