"""The planner counts fine-tuned tasks (docs/pets.md): the PETs' memory comes out of every node's KV
and layer limit (helix.task_memory), their per-task cost into the serving model's iterations; a
cluster without tasks plans exactly as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from helix.errors import InfeasiblePlanError, PETError
from helix.profile import ProfileSet, layer_limits, load_profile_file, load_profiles_for
from helix.spec import load_cluster
from helix.task_memory import pet_layer_bytes, task_memory
from planner.api import make_plan
from planner.capacity import CapacityModel
from planner.serving_model import ServingModel
from planner.serving_workload import Workload

from .conftest import DEMO, SINGLE24

LAYERS, HIDDEN, RANK = 4, 64, 8
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_BYTES_PER_LAYER = len(QKVO) * 2 * RANK * HIDDEN * 2  # A [8, 64] + B [64, 8] per module, 2 bytes a value
MB = 1e6


def peft_lora(directory: Path, rank: int = RANK) -> Path:
    """A LoRA in PEFT's files: on q/k/v/o of every layer of the tiny model."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16}))
    tensors = {}
    for i in range(LAYERS):
        for m in QKVO:
            key = f"base_model.model.model.layers.{i}.self_attn.{m}"
            tensors[f"{key}.lora_A.weight"] = np.zeros((rank, HIDDEN), np.float32)
            tensors[f"{key}.lora_B.weight"] = np.zeros((HIDDEN, rank), np.float32)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def tiny_cluster(root: Path, tasks: int, *, curves: bool = False, rank: int = RANK) -> Path:
    """Two nodes of 40 MB for weights + KV, a 4-layer model of 10 MB layers: each holds at most 3 layers
    (no KV is left with 4); ``tasks`` LoRA tasks, all one directory under many names."""
    kv = [(40 * MB - k * 10 * MB) / 256 for k in range(1, 4)]
    tp: dict = {"max_layers": 3, "kv_capacity_tokens_by_layers": kv}
    if curves:
        tp |= {"prefill_ms_per_layer": [[0, 0], [256, 4.0]], "decode_ms_per_layer": [[0, 0], [1, 1.0], [32, 2.0]],
               "pet_ms_per_layer": {"lora": [[1, 0.05], [64, 0.5]]}}
    else:
        tp["tok_s"] = [900.0, 500.0, 330.0]
    (root / "profiles.yaml").write_text(yaml.safe_dump({
        "models": {"tiny": {"num_layers": LAYERS, "hidden_size": HIDDEN, "dtype_bytes": 2,
                            "layer_weight_bytes": 10 * MB, "kv_bytes_per_token_per_layer": 256}},
        "gpus": {"small": {"vram_gb": 0.05, "throughput": {"tiny": tp}}}}))  # fmt: skip
    lora = peft_lora(root / f"lora-{rank}", rank)
    path = root / f"cluster-{tasks}.yaml"
    path.write_text(yaml.safe_dump({
        "name": "tiny", "model": "tiny", "profiles": "profiles.yaml",
        "nodes": [{"id": "n0", "gpu": "small"}, {"id": "n1", "gpu": "small"}],
        "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 1}},
        "tasks": [{"name": f"t{i}", "path": str(lora)} for i in range(tasks)]}))  # fmt: skip
    return path


def test_a_task_files_header_gives_its_bytes_per_layer(tmp_path: Path) -> None:
    pet_type, per_layer = pet_layer_bytes(str(peft_lora(tmp_path / "lora")), LAYERS, 2)
    assert pet_type == "lora"
    assert per_layer == (LORA_BYTES_PER_LAYER,) * LAYERS  # held in the model's dtype, not the file's float32
    memory = task_memory(load_cluster(tiny_cluster(tmp_path, 1000)), LAYERS, 2)
    assert memory is not None and memory.tasks == 1000 and memory.pet_types == {"lora": 1000}
    assert memory.held(2) == pytest.approx(2 * 1000 * LORA_BYTES_PER_LAYER)


def test_sparse_and_head_tensors_count_as_a_stage_holds_them(tmp_path: Path) -> None:
    d = tmp_path / "diff"
    d.mkdir()
    (d / "helix_pet.json").write_text(json.dumps({"pet_type": "diff"}))
    save_file({"model.layers.1.mlp.down_proj.weight_diff.indices": np.zeros((2, 100), np.int64),
               "model.layers.1.mlp.down_proj.weight_diff.values": np.zeros(100, np.float32),
               "lm_head.bias": np.zeros(1000, np.float32)}, str(d / "pet_model.safetensors"))  # fmt: skip
    _, per_layer = pet_layer_bytes(str(d), LAYERS, 2)
    assert per_layer == (0.0, 800.0, 0.0, 2000.0)  # 100 CSR entries of 8 bytes; the head's bias on the last layer


def test_a_broken_task_file_is_an_error_naming_it(tmp_path: Path) -> None:
    lora = peft_lora(tmp_path / "lora")
    (lora / "adapter_model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(PETError, match="adapter_model.safetensors: not a safetensors file"):
        pet_layer_bytes(str(lora), LAYERS, 2)


def test_many_tasks_take_layers_and_kv_from_a_small_node_and_change_the_plan(tmp_path: Path) -> None:
    plain, with_tasks = load_cluster(tiny_cluster(tmp_path, 0)), load_cluster(tiny_cluster(tmp_path, 1000))
    before = load_profiles_for(plain).throughput("small", "tiny")
    after = load_profiles_for(with_tasks).throughput("small", "tiny")
    assert before.max_layers == 3
    # 1,000 LoRA tasks take 8.2 MB a layer: 3 layers would leave no KV, 2 leave 3.6 MB
    assert after.max_layers == 2
    per_layer = 1000 * LORA_BYTES_PER_LAYER / 256
    assert after.kv_capacity_tokens_by_layers is not None and before.kv_capacity_tokens_by_layers is not None
    assert after.kv_capacity_tokens_by_layers[1] == pytest.approx(before.kv_capacity_tokens_by_layers[1] - 2 * per_layer)
    assert after.tok_s == [900.0, 500.0]
    assert CapacityModel.build(plain, load_profiles_for(plain)).max_layers == {"n0": 3, "n1": 3}
    assert CapacityModel.build(with_tasks, load_profiles_for(with_tasks)).max_layers == {"n0": 2, "n1": 2}
    plan_before = make_plan(plain, load_profiles_for(plain), method="petals")
    plan_after = make_plan(with_tasks, load_profiles_for(with_tasks), method="petals")
    assert max(e - s for s, e in plan_before.placement.values()) == 3
    assert all(e - s == 2 for s, e in plan_after.placement.values())
    limits = "\n".join(layer_limits(with_tasks, load_profiles_for(with_tasks)))
    assert "after the 1000 tasks' PETs (0.02 GB of 2 layers)" in limits


def test_tasks_that_leave_no_room_for_one_layer_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InfeasiblePlanError, match="500 tasks' PETs take 0.033 GB in one layer"):
        load_profiles_for(load_cluster(tiny_cluster(tmp_path, 500, rank=8 * RANK)))


@pytest.mark.parametrize("path", [DEMO, SINGLE24])
def test_without_tasks_the_profiles_and_plans_are_the_same_as_before(path: Path) -> None:
    cluster = load_cluster(path)
    assert not cluster.tasks
    raw = ProfileSet()
    for file in cluster.profile_paths():
        raw = raw.merged(load_profile_file(file))
    loaded = load_profiles_for(cluster)
    assert loaded == raw
    a, b = make_plan(cluster, loaded, method="petals"), make_plan(cluster, raw, method="petals")
    assert (a.placement, a.max_flow_tok_s, a.flows) == (b.placement, b.max_flow_tok_s, b.flows)
    cap = CapacityModel.build(cluster, loaded)
    assert cap.task_mix == {}
    placement = dict(a.placement)
    flows = {(e.src, e.dst): e.tok_s for e in a.flows}
    base = ServingModel(cap).estimate(placement, flows, a.max_flow_tok_s, iterations=2)
    none = ServingModel(cap, Workload(task_mix={})).estimate(placement, flows, a.max_flow_tok_s, iterations=2)
    assert base == none  # bit for bit


def test_the_serving_model_prices_the_tasks_a_batch_touches(tmp_path: Path) -> None:
    cluster = load_cluster(tiny_cluster(tmp_path, 64, curves=True))
    cap = CapacityModel.build(cluster, load_profiles_for(cluster))
    assert cap.task_mix == {"lora": 64}
    by_cluster, base = ServingModel(cap), ServingModel(cap, Workload(task_mix={}))
    few, many = ServingModel(cap, Workload(task_mix={"lora": 2})), ServingModel(cap, Workload(task_mix={"lora": 1000}))
    for batch in (1.0, 8.0, 32.0):
        assert base.decode_s("n0", 2, batch) < few.decode_s("n0", 2, batch) <= by_cluster.decode_s("n0", 2, batch)
        assert by_cluster.decode_s("n0", 2, batch) <= many.decode_s("n0", 2, batch)
    assert base.prefill_s("n0", 2) < by_cluster.prefill_s("n0", 2)
