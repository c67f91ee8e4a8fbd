"""Spec-sheet numbers of common GPUs and the decoder shapes of common models.

These are the only inputs of the roofline estimate (:mod:`profiler.roofline`): peak dense
fp16/bf16 tensor FLOP/s (no sparsity), peak memory bandwidth and VRAM, as published by the
vendor. Names are case-insensitive and ``-``/``_``/space-insensitive; ``A100`` means the
40 GB part the Helix paper used. A model is either one of :data:`BUILTIN_MODELS` or read
from a Hugging Face style ``config.json`` (or a YAML file with the same keys).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from helix.errors import ConfigError


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU as its spec sheet describes it."""

    name: str
    fp16_tflops: float  # dense tensor-core fp16/bf16, 10^12 FLOP/s
    mem_bw_gb_s: float  # 10^9 bytes/s
    vram_gb: float  # 10^9 bytes


# Vendor spec sheets (dense, i.e. half the "with sparsity" figure).
BUILTIN_GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("A100-40GB", fp16_tflops=312.0, mem_bw_gb_s=1555.0, vram_gb=40.0),
        GpuSpec("A100-80GB", fp16_tflops=312.0, mem_bw_gb_s=2039.0, vram_gb=80.0),
        GpuSpec("H100", fp16_tflops=989.4, mem_bw_gb_s=3350.0, vram_gb=80.0),  # SXM5
        GpuSpec("L4", fp16_tflops=121.0, mem_bw_gb_s=300.0, vram_gb=24.0),
        GpuSpec("T4", fp16_tflops=65.0, mem_bw_gb_s=320.0, vram_gb=16.0),
        GpuSpec("V100", fp16_tflops=125.0, mem_bw_gb_s=900.0, vram_gb=16.0),  # SXM2 16 GB
        GpuSpec("V100-32GB", fp16_tflops=125.0, mem_bw_gb_s=900.0, vram_gb=32.0),
        GpuSpec("A10G", fp16_tflops=70.0, mem_bw_gb_s=600.0, vram_gb=24.0),  # AWS g5 (A10: 125)
        GpuSpec("A10", fp16_tflops=125.0, mem_bw_gb_s=600.0, vram_gb=24.0),
        GpuSpec("RTX4090", fp16_tflops=165.2, mem_bw_gb_s=1008.0, vram_gb=24.0),  # fp32 accumulate
    )
}

# Other spellings -> canonical name. ``A100`` is the paper's 40 GB A100.
ALIASES: dict[str, str] = {"A100": "A100-40GB", "H100-SXM": "H100", "4090": "RTX4090", "V100-16GB": "V100"}


def _key(name: str) -> str:
    return name.upper().replace("_", "").replace("-", "").replace(" ", "")


_LOOKUP: dict[str, str] = {_key(n): n for n in BUILTIN_GPUS} | {_key(a): c for a, c in ALIASES.items()}


def gpu_spec(name: str) -> GpuSpec:
    """The built-in spec of ``name`` (any spelling in :data:`ALIASES` or the canonical one)."""
    canonical = _LOOKUP.get(_key(name))
    if canonical is None:
        known = ", ".join(list(BUILTIN_GPUS) + list(ALIASES))
        raise ConfigError(f"unknown GPU {name!r} (built-in: {known})", field="--gpus")
    return BUILTIN_GPUS[canonical]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the roofline needs to know about a Llama-style decoder."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int = 32000
    dtype_bytes: int = 2

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: Q, K, V, O projections and a gated MLP (norms ignored)."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def layer_weight_bytes(self) -> int:
        return self.layer_params * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes


BUILTIN_MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-2-70b", 80, 8192, 28672, 64, 8, 128),
        ModelShape("llama-2-13b", 40, 5120, 13824, 40, 40, 128),
        ModelShape("llama-2-7b", 32, 4096, 11008, 32, 32, 128),
        ModelShape("llama-3-8b", 32, 4096, 14336, 32, 8, 128, vocab_size=128256),
        ModelShape("llama-3-70b", 80, 8192, 28672, 64, 8, 128, vocab_size=128256),
        ModelShape("smollm2-135m", 30, 576, 1536, 9, 3, 64, vocab_size=49152),
    )
}

_HF_KEYS = {
    "num_layers": ("num_hidden_layers", "num_layers"),
    "hidden_size": ("hidden_size",),
    "intermediate_size": ("intermediate_size",),
    "num_heads": ("num_attention_heads", "num_heads"),
}


def model_shape_from_dict(raw: dict, name: str, source: str, dtype_bytes: int | None = None) -> ModelShape:
    """Read a Hugging Face ``config.json`` dict (or the same keys from YAML)."""
    values: dict[str, int] = {}
    for field, keys in _HF_KEYS.items():
        found = next((raw[k] for k in keys if k in raw), None)
        if not isinstance(found, int) or found <= 0:
            raise ConfigError(f"missing or invalid {keys[0]!r} (a positive integer)", source=source, field=keys[0])
        values[field] = found
    heads = values["num_heads"]
    kv_heads = raw.get("num_key_value_heads") or raw.get("num_kv_heads") or heads
    head_dim = raw.get("head_dim") or values["hidden_size"] // heads
    dtype = dtype_bytes or {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(raw.get("torch_dtype")), 2)
    return ModelShape(
        name=str(raw.get("name", name)),
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        vocab_size=int(raw.get("vocab_size", 32000)),
        dtype_bytes=int(dtype),
        **values,
    )


def load_model_shape(spec: str, *, dtype_bytes: int | None = None, given_as: str = "--model") -> ModelShape:
    """A built-in model name, or a path to a ``config.json`` / YAML file (directory: its config.json).
    ``given_as`` names where the user gave ``spec`` (the flag, or the cluster file's field) for errors."""
    if spec.lower() in BUILTIN_MODELS:
        shape = BUILTIN_MODELS[spec.lower()]
        if dtype_bytes is None:
            return shape
        return ModelShape(**{**{f: getattr(shape, f) for f in shape.__slots__}, "dtype_bytes": dtype_bytes})
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        if given_as == "--model-config":
            raise ConfigError(f"no such file or directory: {spec!r} (a Hugging Face config.json, or its directory)",
                              field=given_as)  # fmt: skip
        known = ", ".join(BUILTIN_MODELS)
        raise ConfigError(f"unknown model {spec!r}: not a built-in model ({known}) and no such file or directory; "
                          "for another model give --model-config PATH to its Hugging Face config.json", field=given_as)
    try:
        text = path.read_text()
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot parse model config: {exc}", source=str(path)) from None
    if not isinstance(raw, dict):
        raise ConfigError("expected a mapping of model constants", source=str(path))
    default_name = path.parent.name if path.name == "config.json" else path.stem
    return model_shape_from_dict(raw, default_name, str(path), dtype_bytes)
