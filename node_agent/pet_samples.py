"""Random fine-tuned tasks (PETs) in the shapes issue 16 names, for measuring what tasks cost.

Random with fixed seeds, non-trivial magnitudes, named as in :mod:`node_agent.pets`: LoRA rank 8 on
q/k/v/o; bottleneck adapters of 16 after attention and MLP; BitFit biases on every linear and norm
(and the final norm and LM head when the layers reach the model's end); Diff-Pruning 0.5 % dense on
every linear (PetS's default); masks zeroing 1 % of every linear. ``helix profile`` times them
(:mod:`profiler.pet_costs`).
"""

from __future__ import annotations

import torch

from node_agent.config import ModelConfig
from node_agent.pets import ADAPTER_PLACES, ATTENTION_MODULES, LINEAR_MODULES, NORMS, TaskPET, module_shape

LORA_RANK, LORA_ALPHA, BOTTLENECK, DIFF_DENSITY, MASK_ZEROED = 8, 16, 16, 0.005, 0.01
SHAPES = {"lora": f"rank {LORA_RANK}, q/k/v/o", "adapter": f"bottleneck {BOTTLENECK}, attn + MLP",
          "bitfit": "all linears, norms, head", "diff": f"{DIFF_DENSITY:.1%} of each linear",
          "mask": f"{MASK_ZEROED:.0%} of each linear zeroed"}  # fmt: skip


def sample_tensors(kind: str, cfg: ModelConfig, seed: int, start: int = 0, end: int | None = None) -> dict[str, torch.Tensor]:
    """A task's tensors of layers ``[start, end)`` (and the head's biases for BitFit when ``end`` is the last)."""
    gen = torch.Generator().manual_seed(seed)
    end = cfg.num_layers if end is None else end
    t: dict[str, torch.Tensor] = {}
    for i in range(start, end):
        p = f"model.layers.{i}"
        if kind == "lora":
            for m in ATTENTION_MODULES:
                n_out, n_in = module_shape(cfg, m)
                t[f"{p}.{m}.lora_A"] = torch.randn(LORA_RANK, n_in, generator=gen) / n_in**0.5
                t[f"{p}.{m}.lora_B"] = torch.randn(n_out, LORA_RANK, generator=gen) * 0.06
        elif kind == "adapter":
            h = cfg.hidden_size
            for place in ADAPTER_PLACES:
                t[f"{p}.{place}.down.weight"] = torch.randn(BOTTLENECK, h, generator=gen) / h**0.5
                t[f"{p}.{place}.down.bias"] = torch.randn(BOTTLENECK, generator=gen) * 0.1
                t[f"{p}.{place}.up.weight"] = torch.randn(h, BOTTLENECK, generator=gen) * 0.1 / BOTTLENECK**0.5
                t[f"{p}.{place}.up.bias"] = torch.randn(h, generator=gen) * 0.02
        elif kind == "bitfit":
            for m in LINEAR_MODULES:
                t[f"{p}.{m}.bias"] = torch.randn(module_shape(cfg, m)[0], generator=gen) * 0.05
            for norm in NORMS:
                t[f"{p}.{norm}.bias"] = torch.randn(cfg.hidden_size, generator=gen) * 0.05
        else:  # diff / mask: sparse, at random positions (duplicates merge)
            for m in LINEAR_MODULES:
                shape = module_shape(cfg, m)
                nnz = int((DIFF_DENSITY if kind == "diff" else MASK_ZEROED) * shape[0] * shape[1])
                idx = torch.stack([torch.randint(0, shape[0], (nnz,), generator=gen),
                                   torch.randint(0, shape[1], (nnz,), generator=gen)])  # fmt: skip
                values = torch.randn(nnz, generator=gen) * 0.3 if kind == "diff" else torch.ones(nnz)
                name = "weight_diff" if kind == "diff" else "weight_mask_complement"
                t[f"{p}.{m}.{name}"] = torch.sparse_coo_tensor(idx, values, shape, check_invariants=True).coalesce()
    if kind == "bitfit" and end == cfg.num_layers:
        t["model.norm.bias"] = torch.randn(cfg.hidden_size, generator=gen) * 0.1
        t["lm_head.bias"] = torch.randn(cfg.vocab_size, generator=gen) * 0.5
    return t


def sample_pet(kind: str, cfg: ModelConfig, seed: int, start: int = 0, end: int | None = None) -> TaskPET:
    """:func:`sample_tensors` as a :class:`TaskPET` (LoRA scaling alpha / rank)."""
    return TaskPET.from_tensors(kind, sample_tensors(kind, cfg, seed, start, end), lora_scaling=LORA_ALPHA / LORA_RANK)
