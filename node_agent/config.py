"""Model configuration: parse a HF-style ``config.json`` into a validated :class:`ModelConfig`.

Only the Llama family is supported (``model_type: llama``, SiLU MLP, no biases). Anything else
is refused at start-up with an :class:`~helix.errors.EngineError` that names the file and field.
RoPE parameters are read from either the classic ``rope_theta`` + ``rope_scaling`` keys or the
newer ``rope_parameters`` block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from helix.errors import EngineError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_type`` is one of :data:`SUPPORTED_ROPE_TYPES`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""  # what the weights call themselves: config.json's _name_or_path, else the dir's name

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V one token occupies in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def layer_weight_bytes(self, dtype_bytes: int = 4) -> int:
        """Bytes of one decoder layer's weights (attention, SwiGLU MLP, two RMSNorms)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        params = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
        return params * dtype_bytes


def _field(raw: dict[str, Any], key: str, source: str) -> Any:
    if key not in raw:
        raise EngineError(f"{source}: missing required field '{key}'")
    return raw[key]


def _rope(raw: dict[str, Any], source: str) -> RopeConfig:
    params = raw.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        field = "rope_scaling"
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise EngineError(
            f"{source}: unsupported {field}.rope_type '{rope_type}' (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Validate a ``config.json`` dict; raise :class:`EngineError` naming the offending field."""
    model_type = raw.get("model_type")
    if model_type != "llama":
        raise EngineError(f"{source}: unsupported model_type '{model_type}' (only 'llama' is supported)")
    for arch in raw.get("architectures") or []:
        if arch != "LlamaForCausalLM":
            raise EngineError(f"{source}: unsupported architectures entry '{arch}' (only LlamaForCausalLM)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise EngineError(f"{source}: unsupported hidden_act '{act}' (only 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise EngineError(f"{source}: unsupported {flag}=true")
    if raw.get("pretraining_tp", 1) != 1:
        raise EngineError(f"{source}: unsupported pretraining_tp={raw['pretraining_tp']} (only 1)")
    hidden = int(_field(raw, "hidden_size", source))
    heads = int(_field(raw, "num_attention_heads", source))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        vocab_size=int(_field(raw, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(_field(raw, "intermediate_size", source)),
        num_layers=int(_field(raw, "num_hidden_layers", source)),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope(raw, source),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=str(raw.get("_name_or_path") or ""),
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate ``<model_dir>/config.json``."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise EngineError(f"{path}: model config file not found")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{path}: not valid JSON ({exc})") from exc
    config = parse_config(raw, str(path))
    return config if config.name else replace(config, name=Path(model_dir).resolve().name)


def check_serves(config: ModelConfig, model_dir: str | Path, *, model: str, num_layers: int, hidden_size: int,
                 where: str) -> None:  # fmt: skip
    """Refuse weights that are not the cluster's ``model`` (its layer count and hidden size, as
    ``where`` — the cluster's profiles — gives them), naming both models."""
    if (config.num_layers, config.hidden_size) == (num_layers, hidden_size):
        return
    raise EngineError(
        f"the weights in {model_dir} are not the cluster's model: the cluster serves {model!r} ({num_layers} layers, "
        f"hidden size {hidden_size}, from {where}) but the weights are {config.name!r} ({config.num_layers} layers, "
        f"hidden size {config.hidden_size}); pass --model-dir with the weights of {model!r} (config.json + safetensors)"
    )
