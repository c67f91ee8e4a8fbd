"""A fine-tuned task bound to one stage: the task's op per fused linear, on the stage's device and dtype.

:func:`bind_task` takes the layers ``[start, end)`` of a :class:`node_agent.pets.TaskPET` that a stage
holds, checks them against the base model and lays them out for the stage's fused linears
(:data:`STAGE_SITES`: ``qkv`` / ``o_proj`` / ``gate_up`` / ``down``, each module's parameters stacked
the way the stage stacks its weights): a :class:`StageTask`, every tensor of it a view of one buffer
of its own. A :class:`SiteDelta` is one task's
``Δ(x) = x·A·B·s + x·Sᵀ + b`` on one fused linear and runs it on the task's rows; a :class:`Bottleneck`
is a bound adapter. Running the ops of a step's tasks together is :mod:`node_agent.task_ops`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from helix.errors import PETError
from node_agent.config import ModelConfig
from node_agent.pets import (
    ACTIVATIONS,
    ATTENTION_MODULES,
    MLP_MODULES,
    NORMS,
    LayerPET,
    PETType,
    TaskPET,
    module_shape,
    tensor_nbytes,
)

# The stage's fused linears (node_agent.model.LayerWeights) and the modules stacked in each, in order.
STAGE_SITES: dict[str, tuple[str, ...]] = {
    "qkv": ATTENTION_MODULES[:3],
    "o_proj": ATTENTION_MODULES[3:],
    "gate_up": MLP_MODULES[:2],
    "down": MLP_MODULES[2:],
}
Rows = slice | torch.Tensor  # a task's rows in a step: one span, or the indices of several


@dataclass(slots=True)
class SiteDelta:
    """``Δ(x) = x·A·B·s + x·Sᵀ + b`` of one task on one fused linear of the stage (``qkv``...).

    LoRA's ``A`` of every stacked module is one ``[Σr, in]`` matrix (one GEMM for the site); each
    module's ``B`` writes its own columns of the fused output. ``lora_blocks`` / ``lora_bs`` /
    ``lora_scales`` say the same as ``lora_b`` in the form of the batched kernel (:func:`add_site_deltas`).
    """

    out_features: int
    lora_a: torch.Tensor | None = None  # [Σr, in] (PEFT's lora_A of each module, stacked)
    lora_b: tuple[tuple[slice, slice, torch.Tensor, float], ...] = ()  # (ranks, output columns, Bᵀ [r, out], s)
    sparse: torch.Tensor | None = None  # CSR [out, in]: δ (diff) and −W⊙M̄ (mask); float32 in any stage dtype
    bias: torch.Tensor | None = None  # [out]
    lora_blocks: list[int] = field(default_factory=list)  # per module of lora_b: its first rank, its first column
    lora_bs: list[torch.Tensor] = field(default_factory=list)  # per module: Bᵀ [r, out] (the tensors of lora_b)
    lora_scales: list[float] = field(default_factory=list)  # per module: s

    def add_to(self, y: torch.Tensor, x: torch.Tensor, rows: Rows, *, lora: bool = True) -> None:
        """``y[rows] += Δ(x[rows])`` in place (without the LoRA term if not ``lora``). Rows in one span
        (a request alone in its task, or tasks' rows kept together) take no gather and no scatter: each
        LoRA ``B`` GEMM accumulates straight into its output columns (``addmm_``, the scaling as its ``alpha``)."""
        if not isinstance(rows, slice):
            y.index_add_(0, rows, self.delta(x[rows]))
            return
        out, xs = y[rows], x[rows]
        if lora and self.lora_a is not None:
            xa = xs @ self.lora_a.t()
            for ranks, cols, b, scaling in self.lora_b:
                out[:, cols].addmm_(xa[:, ranks], b, alpha=scaling)
        if self.sparse is not None:
            out += torch.sparse.mm(self.sparse, xs.t().float()).t().to(xs.dtype)
        if self.bias is not None:
            out += self.bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``Δ`` on the task's rows ``x`` ``[n, in]`` -> ``[n, out]`` (the bias broadcast)."""
        out: torch.Tensor | None = None
        if self.lora_a is not None:
            xa = x @ self.lora_a.t()
            pieces: list[torch.Tensor] = []
            col = 0
            for ranks, cols, b, scaling in self.lora_b:
                if cols.start > col:
                    pieces.append(x.new_zeros(x.shape[0], cols.start - col))
                pieces.append((xa[:, ranks] @ b).mul_(scaling))
                col = cols.stop
            if col < self.out_features:
                pieces.append(x.new_zeros(x.shape[0], self.out_features - col))
            out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        if self.sparse is not None:
            sparse = torch.sparse.mm(self.sparse, x.t().float()).t().to(x.dtype)  # float32: every sparse kernel has it
            out = sparse if out is None else out.add_(sparse)
        if self.bias is not None:
            out = self.bias.expand(x.shape[0], -1) if out is None else out.add_(self.bias)
        assert out is not None, "a SiteDelta with no parameters"
        return out


@dataclass(slots=True)
class Bottleneck:
    """A bound bottleneck adapter: ``h -> up(act(down(h)))``."""

    down: torch.Tensor
    up: torch.Tensor
    down_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    activation: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.activation(F.linear(h, self.down, self.down_bias)), self.up, self.up_bias)


@dataclass(slots=True)
class LayerDelta:
    """A bound task's ops in one layer: per fused linear (:data:`STAGE_SITES`), per norm, per adapter place."""

    sites: dict[str, SiteDelta] = field(default_factory=dict)
    norm_bias: dict[str, torch.Tensor] = field(default_factory=dict)  # NORMS -> [hidden]
    adapters: dict[str, Bottleneck] = field(default_factory=dict)  # ADAPTER_PLACES -> adapter


@dataclass(slots=True, eq=False)  # hashed by identity: a step groups its rows by the bound task
class StageTask:
    """A task bound to one stage: the ops of the layers the stage holds, on its device and dtype."""

    task_id: str
    pet_type: PETType
    layers: dict[int, LayerDelta]
    final_norm_bias: torch.Tensor | None = None
    lm_head_bias: torch.Tensor | None = None
    nbytes: int = 0

    @property
    def has_head_bias(self) -> bool:
        return self.final_norm_bias is not None or self.lm_head_bias is not None


BaseWeights = Callable[[list[str]], dict[str, torch.Tensor]]  # checkpoint tensor names -> tensors


def bind_task(task_id: str, pet: TaskPET, config: ModelConfig, start: int, end: int, *,
              dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              base_weights: BaseWeights | None = None, max_lora_rank: int | None = None) -> StageTask:  # fmt: skip
    """The part of ``pet`` in layers ``[start, end)``, checked against ``config`` and laid out for the stage.

    ``base_weights`` reads base tensors from the checkpoint: masks need the values ``W ⊙ M̄``
    (read one layer at a time; nothing of the base is kept).
    """
    pet.check_layers(config)  # a layer past the model is an error, not something a slice leaves out
    part = pet.slice(start, end, config.num_layers)
    part.check(config, max_lora_rank=max_lora_rank)
    device = torch.device(device)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, dtype).contiguous()

    layers: dict[int, LayerDelta] = {}
    for layer, lp in part.layers.items():
        base: dict[str, torch.Tensor] = {}
        if lp.pruned:
            if base_weights is None:
                raise PETError("a mask needs the base weights to bind (no base_weights given)",
                               tensor=f"model.layers.{layer}.{next(iter(lp.pruned))}.weight_mask")  # fmt: skip
            base = base_weights([f"model.layers.{layer}.{m}.weight" for m in lp.pruned])
        delta = LayerDelta()
        for site, modules in STAGE_SITES.items():
            bound = _bind_site(config, layer, lp, modules, base, dtype, device)
            if bound is not None:
                delta.sites[site] = bound
        delta.norm_bias = {n: put(lp.bias[n]) for n in NORMS if n in lp.bias}
        act = ACTIVATIONS[pet.adapter_activation]
        delta.adapters = {place: Bottleneck(put(ad.down), put(ad.up),
                                            None if ad.down_bias is None else put(ad.down_bias),
                                            None if ad.up_bias is None else put(ad.up_bias), act)
                          for place, ad in lp.adapters.items()}  # fmt: skip
        if delta.sites or delta.norm_bias or delta.adapters:
            layers[layer] = delta
    task = StageTask(task_id, pet.pet_type, layers,
                     None if part.final_norm_bias is None else put(part.final_norm_bias),
                     None if part.lm_head_bias is None else put(part.lm_head_bias))  # fmt: skip
    _pack(task)
    task.nbytes = sum(tensor_nbytes(t) for t in _stage_tensors(task))
    return task


_ALIGN = 64  # bytes: each tensor of a packed task starts on a cache line


def _pack(task: StageTask) -> None:
    """Move every tensor of ``task`` into one buffer of its own (views of it, each 64-byte aligned).

    A task is hundreds of small tensors; allocated one by one between the temporaries of reading and
    binding it, they left the allocator's free memory in holes it could not give back (bench/pets.py (a)):
    one allocation per task keeps a process's memory near the bytes its tasks hold.
    """
    sizes = [_aligned(p) for t in _stage_tensors(task) for p in _dense_parts(t)]
    if not sizes:
        return
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=next(iter(_stage_tensors(task))).device)
    cursor = 0

    def move(t: torch.Tensor) -> torch.Tensor:
        nonlocal cursor
        if t.layout == torch.sparse_csr:
            return torch.sparse_csr_tensor(move(t.crow_indices()), move(t.col_indices()), move(t.values()), t.shape,
                                           check_invariants=False)  # checked when it was built
        view = buffer[cursor:cursor + tensor_nbytes(t)].view(t.dtype).view(t.shape)
        cursor += _aligned(t)
        return view.copy_(t)

    for delta in task.layers.values():
        for site in delta.sites.values():
            site.lora_a = None if site.lora_a is None else move(site.lora_a)
            site.lora_b = tuple((ranks, cols, move(b), s) for ranks, cols, b, s in site.lora_b)
            site.lora_bs = [b for _, _, b, _ in site.lora_b]
            site.sparse = None if site.sparse is None else move(site.sparse)
            site.bias = None if site.bias is None else move(site.bias)
        delta.norm_bias = {n: move(t) for n, t in delta.norm_bias.items()}
        delta.adapters = {place: Bottleneck(move(ad.down), move(ad.up),
                                            None if ad.down_bias is None else move(ad.down_bias),
                                            None if ad.up_bias is None else move(ad.up_bias), ad.activation)
                          for place, ad in delta.adapters.items()}  # fmt: skip
    task.final_norm_bias = None if task.final_norm_bias is None else move(task.final_norm_bias)
    task.lm_head_bias = None if task.lm_head_bias is None else move(task.lm_head_bias)


def _aligned(t: torch.Tensor) -> int:
    return -(-tensor_nbytes(t) // _ALIGN) * _ALIGN


def _dense_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (t.crow_indices(), t.col_indices(), t.values()) if t.layout == torch.sparse_csr else (t,)


def _bind_site(config: ModelConfig, layer: int, lp: LayerPET, modules: tuple[str, ...],
               base: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> SiteDelta | None:
    """One fused linear's delta, its modules' parameters stacked the way the stage stacks their weights."""

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, dtype).contiguous()

    if not any(m in lp.lora or m in lp.bias or m in lp.diff or m in lp.pruned for m in modules):
        return None
    offsets, col = {}, 0
    for m in modules:
        offsets[m] = col
        col += module_shape(config, m)[0]
    site = SiteDelta(out_features=col)
    in_features = module_shape(config, modules[0])[1]
    lora = [(m, lp.lora[m]) for m in modules if m in lp.lora]
    if lora:
        site.lora_a = put(torch.cat([lw.a for _, lw in lora]))
        parts, rank = [], 0
        for m, lw in lora:
            r, out = lw.a.shape[0], lw.b.shape[0]
            parts.append((slice(rank, rank + r), slice(offsets[m], offsets[m] + out), put(lw.b.t()), lw.scaling))
            site.lora_blocks += (rank, offsets[m])
            rank += r
        site.lora_b = tuple(parts)
        site.lora_bs = [b for _, _, b, _ in parts]
        site.lora_scales = [s for _, _, _, s in parts]
    if any(m in lp.bias for m in modules):
        site.bias = put(torch.cat([lp.bias[m] if m in lp.bias else torch.zeros(module_shape(config, m)[0])
                                   for m in modules]))  # fmt: skip
    indices: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for m in modules:
        shift = torch.tensor([[offsets[m]], [0]])
        if m in lp.diff:
            indices.append(lp.diff[m].indices() + shift)
            values.append(lp.diff[m].values().float())
        if m in lp.pruned:
            idx = lp.pruned[m].indices()
            indices.append(idx + shift)
            values.append(-base[f"model.layers.{layer}.{m}.weight"][idx[0], idx[1]].float())
    if indices:
        coo = torch.sparse_coo_tensor(torch.cat(indices, dim=1), torch.cat(values), (col, in_features),
                                      check_invariants=True).coalesce()
        index_dtype = torch.int32 if max(col, in_features, coo._nnz()) < 2**31 else torch.int64
        with warnings.catch_warnings():  # "sparse CSR support is in beta": it is what we mean to use
            warnings.simplefilter("ignore", UserWarning)
            csr = coo.to_sparse_csr()
            site.sparse = torch.sparse_csr_tensor(csr.crow_indices().to(index_dtype), csr.col_indices().to(index_dtype),
                                                  csr.values().float(), csr.shape, device=device,
                                                  check_invariants=True)  # fmt: skip
    return site


def _stage_tensors(task: StageTask) -> Iterable[torch.Tensor]:
    for delta in task.layers.values():
        for site in delta.sites.values():
            yield from (t for t in (site.lora_a, site.sparse, site.bias) if t is not None)
            yield from (b for _, _, b, _ in site.lora_b)
        yield from delta.norm_bias.values()
        for ad in delta.adapters.values():
            yield from (t for t in (ad.down, ad.up, ad.down_bias, ad.up_bias) if t is not None)
    yield from (t for t in (task.final_norm_bias, task.lm_head_bias) if t is not None)
