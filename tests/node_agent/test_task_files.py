"""Task directories (node_agent.task_files, helix.tasks) on a random tiny Llama: PEFT's own files with
per-module rank and alpha patterns and rsLoRA give PEFT's logits; a stage reads only its layers; a
file Helix's writer wrote reads back; bad files are errors naming the file (and the tensor)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helix.errors import PETError
from helix.tasks import read_descriptor
from node_agent.config import load_config
from node_agent.engine import StageEngine
from node_agent.sampling import SamplingParams
from node_agent.task_files import load_task_slice, save_pet


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128)).eval()  # fmt: skip
    model_dir = tmp_path_factory.mktemp("tiny-tasks") / "model"
    model.save_pretrained(model_dir)
    return model_dir, model


def _logits(engine: StageEngine, prompt: list[int], task: str | None) -> torch.Tensor:
    engine.add_request("r", SamplingParams(max_tokens=1), prompt_token_ids=prompt, task=task)
    captured: list[torch.Tensor] = []
    logits = engine.model.logits

    def spy(hidden: torch.Tensor, tasks: Any) -> torch.Tensor:
        out = logits(hidden, tasks)
        captured.append(out)
        return out

    engine.model.logits = spy  # type: ignore[method-assign]
    try:
        while engine.has_unfinished:
            engine.step()
    finally:
        engine.model.logits = logits  # type: ignore[method-assign]
    return captured[-1][-1]


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_files_with_rank_and_alpha_patterns_give_peft_logits(tiny: tuple[Path, Any], tmp_path: Path,
                                                                  rslora: bool) -> None:  # fmt: skip
    from peft import LoraConfig, get_peft_model

    model_dir, hf = tiny
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, use_rslora=rslora,
                                               target_modules=["q_proj", "v_proj", "down_proj"],
                                               rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 24}))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    peft_model.save_pretrained(tmp_path / "lora")
    prompt = [3, 14, 15, 92, 65]
    with torch.no_grad():
        want = peft_model(torch.tensor([prompt])).logits[0, -1]
        base = peft_model.get_base_model()
        with peft_model.disable_adapter():
            plain = base(torch.tensor([prompt])).logits[0, -1]
    peft_model.unload()  # the base model back as it was (the fixture is shared)

    engine = StageEngine(model_dir, kv_capacity_tokens=64)
    descriptor, pet = load_task_slice(tmp_path / "lora", engine.config, 0, 4)
    assert descriptor.pet_type == "lora" and pet.lora_rank == 4
    engine.add_task("t", pet)
    got = _logits(engine, prompt, "t")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-3)  # the LoRA matters


def test_a_stage_reads_only_its_layers_and_the_head_biases_only_at_the_end(tiny: tuple[Path, Any],
                                                                            tmp_path: Path) -> None:  # fmt: skip
    model_dir, _ = tiny
    config = load_config(model_dir)
    tensors = {f"model.layers.{i}.self_attn.q_proj.bias": torch.full((64,), float(i)) for i in range(4)}
    tensors["lm_head.bias"] = torch.ones(97)
    diff = torch.zeros(64, 112)
    diff[5, 7] = 2.0
    save_pet(tmp_path / "bitfit", "bitfit", tensors)
    _, head = load_task_slice(tmp_path / "bitfit", config, 0, 2)
    _, tail = load_task_slice(tmp_path / "bitfit", config, 2, 4)
    assert sorted(head.layers) == [0, 1] and head.lm_head_bias is None
    assert sorted(tail.layers) == [2, 3] and tail.lm_head_bias is not None
    save_pet(tmp_path / "diff", "diff", {"model.layers.1.mlp.down_proj.weight_diff": diff.to_sparse()})
    _, pet = load_task_slice(tmp_path / "diff", config, 0, 4)
    assert torch.equal(pet.layers[1].diff["mlp.down_proj"].to_dense(), diff)  # indices + values read back
    assert read_descriptor(tmp_path / "diff").ours is not None


def test_bad_task_files_name_the_file(tiny: tuple[Path, Any], tmp_path: Path) -> None:
    model_dir, _ = tiny
    config = load_config(model_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PETError, match=r"empty: holds neither adapter_config\.json"):
        read_descriptor(tmp_path / "empty")
    (tmp_path / "nofile").mkdir()
    (tmp_path / "nofile" / "helix_pet.json").write_text('{"pet_type": "bitfit"}')
    with pytest.raises(PETError, match=r"nofile/pet_model\.safetensors: file not found"):
        read_descriptor(tmp_path / "nofile")
    (tmp_path / "nofile" / "pet_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(PETError, match=r"nofile/pet_model\.safetensors: not a readable safetensors file"):
        load_task_slice(tmp_path / "nofile", config, 0, 4)
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "use_dora": true}')
    with pytest.raises(PETError, match=r"dora/adapter_config\.json: use_dora: Input should be False"):
        read_descriptor(tmp_path / "dora")
    save_pet(tmp_path / "half", "diff", {})
    from safetensors.torch import save_file

    save_file({"model.layers.0.mlp.up_proj.weight_diff.values": torch.ones(3)},
              str(tmp_path / "half" / "pet_model.safetensors"))
    with pytest.raises(PETError, match=r"half/pet_model\.safetensors: model\.layers\.0\.mlp\.up_proj\.weight_diff"
                                       r"\.values: has values but no indices"):  # fmt: skip
        load_task_slice(tmp_path / "half", config, 0, 4)
