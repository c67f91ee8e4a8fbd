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

This module owns the parameter containers as a task's files give them (:class:`TaskPET`,
whole-model, in the tensor naming below; PEFT's LoRA naming through :func:`lora_tensors_from_peft`)
and their checks against a base model's shape. The *binding* of a task to a stage (only the layers
the stage holds, laid out for its fused linears) is :mod:`node_agent.stage_task`; the task ops of an
engine step, batched over its tasks, are :mod:`node_agent.task_ops`.

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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import torch
import torch.nn.functional as F

from helix.errors import PETError
from helix.tasks import MAX_DIFF_DENSITY, MAX_MASK_COMPLEMENT_DENSITY
from node_agent.config import ModelConfig

ATTENTION_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_MODULES = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LINEAR_MODULES = ATTENTION_MODULES + MLP_MODULES
NORMS = ("input_layernorm", "post_attention_layernorm")
ADAPTER_PLACES = ("attn_adapter", "mlp_adapter")  # after the attention block / after the MLP
FINAL_NORM_BIAS, LM_HEAD_BIAS = "model.norm.bias", "lm_head.bias"
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
    :func:`node_agent.stage_task.bind_task` turns the layers a stage holds into the form the stage runs.
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
        return sum(tensor_nbytes(t) for _, t in self.tensors())

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


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds (sparse tensors: their indices and values)."""
    if t.layout == torch.sparse_coo:
        return tensor_nbytes(t.indices()) + tensor_nbytes(t.values())
    if t.layout == torch.sparse_csr:
        return tensor_nbytes(t.crow_indices()) + tensor_nbytes(t.col_indices()) + tensor_nbytes(t.values())
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
