"""Fine-tuned tasks on one shared base model: the unified PET representation of PetS (section 2.1).

A *task* is a base model plus a PET (parameter-efficient fine-tuning): LoRA, a bottleneck adapter,
BitFit, Diff-Pruning or a pruning mask. Every type is written in one form, per linear layer of the
Llama-family decoder::

    y = X·W  +  Δ(X),    Δ(X) = X·A·B·s  +  X·S  +  b

``X·W`` is the *shared op*: the base weights, packed once, run once over the rows of every task in
a step. ``Δ`` is the task's op, run on that task's rows only. The base weights are never copied or
merged per task. How each type maps onto ``Δ``:

* **LoRA** ``X·A·B·s``: PEFT's convention (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``,
  ``s = lora_alpha / r``), on any of q/k/v/o and the MLP's gate/up/down projections.
* **BitFit** ``b``: bias deltas on the linear layers, on the two RMSNorms of each layer (their
  output ``norm(x)·g + b``), on the final norm and on the LM head.
* **Diff-Pruning** ``X·δ``: ``δ`` sparse (at most :data:`MAX_DIFF_DENSITY` of its entries
  non-zero), held in CSR and applied with ``torch.sparse.mm``.
* **Masks** ``X·(W ⊙ M) = X·W − X·(W ⊙ M̄)``: the complement ``M̄`` (the weights the mask zeroes,
  at most :data:`MAX_MASK_COMPLEMENT_DENSITY` of them) becomes the sparse ``S = −(W ⊙ M̄)``, its
  values read from the base checkpoint when the task is bound to a stage.
* **Adapter** (Houlsby bottleneck, PetS Table 2): ``h += up(act(down(h)))`` on the output ``h`` of
  the attention block (after ``o_proj``) and/or of the MLP (after ``down_proj``), before the
  residual add.

This module owns the parameter containers and their checks against a base model's shape
(:class:`TaskPET`, whole-model, in the tensor naming below), the *binding* of a task to a stage
(:func:`bind_task`: only the layers the stage holds, laid out for the stage's fused linears
``qkv`` / ``o_proj`` / ``gate_up`` / ``down``), the grouping of a step's rows by task
(:class:`TaskRows`) and the math of the task ops on those rows. :mod:`node_agent.model` calls it
only for steps that hold a task's rows; a base-only step never enters it.

Tensor names (HF module paths, PyTorch's ``[out, in]`` weight orientation; ``{m}`` is a linear
module such as ``self_attn.q_proj`` or ``mlp.down_proj``, ``{i}`` a layer index):

=========  ========================================================================================
LoRA       ``model.layers.{i}.{m}.lora_A`` ``[r, in]``, ``model.layers.{i}.{m}.lora_B`` ``[out, r]``
           (PEFT's names without ``base_model.model.`` and ``.weight``: :func:`lora_tensors_from_peft`)
Adapter    ``model.layers.{i}.{attn_adapter|mlp_adapter}.{down|up}.{weight|bias}``:
           ``down.weight`` ``[bottleneck, hidden]``, ``up.weight`` ``[hidden, bottleneck]``
BitFit     ``model.layers.{i}.{m}.bias`` ``[out]``,
           ``model.layers.{i}.{input_layernorm|post_attention_layernorm}.bias``, ``model.norm.bias``
           ``[hidden]``, ``lm_head.bias`` ``[vocab]``
Diff       ``model.layers.{i}.{m}.weight_diff`` ``[out, in]``: a torch sparse tensor, or dense and sparse
Mask       ``model.layers.{i}.{m}.weight_mask`` ``[out, in]``, 1 keeps the base weight and 0 zeroes it;
           or ``model.layers.{i}.{m}.weight_mask_complement``, sparse, non-zero where the mask zeroes
=========  ========================================================================================
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import torch
import torch.nn.functional as F

from helix.errors import PETError
from node_agent import native
from node_agent.config import ModelConfig
from node_agent.kernels import Linear

ATTENTION_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_MODULES = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LINEAR_MODULES = ATTENTION_MODULES + MLP_MODULES
NORMS = ("input_layernorm", "post_attention_layernorm")
ADAPTER_PLACES = ("attn_adapter", "mlp_adapter")  # after the attention block / after the MLP
FINAL_NORM_BIAS, LM_HEAD_BIAS = "model.norm.bias", "lm_head.bias"
# The stage's fused linears (node_agent.model.LayerWeights) and the modules stacked in each, in order.
STAGE_SITES: dict[str, tuple[str, ...]] = {
    "qkv": ATTENTION_MODULES[:3],
    "o_proj": ATTENTION_MODULES[3:],
    "gate_up": MLP_MODULES[:2],
    "down": MLP_MODULES[2:],
}
MAX_DIFF_DENSITY = 0.01  # a Diff-Pruning delta is >= 99 % zeros (PetS's default: 99.5 %)
MAX_MASK_COMPLEMENT_DENSITY = 0.05  # a mask zeroes at most 5 % of a weight (PetS's MaskBert: 95 % sparse)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu, "swish": F.silu, "tanh": torch.tanh,
}

_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)")


class PETType(StrEnum):
    LORA = "lora"
    ADAPTER = "adapter"
    BITFIT = "bitfit"
    DIFF = "diff"
    MASK = "mask"


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One linear's low-rank delta ``x·Aᵀ·Bᵀ·scaling`` in PEFT's orientation."""

    a: torch.Tensor  # [r, in]  (PEFT lora_A.weight)
    b: torch.Tensor  # [out, r] (PEFT lora_B.weight)
    scaling: float  # lora_alpha / r (alpha / sqrt(r) with rsLoRA)


@dataclass(frozen=True, slots=True)
class BottleneckWeights:
    """A bottleneck adapter ``up(act(down(h)))``; the activation is the task's."""

    down: torch.Tensor  # [bottleneck, hidden]
    up: torch.Tensor  # [hidden, bottleneck]
    down_bias: torch.Tensor | None = None  # [bottleneck]
    up_bias: torch.Tensor | None = None  # [hidden]


@dataclass(slots=True)
class LayerPET:
    """A task's parameters in one decoder layer, keyed by HF module path (``self_attn.q_proj``...)."""

    lora: dict[str, LoRAWeights] = field(default_factory=dict)
    bias: dict[str, torch.Tensor] = field(default_factory=dict)  # linear module or norm -> bias [features]
    diff: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> sparse COO δ [out, in]
    pruned: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> sparse COO bool M̄ [out, in]
    adapters: dict[str, BottleneckWeights] = field(default_factory=dict)  # ADAPTER_PLACES -> adapter

    def tensors(self, layer: int) -> Iterable[tuple[str, torch.Tensor]]:
        """Every parameter with its name (the module docstring's naming)."""
        p = f"model.layers.{layer}"
        for m, lw in self.lora.items():
            yield f"{p}.{m}.lora_A", lw.a
            yield f"{p}.{m}.lora_B", lw.b
        for m, t in self.bias.items():
            yield f"{p}.{m}.bias", t
        for m, t in self.diff.items():
            yield f"{p}.{m}.weight_diff", t
        for m, t in self.pruned.items():
            yield f"{p}.{m}.weight_mask_complement", t
        for place, ad in self.adapters.items():
            yield f"{p}.{place}.down.weight", ad.down
            yield f"{p}.{place}.up.weight", ad.up
            if ad.down_bias is not None:
                yield f"{p}.{place}.down.bias", ad.down_bias
            if ad.up_bias is not None:
                yield f"{p}.{place}.up.bias", ad.up_bias


@dataclass(slots=True)
class TaskPET:
    """One task's PET over the whole model (or a slice of its layers): what a registry holds.

    Build it with :meth:`from_tensors`; :meth:`check` validates it against a base model;
    :func:`bind_task` turns the layers a stage holds into the form the stage runs.
    """

    pet_type: PETType
    layers: dict[int, LayerPET] = field(default_factory=dict)
    final_norm_bias: torch.Tensor | None = None  # BitFit, [hidden]
    lm_head_bias: torch.Tensor | None = None  # BitFit, [vocab]
    adapter_activation: str = "relu"

    @classmethod
    def from_tensors(cls, pet_type: PETType | str, tensors: Mapping[str, torch.Tensor], *,
                     lora_scaling: float | Mapping[str, float] = 1.0,
                     adapter_activation: str = "relu") -> TaskPET:  # fmt: skip
        """Parse ``tensors`` named as in the module docstring. ``lora_scaling`` is one scale for
        every LoRA module, or one per ``model.layers.{i}.{module}`` (PEFT's alpha/rank patterns)."""
        try:
            kind = PETType(pet_type)
        except ValueError:
            raise PETError(f"unknown PET type {pet_type!r} (one of: {', '.join(PETType)})") from None
        if kind is PETType.ADAPTER and adapter_activation not in ACTIVATIONS:
            raise PETError(f"unknown adapter activation {adapter_activation!r} (one of: {', '.join(ACTIVATIONS)})")
        pet = cls(kind, adapter_activation=adapter_activation)
        lora_parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        adapter_parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            if kind is PETType.BITFIT and name in (FINAL_NORM_BIAS, LM_HEAD_BIAS):
                if name == FINAL_NORM_BIAS:
                    pet.final_norm_bias = tensor
                else:
                    pet.lm_head_bias = tensor
                continue
            match = _LAYER_TENSOR.fullmatch(name)
            if match is None:
                raise PETError(f"not a tensor of a {kind} PET (expected {_EXPECTED[kind]})", tensor=name)
            layer, rest = int(match[1]), match[2]
            module, _, leaf = rest.rpartition(".")
            into = pet.layers.setdefault(layer, LayerPET())
            if kind is PETType.LORA and module in LINEAR_MODULES and leaf in ("lora_A", "lora_B"):
                lora_parts.setdefault((layer, module), {})[leaf] = tensor
            elif kind is PETType.BITFIT and module in LINEAR_MODULES + NORMS and leaf == "bias":
                into.bias[module] = tensor
            elif kind is PETType.DIFF and module in LINEAR_MODULES and leaf == "weight_diff":
                into.diff[module] = _sparse_coo(tensor)
            elif kind is PETType.MASK and module in LINEAR_MODULES and leaf == "weight_mask":
                if tensor.layout != torch.strided:
                    raise PETError("a weight_mask is dense (1 keeps, 0 zeroes); give the zeroed entries "
                                   "sparse as weight_mask_complement", tensor=name)  # fmt: skip
                if not bool(((tensor == 0) | (tensor == 1)).all()):
                    raise PETError("a weight_mask holds only 0 and 1", tensor=name)
                into.pruned[module] = (tensor == 0).to_sparse().coalesce()
            elif kind is PETType.MASK and module in LINEAR_MODULES and leaf == "weight_mask_complement":
                coo = _sparse_coo(tensor)
                keep = coo.values() != 0
                into.pruned[module] = torch.sparse_coo_tensor(
                    coo.indices()[:, keep], torch.ones(int(keep.sum()), dtype=torch.bool), coo.shape,
                    check_invariants=True).coalesce()
            elif kind is PETType.ADAPTER and module.rpartition(".")[0] in ADAPTER_PLACES \
                    and module.rpartition(".")[2] in ("down", "up") and leaf in ("weight", "bias"):
                place, _, proj = module.rpartition(".")
                adapter_parts.setdefault((layer, place), {})[f"{proj}.{leaf}"] = tensor
            else:
                raise PETError(f"not a tensor of a {kind} PET (expected {_EXPECTED[kind]})", tensor=name)
        for (layer, module), ab in lora_parts.items():
            for leaf in ("lora_A", "lora_B"):
                if leaf not in ab:
                    other = "lora_B" if leaf == "lora_A" else "lora_A"
                    raise PETError(f"has no {leaf} beside its {other}", tensor=f"model.layers.{layer}.{module}")
            key = f"model.layers.{layer}.{module}"
            scaling = lora_scaling if isinstance(lora_scaling, float | int) else lora_scaling.get(key)
            if scaling is None:
                raise PETError("no LoRA scaling given for this module", tensor=key)
            pet.layers[layer].lora[module] = LoRAWeights(ab["lora_A"], ab["lora_B"], float(scaling))
        for (layer, place), parts in adapter_parts.items():
            for leaf in ("down.weight", "up.weight"):
                if leaf not in parts:
                    raise PETError(f"the adapter has no {leaf}", tensor=f"model.layers.{layer}.{place}")
            pet.layers[layer].adapters[place] = BottleneckWeights(parts["down.weight"], parts["up.weight"],
                                                                  parts.get("down.bias"), parts.get("up.bias"))
        pet.layers = {i: lp for i, lp in sorted(pet.layers.items()) if any(True for _ in lp.tensors(i))}
        return pet

    def tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Every parameter with its name (masks as their sparse complement)."""
        for layer, lp in self.layers.items():
            yield from lp.tensors(layer)
        if self.final_norm_bias is not None:
            yield FINAL_NORM_BIAS, self.final_norm_bias
        if self.lm_head_bias is not None:
            yield LM_HEAD_BIAS, self.lm_head_bias

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters as held here (sparse tensors: values and indices)."""
        return sum(_nbytes(t) for _, t in self.tensors())

    @property
    def lora_rank(self) -> int:
        """The largest LoRA rank of the task (0 if it has no LoRA)."""
        return max((lw.a.shape[0] for lp in self.layers.values() for lw in lp.lora.values()), default=0)

    def slice(self, start: int, end: int, num_layers: int) -> TaskPET:
        """The part of the task a stage holding layers ``[start, end)`` of ``num_layers`` runs."""
        last = end == num_layers
        return TaskPET(self.pet_type, {i: lp for i, lp in self.layers.items() if start <= i < end},
                       self.final_norm_bias if last else None, self.lm_head_bias if last else None,
                       self.adapter_activation)  # fmt: skip

    def check_layers(self, config: ModelConfig) -> None:
        """Raise :class:`PETError` naming a tensor of a layer the base model does not have."""
        for layer, lp in self.layers.items():
            if not 0 <= layer < config.num_layers:
                raise PETError(f"layer {layer} is outside the base model's {config.num_layers} layers",
                               tensor=next(iter(lp.tensors(layer)))[0])  # fmt: skip

    def check(self, config: ModelConfig, *, max_lora_rank: int | None = None) -> None:
        """Raise :class:`PETError` naming the tensor if anything does not fit the base ``config``."""
        if self.adapter_activation not in ACTIVATIONS:
            raise PETError(f"unknown adapter activation {self.adapter_activation!r} "
                           f"(one of: {', '.join(ACTIVATIONS)})")  # fmt: skip
        for name, tensor in self.tensors():
            values = tensor.values() if tensor.layout != torch.strided else tensor
            if values.is_floating_point() and not bool(torch.isfinite(values).all()):
                raise PETError("holds NaN or infinite values", tensor=name)
        hidden = config.hidden_size
        self.check_layers(config)
        for layer, lp in self.layers.items():
            p = f"model.layers.{layer}"
            for m, lw in lp.lora.items():
                out, inp = module_shape(config, m)
                rank = lw.a.shape[0] if lw.a.dim() == 2 else -1
                _expect_shape(lw.a, (rank, inp), f"{p}.{m}.lora_A")
                _expect_shape(lw.b, (out, rank), f"{p}.{m}.lora_B")
                if rank < 1:
                    raise PETError("a LoRA rank is at least 1", tensor=f"{p}.{m}.lora_A")
                if max_lora_rank is not None and rank > max_lora_rank:
                    raise PETError(f"rank {rank} is above the configured maximum {max_lora_rank}",
                                   tensor=f"{p}.{m}.lora_A")  # fmt: skip
            for m, t in lp.bias.items():
                _expect_shape(t, (hidden,) if m in NORMS else module_shape(config, m)[:1], f"{p}.{m}.bias")
            for m, t in lp.diff.items():
                _expect_shape(t, module_shape(config, m), f"{p}.{m}.weight_diff")
                _expect_sparse(t, MAX_DIFF_DENSITY, f"{p}.{m}.weight_diff", "a Diff-Pruning delta")
            for m, t in lp.pruned.items():
                _expect_shape(t, module_shape(config, m), f"{p}.{m}.weight_mask")
                _expect_sparse(t, MAX_MASK_COMPLEMENT_DENSITY, f"{p}.{m}.weight_mask",
                               "the entries a mask zeroes")  # fmt: skip
            for place, ad in lp.adapters.items():
                bottleneck = ad.down.shape[0] if ad.down.dim() == 2 else -1
                _expect_shape(ad.down, (bottleneck, hidden), f"{p}.{place}.down.weight")
                _expect_shape(ad.up, (hidden, bottleneck), f"{p}.{place}.up.weight")
                if ad.down_bias is not None:
                    _expect_shape(ad.down_bias, (bottleneck,), f"{p}.{place}.down.bias")
                if ad.up_bias is not None:
                    _expect_shape(ad.up_bias, (hidden,), f"{p}.{place}.up.bias")
        if self.final_norm_bias is not None:
            _expect_shape(self.final_norm_bias, (hidden,), FINAL_NORM_BIAS)
        if self.lm_head_bias is not None:
            _expect_shape(self.lm_head_bias, (config.vocab_size,), LM_HEAD_BIAS)


_EXPECTED: dict[PETType, str] = {
    PETType.LORA: "model.layers.<i>.<module>.lora_A / .lora_B",
    PETType.ADAPTER: "model.layers.<i>.<attn_adapter|mlp_adapter>.<down|up>.<weight|bias>",
    PETType.BITFIT: f"model.layers.<i>.<module or norm>.bias, {FINAL_NORM_BIAS}, {LM_HEAD_BIAS}",
    PETType.DIFF: "model.layers.<i>.<module>.weight_diff",
    PETType.MASK: "model.layers.<i>.<module>.weight_mask / .weight_mask_complement",
}


_PEFT_LORA = re.compile(r"(?:base_model\.model\.)?(model\.layers\.\d+\..+)\.(lora_A|lora_B)(?:\.default)?\.weight")


def lora_tensors_from_peft(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's LoRA state dict (``base_model.model.model.layers.{i}.{m}.lora_A.weight``...) in our naming."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        match = _PEFT_LORA.fullmatch(name)
        if match is None:
            raise PETError("not a LoRA weight of PEFT's (lora_A / lora_B of a decoder layer's linear)", tensor=name)
        out[f"{match[1]}.{match[2]}"] = tensor
    return out


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """``(out_features, in_features)`` of a linear module of a Llama-family layer."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }[module]


def _sparse_coo(tensor: torch.Tensor) -> torch.Tensor:
    coo = tensor.to_sparse_coo() if tensor.layout != torch.strided else tensor.to_sparse()
    return coo.coalesce()


def _nbytes(t: torch.Tensor) -> int:
    if t.layout == torch.sparse_coo:
        return _nbytes(t.indices()) + _nbytes(t.values())
    if t.layout == torch.sparse_csr:
        return _nbytes(t.crow_indices()) + _nbytes(t.col_indices()) + _nbytes(t.values())
    return t.numel() * t.element_size()


def _expect_shape(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != shape:
        want = ", ".join(str(d) if d >= 0 else "r" for d in shape)
        raise PETError(f"shape {list(t.shape)} does not fit the base model (expected [{want}])", tensor=name)


def _expect_sparse(t: torch.Tensor, max_density: float, name: str, what: str) -> None:
    density = t._nnz() / max(t.numel(), 1)
    if density > max_density:
        raise PETError(f"{density:.2%} of its entries are set; {what} must be at most {max_density:.0%} "
                       f"of the weight (dense changes belong in a LoRA or a merged model)", tensor=name)


# ---- a task bound to a stage ----------------------------------------------------------------

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
    task.nbytes = sum(_nbytes(t) for t in _stage_tensors(task))
    return task


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


# ---- a step's rows, grouped by task -----------------------------------------------------------

class TaskRows:
    """The rows of a step that belong to tasks, one group per task (PetS's intra-task mini-batches).

    Built once per step, and only when some request of the step has a task.
    """

    __slots__ = ("groups",)

    def __init__(self, groups: list[tuple[StageTask, Rows]]) -> None:
        self.groups = groups

    @classmethod
    def group(cls, spans: Iterable[tuple[StageTask | None, slice]], device: torch.device) -> TaskRows | None:
        """Group each request's ``(task, rows)`` by task; ``None`` when no request has a task."""
        by_task: dict[StageTask, list[slice]] = {}
        for task, span in spans:
            if task is not None:
                by_task.setdefault(task, []).append(span)
        if not by_task:
            return None
        groups: list[tuple[StageTask, Rows]] = []
        for task, slices in by_task.items():
            merged = [slices[0]]
            for s in slices[1:]:
                if s.start == merged[-1].stop:
                    merged[-1] = slice(merged[-1].start, s.stop)
                else:
                    merged.append(s)
            rows: Rows = merged[0] if len(merged) == 1 else \
                torch.cat([torch.arange(s.start, s.stop) for s in merged]).to(device)
            groups.append((task, rows))
        return cls(groups)

    def at(self, layer: int) -> list[tuple[LayerDelta, Rows]]:
        """The tasks with ops in ``layer``, with their rows."""
        return [(task.layers[layer], rows) for task, rows in self.groups if layer in task.layers]


LayerRows = list[tuple[LayerDelta, Rows]]


def num_rows(rows: Rows) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


def add_rows(y: torch.Tensor, rows: Rows, delta: torch.Tensor) -> None:
    """``y[rows] += delta`` in place."""
    if isinstance(rows, slice):
        y[rows] += delta
    else:
        y.index_add_(0, rows, delta)


def add_site_deltas(y: torch.Tensor, x: torch.Tensor, deltas: LayerRows, site: str) -> torch.Tensor:
    """``y[rows] += Δ(x[rows])`` for every task with an op on fused linear ``site``; returns ``y``.

    With the native kernels (float32 CPU rows), the LoRA terms of every task whose rows are one span
    go in one ``lora_segments`` call (Punica's SGMV: each task's ``A`` and ``B`` read in place, no
    weight gathered or copied); the rest (scattered rows, sparse deltas, biases) per task.
    """
    kernel = _lora_kernel(y, x)
    if kernel is None:
        for delta, rows in deltas:
            op = delta.sites.get(site)
            if op is not None:
                op.add_to(y, x, rows)
        return y
    a: list[torch.Tensor] = []
    b: list[torch.Tensor] = []
    segments: list[int] = []
    blocks: list[int] = []
    scales: list[float] = []
    for delta, rows in deltas:
        op = delta.sites.get(site)
        if op is None:
            continue
        if op.lora_a is None or not isinstance(rows, slice):
            op.add_to(y, x, rows)
            continue
        segments += (rows.start, rows.stop, len(b), len(op.lora_bs))
        a.append(op.lora_a)
        b += op.lora_bs
        blocks += op.lora_blocks
        scales += op.lora_scales
        if op.sparse is not None or op.bias is not None:
            op.add_to(y, x, rows, lora=False)
    if a:
        kernel(y, x, a, b, segments, blocks, scales)
    return y


def _lora_kernel(y: torch.Tensor, x: torch.Tensor) -> Callable[..., None] | None:
    """The native ``lora_segments`` op if it takes these rows (float32 CPU, contiguous rows), else ``None``."""
    if y.dtype != torch.float32 or x.dtype != torch.float32 or y.device.type != "cpu" or x.device.type != "cpu" \
            or y.dim() != 2 or x.dim() != 2 or y.stride(1) != 1 or x.stride(1) != 1:
        return None
    kernels = native.ops()
    return None if kernels is None else kernels.lora_segments


def add_norm_biases(normed: torch.Tensor, deltas: LayerRows, norm: str) -> torch.Tensor:
    """BitFit's ``norm(x)·g + b`` of the tasks with a bias on ``norm``; returns ``normed``."""
    for delta, rows in deltas:
        bias = delta.norm_bias.get(norm)
        if bias is not None:
            add_rows(normed, rows, bias.expand(num_rows(rows), -1))
    return normed


def sublayer_with_residual(linear: Linear, x: torch.Tensor, residual: torch.Tensor, deltas: LayerRows,
                           site: str, adapter_place: str) -> torch.Tensor:  # fmt: skip
    """``residual + linear(x) + Δ(x)``, with the adapters at ``adapter_place`` applied to
    ``linear(x) + Δ(x)`` first; without adapters the shared op keeps its fused residual add."""
    if not any(adapter_place in delta.adapters for delta, _ in deltas):
        return add_site_deltas(linear.add(x, residual), x, deltas, site)
    out = add_site_deltas(linear(x), x, deltas, site)
    for delta, rows in deltas:
        adapter = delta.adapters.get(adapter_place)
        if adapter is not None:
            add_rows(out, rows, adapter(out[rows]))
    return out.add_(residual)


def add_head_biases(y: torch.Tensor, tasks: TaskRows, which: str) -> torch.Tensor:
    """BitFit's final-norm (``which="norm"``) or LM-head (``"lm_head"``) bias on the tasks' rows."""
    for task, rows in tasks.groups:
        bias = task.final_norm_bias if which == "norm" else task.lm_head_bias
        if bias is not None:
            add_rows(y, rows, bias.expand(num_rows(rows), -1))
    return y
