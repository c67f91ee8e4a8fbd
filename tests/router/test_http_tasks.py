"""Fine-tuned tasks served end to end: the ``openai`` client -> HTTP -> coordinator -> ZeroMQ -> three
``helix agent`` processes (SmolLM2-135M; placement cpu-0 [0, 30), cpu-1 [0, 16), cpu-2 [16, 30)).

A PEFT LoRA (saved by ``peft``'s ``save_pretrained``, with an ``alpha_pattern``) and a Diff-Pruning
task (Helix's layout) are listed in the cluster file's ``tasks:``; a mask task is loaded and
unloaded at runtime through ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``. Greedy
tokens equal the references: ``peft`` on the transformers model for the LoRA, transformers on a
copy of the base with the diff or mask merged into its weights for the others. Every agent reads
the task directories itself, only the tensors of its own layers. PETs that do not fit the base are
refused naming the file and the tensor, disturbing nothing. Many tasks batched together, and
tasks loaded and unloaded under load, are test_http_tasks_mixed.py's.
"""

from __future__ import annotations

import copy
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from router.tasks import TaskState
from tests.router.pet_tasks import (
    MAX_LORA_RANK,
    MODEL,
    NEW_TOKENS,
    ServingCluster,
    complete,
    load,
    peft_lora,
    random_diff,
    random_mask_complement,
    smollm2_hf,
    unload,
)

API_KEY = "test-key"  # as tests/router/conftest.py serves it


def merged(hf: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """A copy of the base with a diff added to / a mask applied on its weights."""
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, t in tensors.items():
            layer, rest = int(name.split(".")[2]), name.split(".", 3)[3]
            module, _, leaf = rest.rpartition(".")
            weight = model.model.layers[layer].get_submodule(module).weight
            if leaf == "weight_diff":
                weight += t.to_dense()
            else:
                weight[t.to_dense()] = 0.0
    return model.eval()


def greedy(model: Any, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuations, ended by an end-of-sequence token as the server ends them (its text is dropped)."""
    out = []
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
            out.append([t for t in ids[0, len(prompt):].tolist() if t not in eos])
    return out


@pytest.fixture(scope="module")
def hf() -> Any:
    return smollm2_hf()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 23, 40)]


@pytest.fixture(scope="module")
def task_dirs(tmp_path_factory: pytest.TempPathFactory, hf: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """The task directories and each task's reference tokens (and the base's)."""
    from node_agent.task_files import save_pet

    root = tmp_path_factory.mktemp("tasks")
    lora = peft_lora(hf, root / "sql-lora")
    diff, mask = random_diff(hf), random_mask_complement(hf)
    save_pet(root / "diff-task", "diff", diff, base_model=MODEL)
    save_pet(root / "mask-task", "mask", mask)
    return {
        "root": root,
        "ref": {"sql-lora": greedy(lora, prompts), "diff-task": greedy(merged(hf, diff), prompts),
                "mask-task": greedy(merged(hf, mask), prompts), MODEL: greedy(hf, prompts)},
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, demo_cluster: Path, task_dirs: dict[str, Any],
            cluster_server: Any) -> Iterator[ServingCluster]:  # fmt: skip
    """The test cluster with ``tasks:`` in its cluster file (paths relative to it)."""
    raw = yaml.safe_load(demo_cluster.read_text())
    root = task_dirs["root"]
    raw["tasks"] = [{"name": "sql-lora", "path": os.path.relpath(root / "sql-lora", demo_cluster.parent)},
                    {"name": "diff-task", "path": str(root / "diff-task")}]
    path = demo_cluster.with_name("cluster-tasks.yaml")
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    for serving in cluster_server(tmp_path_factory, path):
        registry = serving.coordinator.tasks
        registry.max_lora_rank = MAX_LORA_RANK
        serving.wait_until(lambda r=registry: len(r.ready()) == 2, 120, "the tasks listed at start")
        yield serving


def tokens_of(cluster: ServingCluster, out: Any) -> list[int]:
    return cluster.coordinator.tokenizer.encode(out.choices[0].text)


def expected_text(cluster: ServingCluster, ids: list[int]) -> str:
    return cluster.coordinator.tokenizer.decode(ids)


# ---- correctness ------------------------------------------------------------------------------------


def test_tasks_from_the_cluster_file_give_their_references_greedy_tokens(cluster: ServingCluster,
                                                                        task_dirs: dict[str, Any],
                                                                        prompts: list[list[int]]) -> None:  # fmt: skip
    refs = task_dirs["ref"]
    nodes_seen: set[tuple[str, ...]] = set()
    for name in ("sql-lora", "diff-task", MODEL):
        for prompt, ref in zip(prompts, refs[name], strict=True):
            out = complete(cluster, name, prompt)
            assert out.choices[0].text == expected_text(cluster, ref), name
            assert out.model == name
            nodes_seen |= {tuple(s["node"] for s in p) for p in out.model_extra["helix"]["pipelines"]}
    assert any(len(p) > 1 for p in nodes_seen)  # some went through a pipeline of two agents
    for name in ("sql-lora", "diff-task"):
        assert refs[name] != refs[MODEL]  # the task really changes the output


def test_models_list_the_base_and_every_task_with_its_parent(cluster: ServingCluster) -> None:
    models = {m.id: m for m in cluster.client().models.list().data}
    assert models[MODEL].model_extra.get("parent") is None
    assert models["sql-lora"].model_extra["parent"] == MODEL
    assert models["diff-task"].model_extra["parent"] == MODEL


def test_an_unknown_task_is_a_404_naming_it(cluster: ServingCluster, prompts: list[list[int]]) -> None:
    with pytest.raises(openai.NotFoundError, match="the model 'no-such-task' does not exist here") as err:
        complete(cluster, "no-such-task", prompts[0])
    assert err.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError, match="the model 'no-such-task' does not exist here"):  # before a stream
        cluster.client().chat.completions.create(model="no-such-task", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, stream=True)  # fmt: skip
    response = unload(cluster, "no-such-task")
    assert response.status_code == 404
    assert "task 'no-such-task' is not loaded" in response.json()["error"]["message"]


def test_metrics_count_requests_and_tokens_per_task(cluster: ServingCluster, prompts: list[list[int]]) -> None:
    complete(cluster, "diff-task", prompts[0], max_tokens=3)
    with cluster.http() as http:
        text = http.get("/metrics").text
    samples = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]
    requests = {lab["task"]: v for n, lab, v in samples if n == "helix_task_requests_total"}
    tokens = {(lab["task"], lab["kind"]): v for n, lab, v in samples if n == "helix_task_tokens_total"}
    assert requests["diff-task"] >= 1 and requests["sql-lora"] >= 1
    assert tokens["diff-task", "generated"] >= 3 and tokens["diff-task", "prompt"] >= len(prompts[0])


# ---- runtime load / unload ---------------------------------------------------------------------------


def test_a_task_loaded_at_runtime_serves_then_unloads_after_its_request_in_flight(
        cluster: ServingCluster, task_dirs: dict[str, Any], prompts: list[list[int]]) -> None:  # fmt: skip
    response = load(cluster, "mask-task", task_dirs["root"] / "mask-task")
    assert response.status_code == 200, response.text
    assert "Success: task 'mask-task' (mask) loaded" in response.text
    assert "mask-task" in [m.id for m in cluster.client().models.list().data]
    for prompt, ref in zip(prompts[:2], task_dirs["ref"]["mask-task"], strict=False):
        assert complete(cluster, "mask-task", prompt).choices[0].text == expected_text(cluster, ref)
    agents = cluster.coordinator.tasks.tasks["mask-task"].nbytes
    assert set(agents) == {"cpu-0", "cpu-1", "cpu-2"} and agents["cpu-1"] < agents["cpu-0"]  # cpu-1: 16 of 30 layers

    alone = complete(cluster, "mask-task", prompts[1], max_tokens=40).choices[0].text
    stream = cluster.client().completions.create(model="mask-task", prompt=prompts[1], max_tokens=40, temperature=0,
                                                 stream=True)  # fmt: skip
    chunks = iter(stream)
    parts = [next(chunks).choices[0].text]
    unloaded: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: unloaded.append(unload(cluster, "mask-task")))
    thread.start()
    task = cluster.coordinator.tasks.tasks["mask-task"]
    cluster.wait_until(lambda: task.state is TaskState.UNLOADING, 30, "the unload to start")
    assert task.in_flight == 1  # the streaming request is still running
    with pytest.raises(openai.NotFoundError, match="mask-task"):  # no new request for an unloading task
        complete(cluster, "mask-task", prompts[0])
    parts += [c.choices[0].text for c in chunks if c.choices]
    assert "".join(parts) == alone  # the request in flight finished, whole
    thread.join(timeout=60)
    assert unloaded and unloaded[0].status_code == 200, unloaded
    assert "mask-task" not in [m.id for m in cluster.client().models.list().data]
    with pytest.raises(openai.NotFoundError):
        complete(cluster, "mask-task", prompts[0])
    assert load(cluster, "mask-task", task_dirs["root"] / "mask-task").status_code == 200  # loads again
    assert unload(cluster, "mask-task").status_code == 200


def test_the_tasks_command_lists_loads_and_unloads(cluster: ServingCluster, task_dirs: dict[str, Any],
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from helix.cli import main

    url = ["--url", cluster.base_url, "--api-key", API_KEY]
    assert main(["tasks", *url, "--load", f"cli-mask={task_dirs['root'] / 'mask-task'}"]) == 0
    assert "Success: task 'cli-mask' (mask) loaded" in capsys.readouterr().out
    assert main(["tasks", *url]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in ("cli-mask", "sql-lora", "diff-task", MODEL))
    assert main(["tasks", *url, "--unload", "cli-mask"]) == 0 and "cli-mask" not in cluster.coordinator.tasks.tasks
    assert main(["tasks", *url, "--unload", "cli-mask"]) == 1
    assert "404: task 'cli-mask' is not loaded" in capsys.readouterr().err


# ---- bad input at registration ------------------------------------------------------------------------


def _broken_lora(src: Path, dst: Path, edit: Any) -> Path:
    """A copy of PEFT's directory ``src`` with its tensors edited."""
    dst.mkdir()
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = load_file(src / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


PEFT_A = "base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight"
PEFT_B = "base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight"


def _wrong_shape(t: dict[str, torch.Tensor]) -> None:
    t[PEFT_B.format(i=3)] = torch.zeros(100, 8)


def _layer_past_the_model(t: dict[str, torch.Tensor]) -> None:
    t[PEFT_A.format(i=30)] = torch.zeros(8, 576)
    t[PEFT_B.format(i=30)] = torch.zeros(576, 8)


def _rank_above_the_maximum(t: dict[str, torch.Tensor]) -> None:
    t[PEFT_A.format(i=20)] = torch.zeros(32, 576)
    t[PEFT_B.format(i=20)] = torch.zeros(576, 32)


@pytest.mark.parametrize(("edit", "match"), [
    (_wrong_shape, r"adapter_model\.safetensors: model\.layers\.3\.self_attn\.q_proj\.lora_B: shape \[100, 8\] "
                   r"does not fit the base model \(expected \[576, 8\]\)"),
    (_layer_past_the_model, r"adapter_model\.safetensors: base_model\.model\.model\.layers\.30\.self_attn\.q_proj\."
                            r"lora_A\.weight: layer 30 is outside the base model's 30 layers"),
    (_rank_above_the_maximum, r"adapter_model\.safetensors: model\.layers\.20\.self_attn\.q_proj\.lora_A: rank 32 is "
                              r"above the configured maximum 16"),
], ids=["wrong-shape", "layer-count", "rank"])
def test_a_lora_that_does_not_fit_is_refused_naming_file_and_tensor(cluster: ServingCluster,
                                                                   task_dirs: dict[str, Any], edit: Any, match: str,
                                                                   prompts: list[list[int]]) -> None:  # fmt: skip
    root = task_dirs["root"]
    bad = _broken_lora(root / "sql-lora", root / f"bad-{edit.__name__}", edit)
    response = load(cluster, "bad", bad)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "task 'bad' was not loaded" in error["message"]
    assert re.search(match, error["message"]), error["message"]
    _nothing_disturbed(cluster, task_dirs, prompts)


def test_a_mask_of_the_wrong_size_and_bad_directories_are_refused(cluster: ServingCluster,
                                                                  task_dirs: dict[str, Any],
                                                                  prompts: list[list[int]]) -> None:  # fmt: skip
    from node_agent.task_files import save_pet

    root = task_dirs["root"]
    dense = save_pet(root / "dense-mask", "mask", {"model.layers.2.self_attn.o_proj.weight_mask": torch.ones(576, 100)})
    response = load(cluster, "bad-mask", dense)
    assert response.status_code == 400
    assert ("pet_model.safetensors: model.layers.2.self_attn.o_proj.weight_mask: shape [576, 100] does not fit the "
            "base model (expected [576, 576])") in response.json()["error"]["message"]
    sparse = save_pet(root / "sparse-mask", "mask", {"model.layers.25.mlp.down_proj.weight_mask_complement":
                                                     torch.sparse_coo_tensor([[0], [2000]], [True], (576, 2000))})
    message = load(cluster, "bad-mask", sparse).json()["error"]["message"]
    assert ("pet_model.safetensors: model.layers.25.mlp.down_proj.weight_mask_complement.indices: indices outside "
            "the base weight's shape [576, 1536]") in message
    missing = load(cluster, "nowhere", root / "no-such-dir")
    assert missing.status_code == 400 and "no-such-dir: not a directory" in missing.json()["error"]["message"]
    (root / "bad-json").mkdir()
    (root / "bad-json" / "helix_pet.json").write_text('{"pet_type": "prefix"}')
    message = load(cluster, "bad-json", root / "bad-json").json()["error"]["message"]
    assert "helix_pet.json: pet_type: Input should be 'lora', 'adapter', 'bitfit', 'diff' or 'mask'" in message
    taken = load(cluster, "sql-lora", root / "sql-lora")
    assert taken.status_code == 400 and "task 'sql-lora' is already ready" in taken.json()["error"]["message"]
    base = load(cluster, MODEL, root / "sql-lora")
    assert base.status_code == 400 and "is the base model's name" in base.json()["error"]["message"]
    _nothing_disturbed(cluster, task_dirs, prompts)


@pytest.mark.parametrize(("pet_type", "tensors", "match"), [
    ("adapter", {"model.layers.5.mlp_adapter.down.weight": torch.zeros(16, 576),
                 "model.layers.5.mlp_adapter.up.weight": torch.zeros(576, 8)},
     r"model\.layers\.5\.mlp_adapter\.up\.weight: shape \[576, 8\] does not fit the base model \(expected "
     r"\[576, 16\]\)"),
    ("bitfit", {"model.layers.3.self_attn.k_proj.bias": torch.zeros(576)},
     r"model\.layers\.3\.self_attn\.k_proj\.bias: shape \[576\] does not fit the base model \(expected \[192\]\)"),
    ("bitfit", {"model.layers.3.input_layernorm.bias": torch.zeros(576), "lm_head.bias": torch.zeros(1000)},
     r"lm_head\.bias: shape \[1000\] does not fit the base model \(expected \[49152\]\)"),
    ("diff", {"model.layers.31.self_attn.q_proj.weight_diff":
              torch.sparse_coo_tensor([[0], [0]], [1.0], (576, 576), check_invariants=True)},
     r"model\.layers\.31\.self_attn\.q_proj\.weight_diff\.(indices|values): layer 31 is outside the base model's 30 layers"),
], ids=["adapter-shape", "bitfit-shape", "head-bias-on-the-last-stages-only", "diff-layer-count"])
def test_a_pet_in_helix_layout_that_does_not_fit_is_refused_naming_file_and_tensor(
        cluster: ServingCluster, task_dirs: dict[str, Any], prompts: list[list[int]], tmp_path: Path,
        pet_type: str, tensors: dict[str, torch.Tensor], match: str) -> None:  # fmt: skip
    """Wrong shapes and a layer past the model, for the PET types of Helix's layout. A bad LM-head bias
    is read only by the agents ending the model (cpu-0, cpu-2): cpu-1 loads the task and unloads it again."""
    from node_agent.task_files import save_pet

    response = load(cluster, "bad", save_pet(tmp_path / "bad", pet_type, tensors))
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "task 'bad' was not loaded" in message
    assert re.search(r"pet_model\.safetensors: " + match, message), message
    _nothing_disturbed(cluster, task_dirs, prompts)


def _nothing_disturbed(cluster: ServingCluster, task_dirs: dict[str, Any], prompts: list[list[int]]) -> None:
    assert sorted(t.name for t in cluster.coordinator.tasks.tasks.values()) == ["diff-task", "sql-lora"]
    out = complete(cluster, "sql-lora", prompts[0])
    assert out.choices[0].text == expected_text(cluster, task_dirs["ref"]["sql-lora"][0])


def test_task_routes_need_an_api_key_beyond_loopback(cluster: ServingCluster) -> None:
    from fastapi.testclient import TestClient

    from router.app import create_app

    open_app = TestClient(create_app(cluster.coordinator, task_admin_without_key=False))
    refused = open_app.post("/v1/unload_lora_adapter", json={"lora_name": "sql-lora"})
    assert refused.status_code == 403 and "needs an API key" in refused.json()["error"]["message"]
    keyed = TestClient(create_app(cluster.coordinator, api_keys=["k"], task_admin_without_key=False))
    assert keyed.post("/v1/unload_lora_adapter", json={"lora_name": "sql-lora"}).status_code == 401
    assert "sql-lora" in [t.name for t in cluster.coordinator.tasks.ready()]
    wrong = httpx.post(f"{cluster.base_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"},
                       headers={"Authorization": "Bearer not-the-key"})
    assert wrong.status_code == 401 and API_KEY != "not-the-key"


def test_a_restarted_agent_gets_the_tasks_again(cluster: ServingCluster, task_dirs: dict[str, Any],
                                                prompts: list[list[int]]) -> None:  # fmt: skip
    """cpu-2 (layers [16, 30)) is killed and restarted empty: the coordinator loads every registered
    task on it before routing through it, so LoRA requests over cpu-1 -> cpu-2 still match peft."""
    cluster.agents.kill("cpu-2")
    cluster.wait_until(lambda: not cluster.health()["nodes"]["cpu-2"], 30, "cpu-2 to be seen dead")
    cluster.agents.start_one("cpu-2")
    cluster.agents.wait_ready(timeout_s=240)
    cluster.wait_until(lambda: cluster.health()["nodes"]["cpu-2"], 60, "cpu-2 back")
    pipelines: set[tuple[str, ...]] = set()
    for i in range(6):
        prompt, ref = prompts[i % 3], task_dirs["ref"]["sql-lora"][i % 3]
        out = complete(cluster, "sql-lora", prompt)
        assert out.choices[0].text == expected_text(cluster, ref)
        pipelines |= {tuple(s["node"] for s in p) for p in out.model_extra["helix"]["pipelines"]}
    assert ("cpu-1", "cpu-2") in pipelines
