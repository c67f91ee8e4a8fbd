"""Fine-tuned tasks for the served-task tests (test_http_tasks, test_http_tasks_mixed): random PETs
of SmolLM2-135M with fixed seeds and non-trivial magnitudes, named as ``node_agent.pets`` names
them (``save_pet`` writes them as Helix's layout; :func:`peft_lora` saves PEFT's files through
``peft`` itself), and the HTTP calls the tests make on a serving cluster (tests/router/conftest.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import torch

ServingCluster = Any  # tests/router/conftest.py's ServingCluster
MODEL = "smollm2-135m"  # the base model's name, as tests/router/conftest.py serves it
NEW_TOKENS = 8
HF_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
MAX_LORA_RANK = 16  # the registry's maximum in these tests


def smollm2_hf() -> Any:
    """The transformers model of the base (float32, one torch thread)."""
    from transformers import LlamaForCausalLM

    from node_agent.gguf_convert import cached_model_dir

    torch.set_num_threads(1)
    return LlamaForCausalLM.from_pretrained(cached_model_dir(), dtype=torch.float32).eval()


def _shape(hf: Any, module: str) -> tuple[int, int]:
    return tuple(hf.model.layers[0].get_submodule(module).weight.shape)  # type: ignore[return-value]


def _positions(gen: torch.Generator, shape: tuple[int, int], density: float) -> torch.Tensor:
    flat = torch.randperm(shape[0] * shape[1], generator=gen)[: int(density * shape[0] * shape[1])]
    return torch.stack([flat // shape[1], flat % shape[1]])


def peft_lora(hf: Any, directory: Path, *, rank: int = 8, seed: int = 1) -> Any:
    """A LoRA on every linear, random non-trivial A and B, saved by ``peft`` itself; returns the peft model."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=rank, lora_alpha=16, lora_dropout=0.0,
                                                          target_modules=HF_MODULES, alpha_pattern={"v_proj": 32}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.06)
    model.save_pretrained(directory)
    return model.eval()


def random_lora(hf: Any, seed: int, rank: int, modules: Iterable[str]) -> dict[str, torch.Tensor]:
    """A LoRA in Helix's layout on ``modules`` of every layer, magnitudes as :func:`peft_lora`'s."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(hf.config.num_hidden_layers):
        for m in modules:
            rows, cols = _shape(hf, m)
            out[f"model.layers.{i}.{m}.lora_A"] = torch.randn(rank, cols, generator=gen) / cols ** 0.5
            out[f"model.layers.{i}.{m}.lora_B"] = torch.randn(rows, rank, generator=gen) * 0.06
    return out


def random_diff(hf: Any, seed: int = 5, density: float = 0.005) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(hf.config.num_hidden_layers):
        for m in ATTENTION:
            shape = _shape(hf, m)
            idx = _positions(gen, shape, density)
            out[f"model.layers.{i}.{m}.weight_diff"] = torch.sparse_coo_tensor(
                idx, torch.randn(idx.shape[1], generator=gen) * 0.3, shape, check_invariants=True).coalesce()
    return out


def random_mask_complement(hf: Any, seed: int = 6, zeroed: float = 0.04) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(hf.config.num_hidden_layers):
        for m in ("self_attn.o_proj", "mlp.down_proj"):
            shape = _shape(hf, m)
            idx = _positions(gen, shape, zeroed)
            out[f"model.layers.{i}.{m}.weight_mask_complement"] = torch.sparse_coo_tensor(
                idx, torch.ones(idx.shape[1], dtype=torch.bool), shape, check_invariants=True).coalesce()
    return out


def random_adapter(hf: Any, seed: int = 7, bottleneck: int = 16) -> dict[str, torch.Tensor]:
    gen, h = torch.Generator().manual_seed(seed), hf.config.hidden_size
    out = {}
    for i in range(hf.config.num_hidden_layers):
        for place in ("attn_adapter", "mlp_adapter"):
            p = f"model.layers.{i}.{place}"
            out[f"{p}.down.weight"] = torch.randn(bottleneck, h, generator=gen) / h ** 0.5
            out[f"{p}.down.bias"] = torch.randn(bottleneck, generator=gen) * 0.1
            out[f"{p}.up.weight"] = torch.randn(h, bottleneck, generator=gen) * 0.1 / bottleneck ** 0.5
            out[f"{p}.up.bias"] = torch.randn(h, generator=gen) * 0.02
    return out


def random_bitfit(hf: Any, seed: int = 8) -> dict[str, torch.Tensor]:
    gen, h = torch.Generator().manual_seed(seed), hf.config.hidden_size
    out = {}
    for i in range(hf.config.num_hidden_layers):
        for m in (*ATTENTION, *MLP):
            out[f"model.layers.{i}.{m}.bias"] = torch.randn(_shape(hf, m)[0], generator=gen) * 0.05
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{i}.{norm}.bias"] = torch.randn(h, generator=gen) * 0.05
    out["model.norm.bias"] = torch.randn(h, generator=gen) * 0.1
    out["lm_head.bias"] = torch.randn(hf.config.vocab_size, generator=gen) * 0.5
    return out


def only(tensors: dict[str, torch.Tensor], keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors whose names ``keep`` accepts (a PET of some layers or modules only)."""
    return {name: t for name, t in tensors.items() if keep(name)}


def layer_of(name: str) -> int | None:
    """The layer a tensor name is of (``model.layers.{i}.``), None for the final norm and the LM head."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


# ---- HTTP ---------------------------------------------------------------------------------------------


def complete(cluster: ServingCluster, model: str, prompt: list[int], max_tokens: int = NEW_TOKENS) -> Any:
    return cluster.client().completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)


def load(cluster: ServingCluster, name: str, path: Path | str, **kw: Any) -> httpx.Response:
    with cluster.http() as http:
        return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **kw})


def unload(cluster: ServingCluster, name: str) -> httpx.Response:
    with cluster.http() as http:
        return http.post("/v1/unload_lora_adapter", json={"lora_name": name})
