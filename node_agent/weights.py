"""Stage weights: load ONLY the tensors a stage's layer range needs from a HF-style model dir.

A model dir holds ``config.json`` plus one or more ``*.safetensors`` files (optionally with a
``model.safetensors.index.json``). A stage ``[start, end)`` reads its decoder layers, the token
embedding if ``start == 0``, and the final norm + LM head if ``end == num_layers`` (the
embedding doubles as LM head when ``tie_word_embeddings`` is set). Tensors come back float32.
A stage that takes on more layers while it serves reads theirs (:func:`tensor_names`), after
checking what they will take (:func:`tensors_nbytes`, from the file headers alone).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from helix.errors import EngineError
from node_agent.config import ModelConfig

LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def stage_tensor_names(config: ModelConfig, start: int, end: int) -> list[str]:
    """The checkpoint tensor names a stage holding layers ``[start, end)`` must load."""
    return tensor_names(config, range(start, end), embed=start == 0, head=end == config.num_layers)


def tensor_names(config: ModelConfig, layers: Iterable[int], *, embed: bool, head: bool) -> list[str]:
    """The checkpoint tensor names of ``layers``, plus the embedding (``embed``) and the final norm
    and LM head (``head``; the embedding again when tied)."""
    names = [f"model.layers.{i}.{t}" for i in layers for t in LAYER_TENSORS]
    if embed:
        names.append(EMBED)
    if head:
        names.append(FINAL_NORM)
        names.append(EMBED if config.tie_word_embeddings else LM_HEAD)
    return list(dict.fromkeys(names))


def tensors_nbytes(model_dir: str | Path, names: list[str], element_size: int) -> int:
    """Bytes the named tensors take at ``element_size`` bytes a value, from the safetensors headers
    (nothing is read but the shapes)."""
    by_file: dict[Path, list[str]] = {}
    index = _tensor_index(Path(model_dir))
    for name in names:
        if name not in index:
            raise EngineError(f"{model_dir}: weights tensor '{name}' not found in any *.safetensors file")
        by_file.setdefault(index[name], []).append(name)
    total = 0
    for path, in_file in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in in_file)
    return total * element_size


def _tensor_index(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{model_dir}: no *.safetensors weights file found")
    index: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                index[name] = path
    return index


def load_stage_weights(model_dir: str | Path, config: ModelConfig, start: int, end: int) -> dict[str, torch.Tensor]:
    """Load the tensors of layers ``[start, end)`` (+ embedding / head as the range requires)."""
    if not 0 <= start < end <= config.num_layers:
        raise EngineError(f"layer range [{start}, {end}) is not inside [0, {config.num_layers})")
    return load_tensors(model_dir, stage_tensor_names(config, start, end))


def load_tensors(model_dir: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Load the named tensors (float32) from the model dir's safetensors files, and nothing else."""
    model_dir = Path(model_dir)
    index = _tensor_index(model_dir)
    by_file: dict[Path, list[str]] = {}
    for name in names:
        if name not in index:
            raise EngineError(f"{model_dir}: weights tensor '{name}' not found in any *.safetensors file")
        by_file.setdefault(index[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, in_file in by_file.items():
        if not path.is_file():
            raise EngineError(f"{path}: weights file not found")
        with safe_open(str(path), framework="pt") as f:
            for name in in_file:
                tensors[name] = f.get_tensor(name).to(torch.float32)
    return tensors
