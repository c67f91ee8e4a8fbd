"""Start-up and admission errors name what is wrong: missing files, unsupported configs, KV overflow."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from helix.errors import CapacityError, EngineError, RequestError
from node_agent.config import parse_config
from node_agent.engine import StageEngine
from node_agent.sampling import SamplingParams


def _copy(tiny_llama: tuple[Path, Any], tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(tiny_llama[0], out)
    return out


def test_missing_weights_file_names_the_dir(tiny_llama: tuple[Path, Any], tmp_path: Path) -> None:
    model_dir = _copy(tiny_llama, tmp_path)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(EngineError, match=r"model: no \*\.safetensors weights file"):
        StageEngine(model_dir)


def test_missing_config_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"config\.json: model config file not found"):
        StageEngine(tmp_path)


def test_missing_tensor_in_sharded_index_names_tensor(tiny_llama: tuple[Path, Any], tmp_path: Path) -> None:
    model_dir = _copy(tiny_llama, tmp_path)
    index = {"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EngineError, match="model.layers.0.input_layernorm.weight"):
        StageEngine(model_dir, 0, 1)


@pytest.mark.parametrize(
    ("patch", "field"),
    [({"model_type": "gpt2"}, "model_type"),
     ({"architectures": ["MistralForCausalLM"]}, "architectures"),
     ({"hidden_act": "gelu"}, "hidden_act"),
     ({"attention_bias": True}, "attention_bias"),
     ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.rope_type")],
)
def test_unsupported_config_names_the_field(patch: dict[str, Any], field: str) -> None:
    raw = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 2, "num_attention_heads": 2} | patch
    with pytest.raises(EngineError, match=field):
        parse_config(raw, "m/config.json")


def test_missing_required_field_is_named() -> None:
    with pytest.raises(EngineError, match="'hidden_size'"):
        parse_config({"model_type": "llama"})


def test_request_larger_than_kv_capacity_is_refused(tiny_llama: tuple[Path, Any]) -> None:
    engine = StageEngine(tiny_llama[0], kv_capacity_tokens=64)
    with pytest.raises(CapacityError, match=r"'big' needs 70 KV tokens .* only 64"):
        engine.add_request("big", SamplingParams(max_tokens=60), prompt_token_ids=list(range(10)))
    assert not engine.has_request("big") and engine.kv_usage().reserved_tokens == 0
    engine.add_request("ok", SamplingParams(max_tokens=54), prompt_token_ids=list(range(10)))


def test_bad_request_shapes(tiny_llama: tuple[Path, Any]) -> None:
    engine = StageEngine(tiny_llama[0], 1, 4)
    with pytest.raises(RequestError, match="layer range"):
        engine.add_request("r", SamplingParams(), prompt_len=3, layer_range=(0, 2))
    with pytest.raises(RequestError, match="prompt_len"):
        engine.add_request("r", SamplingParams())
    with pytest.raises(RequestError, match="token ids"):
        StageEngine(tiny_llama[0]).add_request("r", SamplingParams(), prompt_token_ids=[1, 10_000])
    engine.add_request("r", SamplingParams(), prompt_len=3)
    import torch

    with pytest.raises(EngineError, match="expected"):
        engine.push_hidden("r", torch.zeros(3, 5))
    with pytest.raises(EngineError, match="layer range"):
        StageEngine(tiny_llama[0], 2, 9)


def test_unknown_request_is_a_request_error(tiny_llama: tuple[Path, Any]) -> None:
    engine = StageEngine(tiny_llama[0])
    with pytest.raises(RequestError, match="unknown request 'ghost'"):
        engine.push_token("ghost", 3)
    engine.cancel("ghost")  # cancelling twice / late is harmless
