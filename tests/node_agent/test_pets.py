"""Fine-tuned tasks on SmolLM2-135M (node_agent.pets, .stage_task, .task_ops): each PET type gives its
reference's greedy tokens, and a step mixing many tasks and the base gives each request the tokens it
gets alone.

References: LoRA through ``peft`` on the transformers model; BitFit, Diff-Pruning and masks through
transformers on a copy of the base with the PET merged into its weights (norm biases as forward
hooks: Llama's RMSNorm has no bias); the bottleneck adapter through forward hooks on the attention
and MLP blocks. PET parameters are random with fixed seeds, large enough to change the output.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from helix.errors import EngineError, PETError, RequestError, UnknownTaskError
from node_agent import pets, stage_task, task_ops
from node_agent.config import ModelConfig, load_config
from node_agent.engine import StageEngine
from node_agent.pets import LINEAR_MODULES, NORMS, TaskPET, lora_tensors_from_peft, module_shape
from node_agent.pipeline import LocalPipeline
from node_agent.sampling import SamplingParams
from node_agent.scheduler import SchedulerConfig

NEW_TOKENS = 8
CHUNKED = SchedulerConfig(max_batch_size=8, token_budget=40, chunk_size=16)
STAGES = [(0, 10), (10, 20), (20, 30)]
LORA_ALPHA = 16
HF_MODULES = [m.rpartition(".")[2] for m in LINEAR_MODULES]  # q_proj ... down_proj, as PEFT targets them


# ---- random PETs (fixed seeds) ----------------------------------------------------------------

def random_lora(config: ModelConfig, seed: int, rank: int, modules: tuple[str, ...]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(config.num_layers):
        for m in modules:
            n_out, n_in = module_shape(config, m)
            out[f"model.layers.{i}.{m}.lora_A"] = torch.randn(rank, n_in, generator=gen) / n_in ** 0.5
            out[f"model.layers.{i}.{m}.lora_B"] = torch.randn(n_out, rank, generator=gen) * 0.06
    return out


def random_adapter(config: ModelConfig, seed: int, bottleneck: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, out = config.hidden_size, {}
    for i in range(config.num_layers):
        for place in pets.ADAPTER_PLACES:
            p = f"model.layers.{i}.{place}"
            out[f"{p}.down.weight"] = torch.randn(bottleneck, h, generator=gen) / h ** 0.5
            out[f"{p}.down.bias"] = torch.randn(bottleneck, generator=gen) * 0.1
            out[f"{p}.up.weight"] = torch.randn(h, bottleneck, generator=gen) * 0.1 / bottleneck ** 0.5
            out[f"{p}.up.bias"] = torch.randn(h, generator=gen) * 0.02
    return out


def random_bitfit(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(config.num_layers):
        for m in LINEAR_MODULES:
            out[f"model.layers.{i}.{m}.bias"] = torch.randn(module_shape(config, m)[0], generator=gen) * 0.05
        for norm in NORMS:
            out[f"model.layers.{i}.{norm}.bias"] = torch.randn(config.hidden_size, generator=gen) * 0.05
    out["model.norm.bias"] = torch.randn(config.hidden_size, generator=gen) * 0.1
    out["lm_head.bias"] = torch.randn(config.vocab_size, generator=gen) * 0.5
    return out


def _positions(gen: torch.Generator, shape: tuple[int, int], density: float) -> torch.Tensor:
    flat = torch.randperm(shape[0] * shape[1], generator=gen)[: int(density * shape[0] * shape[1])]
    return torch.stack([flat // shape[1], flat % shape[1]])


def random_diff(config: ModelConfig, seed: int, density: float = 0.005) -> dict[str, torch.Tensor]:
    """Sparse COO deltas, 99.5 % zeros (PetS's Diff-Pruning setting)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(config.num_layers):
        for m in LINEAR_MODULES:
            shape = module_shape(config, m)
            idx = _positions(gen, shape, density)
            out[f"model.layers.{i}.{m}.weight_diff"] = torch.sparse_coo_tensor(
                idx, torch.randn(idx.shape[1], generator=gen) * 0.3, shape, check_invariants=True)
    return out


def random_mask(config: ModelConfig, seed: int, zeroed: float = 0.04) -> dict[str, torch.Tensor]:
    """Dense 0/1 masks zeroing ``zeroed`` of every weight."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(config.num_layers):
        for m in LINEAR_MODULES:
            shape = module_shape(config, m)
            mask = torch.ones(shape, dtype=torch.bool)
            idx = _positions(gen, shape, zeroed)
            mask[idx[0], idx[1]] = False
            out[f"model.layers.{i}.{m}.weight_mask"] = mask
    return out


@pytest.fixture(scope="session")
def smollm2_config(smollm2_dir: Path) -> ModelConfig:
    return load_config(smollm2_dir)


@pytest.fixture(scope="session")
def task_pets(smollm2_config: ModelConfig) -> dict[str, TaskPET]:
    """Six tasks of all five types: two LoRAs (rank 8 on every linear; rank 4 on q/v, PEFT's default)."""
    cfg = smollm2_config
    return {
        "lora": TaskPET.from_tensors("lora", random_lora(cfg, 1, 8, LINEAR_MODULES), lora_scaling=LORA_ALPHA / 8),
        "lora-qv": TaskPET.from_tensors("lora", random_lora(cfg, 2, 4, ("self_attn.q_proj", "self_attn.v_proj")),
                                        lora_scaling=LORA_ALPHA / 4),
        "adapter": TaskPET.from_tensors("adapter", random_adapter(cfg, 3), adapter_activation="relu"),
        "bitfit": TaskPET.from_tensors("bitfit", random_bitfit(cfg, 4)),
        "diff": TaskPET.from_tensors("diff", random_diff(cfg, 5)),
        "mask": TaskPET.from_tensors("mask", random_mask(cfg, 6)),
    }


# ---- references on transformers ---------------------------------------------------------------

def _module(model: Any, layer: int, module: str) -> Any:
    block = model.model.layers[layer]
    for part in module.split("."):
        block = getattr(block, part)
    return block


@contextmanager
def hooked(model: Any, hooks: list[tuple[Any, Any]]) -> Iterator[Any]:
    handles = [module.register_forward_hook(fn) for module, fn in hooks]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def _add_output(delta: Any) -> Any:
    """A forward hook adding ``delta(output)`` to a module's output (the first item of a tuple)."""
    def hook(_module: Any, _args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (output[0] + delta(output[0]), *output[1:])
        return output + delta(output)
    return hook


def lora_reference(hf: Any, tensors: dict[str, torch.Tensor], rank: int) -> Any:
    """``peft`` on a copy of the base, with our LoRA tensors set in it (and read back through PEFT's names)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                          target_modules=HF_MODULES))  # fmt: skip
    peft_names = {f"base_model.model.{name}.weight": t for name, t in tensors.items()}
    result = set_peft_model_state_dict(model, peft_names)
    assert not result.unexpected_keys
    saved = lora_tensors_from_peft(get_peft_model_state_dict(model))
    assert saved.keys() == tensors.keys() and all(torch.equal(saved[k], tensors[k]) for k in tensors)
    return model


def merged_reference(hf: Any, kind: str, tensors: dict[str, torch.Tensor], config: ModelConfig) -> Any:
    """A copy of the base with the BitFit biases / diff / mask merged into its weights."""
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, t in tensors.items():
            if name == "lm_head.bias":
                model.lm_head.bias = torch.nn.Parameter(t.clone())
                continue
            if name == "model.norm.bias":
                continue  # RMSNorm has no bias: a hook (bitfit_hooks)
            layer, rest = int(name.split(".")[2]), name.split(".", 3)[3]
            module, _, leaf = rest.rpartition(".")
            if module in NORMS:
                continue
            linear = _module(model, layer, module)
            if leaf == "bias":
                linear.bias = torch.nn.Parameter(t.clone())
            elif leaf == "weight_diff":
                linear.weight += t.to_dense()
            else:
                assert leaf == "weight_mask"
                linear.weight *= t
    return model


def bitfit_hooks(model: Any, tensors: dict[str, torch.Tensor], config: ModelConfig) -> list[tuple[Any, Any]]:
    hooks = [(model.model.norm, _add_output(lambda _h, b=tensors["model.norm.bias"]: b))]
    for i in range(config.num_layers):
        for norm in NORMS:
            bias = tensors[f"model.layers.{i}.{norm}.bias"]
            hooks.append((_module(model, i, norm), _add_output(lambda _h, b=bias: b)))
    return hooks


def adapter_hooks(model: Any, tensors: dict[str, torch.Tensor], config: ModelConfig) -> list[tuple[Any, Any]]:
    """Houlsby placement: ``h + up(relu(down(h)))`` on the attention block's and the MLP's output."""
    def adapter(p: str) -> Any:
        return lambda h: torch.nn.functional.linear(
            torch.relu(torch.nn.functional.linear(h, tensors[f"{p}.down.weight"], tensors[f"{p}.down.bias"])),
            tensors[f"{p}.up.weight"], tensors[f"{p}.up.bias"])
    hooks = []
    for i in range(config.num_layers):
        layer = model.model.layers[i]
        hooks.append((layer.self_attn, _add_output(adapter(f"model.layers.{i}.attn_adapter"))))
        hooks.append((layer.mlp, _add_output(adapter(f"model.layers.{i}.mlp_adapter"))))
    return hooks


def hf_tokens(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False)  # fmt: skip
        out.append(ids[0, len(prompt):].tolist())
    return out


# ---- our engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def pipeline(smollm2_dir: Path, task_pets: dict[str, TaskPET]) -> LocalPipeline:
    """Three stages, every task bound on each (each stage keeps the PET of its own layers)."""
    engines = [StageEngine(smollm2_dir, a, b, scheduler=CHUNKED, kv_capacity_tokens=4096) for a, b in STAGES]
    for engine in engines:
        for name, pet in task_pets.items():
            engine.add_task(name, pet)
    return LocalPipeline(engines)


def run(pipe: LocalPipeline, requests: list[tuple[list[int], str | None]], join_every: int = 2) -> list[list[int]]:
    """Requests join one every ``join_every`` steps, while others are mid-prefill (chunked) or decoding."""
    tokens: list[list[int]] = [[] for _ in requests]
    step = 0
    while step < join_every * len(requests) or pipe.has_unfinished:
        if step % join_every == 0 and step // join_every < len(requests):
            i = step // join_every
            prompt, task = requests[i]
            pipe.add_request(str(i), prompt, SamplingParams(max_tokens=NEW_TOKENS), task=task)
        for out in pipe.step():
            tokens[int(out.request_id)].append(out.token)  # type: ignore[arg-type]
        step += 1
        assert step < 2000
    return tokens


@pytest.fixture(scope="session")
def base_tokens(pipeline: LocalPipeline, smollm2_prompts: list[list[int]]) -> list[list[int]]:
    return run(pipeline, [(p, None) for p in smollm2_prompts[:3]])


REFERENCE_CASES = ["lora", "adapter", "bitfit", "diff", "mask"]


@pytest.mark.parametrize("kind", REFERENCE_CASES)
def test_each_pet_type_matches_its_reference(kind: str, pipeline: LocalPipeline, smollm2_hf: Any,
                                             smollm2_config: ModelConfig, smollm2_prompts: list[list[int]],
                                             base_tokens: list[list[int]]) -> None:  # fmt: skip
    cfg, prompts = smollm2_config, smollm2_prompts[:3]
    ours = run(pipeline, [(p, kind) for p in prompts])
    if kind == "lora":
        ref = hf_tokens(lora_reference(smollm2_hf, random_lora(cfg, 1, 8, LINEAR_MODULES), 8), prompts)
    elif kind == "adapter":
        with hooked(smollm2_hf, adapter_hooks(smollm2_hf, random_adapter(cfg, 3), cfg)) as model:
            ref = hf_tokens(model, prompts)
    else:
        seed, tensors = {"bitfit": (4, random_bitfit), "diff": (5, random_diff), "mask": (6, random_mask)}[kind]
        params = tensors(cfg, seed)
        model = merged_reference(smollm2_hf, kind, params, cfg)
        with hooked(model, bitfit_hooks(model, params, cfg) if kind == "bitfit" else []):
            ref = hf_tokens(model, prompts)
    assert ours == ref
    assert all(o != b for o, b in zip(ours, base_tokens, strict=True)), "the PET does not change the output"


def test_mixed_batch_equals_each_task_alone(pipeline: LocalPipeline, smollm2_prompts: list[list[int]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """12 requests over 6 tasks of all five types and the base, joining mid-flight through three
    chunked-prefill stages: each gets exactly the tokens it gets alone."""
    names: list[str | None] = ["lora", "adapter", None, "bitfit", "diff", "mask", "lora-qv",
                               "lora", None, "mask", "lora-qv", "adapter"]  # fmt: skip
    requests = [(smollm2_prompts[i % len(smollm2_prompts)], name) for i, name in enumerate(names)]
    alone = [run(pipeline, [r])[0] for r in requests]
    tasks_per_step: list[int] = []
    group = task_ops.TaskRows.group

    def counting(spans: Any, device: torch.device) -> task_ops.TaskRows | None:
        rows = group(spans, device)
        tasks_per_step.append(0 if rows is None else len(rows.groups))
        return rows

    monkeypatch.setattr(task_ops.TaskRows, "group", counting)
    assert run(pipeline, requests, join_every=2) == alone
    assert max(tasks_per_step) >= 4  # steps really held the rows of many tasks at once
    assert run(pipeline, requests[::-1], join_every=1) == alone[::-1]
    base = run(pipeline, [(p, None) for p, _ in requests])
    assert sum(a != b for a, b in zip(alone, base, strict=True)) >= 9  # the tasks really differ from the base
    for engine in pipeline.engines:
        assert engine.kv_usage().reserved_tokens == 0 and not engine.has_unfinished


def test_tasks_over_per_request_layer_sub_ranges(smollm2_dir: Path, task_pets: dict[str, TaskPET],
                                                 pipeline: LocalPipeline,
                                                 smollm2_prompts: list[list[int]]) -> None:  # fmt: skip
    """Two overlapping stages [0, 20) and [10, 30); each request splits at its own layer (10, 15 or 20),
    so a step of either stage runs rows of several tasks over different layer sub-ranges."""
    stages = [StageEngine(smollm2_dir, a, b, scheduler=CHUNKED, kv_capacity_tokens=2048)
              for a, b in ((0, 20), (10, 30))]
    for engine in stages:
        for name in ("lora", "adapter", "bitfit", "mask"):
            engine.add_task(name, task_pets[name])
    head, tail = stages
    requests = [("lora", 10), ("adapter", 15), (None, 20), ("bitfit", 15), ("mask", 20), ("lora", 15)]
    prompts = [smollm2_prompts[i + 1] for i in range(len(requests))]
    alone = [run(pipeline, [(p, task)])[0] for p, (task, _) in zip(prompts, requests, strict=True)]
    sampling = SamplingParams(max_tokens=NEW_TOKENS)
    for i, ((task, split), prompt) in enumerate(zip(requests, prompts, strict=True)):
        head.add_request(str(i), sampling, prompt_token_ids=prompt, layer_range=(0, split), task=task)
        tail.add_request(str(i), sampling, prompt_len=len(prompt), layer_range=(split, 30), task=task)
    tokens: list[list[int]] = [[] for _ in requests]
    while head.has_unfinished or tail.has_unfinished:
        for out in head.step().outputs:
            assert out.hidden is not None
            tail.push_hidden(out.request_id, out.hidden)
        for out in tail.step().outputs:
            if out.token is None:
                continue
            tokens[int(out.request_id)].append(out.token)
            if out.finish_reason:
                head.cancel(out.request_id)
            else:
                head.push_token(out.request_id, out.token)
    assert tokens == alone


def test_a_stage_keeps_only_its_layers_of_a_task(pipeline: LocalPipeline, smollm2_dir: Path,
                                                 task_pets: dict[str, TaskPET]) -> None:  # fmt: skip
    bound = [engine.tasks["bitfit"] for engine in pipeline.engines]
    for (start, end), task in zip(STAGES, bound, strict=True):
        assert sorted(task.layers) == list(range(start, end))
    assert [t.has_head_bias for t in bound] == [False, False, True]  # the final norm / LM head: last stage only
    for name in ("lora", "diff", "mask"):
        whole = task_pets[name]
        per_stage = [engine.tasks[name].nbytes for engine in pipeline.engines]
        assert all(0 < n < whole.nbytes for n in per_stage)
    # the bound diff is the CSR of its layers only: 0.5 % of each weight, int32 indices
    site = pipeline.engines[0].tasks["diff"].layers[0].sites["qkv"]
    assert site.sparse is not None and site.sparse.layout == torch.sparse_csr
    assert site.sparse.col_indices().dtype == torch.int32
    density = site.sparse.values().numel() / (site.sparse.shape[0] * site.sparse.shape[1])
    assert density == pytest.approx(0.005, rel=0.02)


# ---- bad input, and the base path untouched -----------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    """A random 4-layer Llama (hidden 64, 4 heads over 2 KV heads, MLP 112)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    model_dir = tmp_path_factory.mktemp("tiny-pets") / "model"
    model.save_pretrained(model_dir)
    return model_dir, load_config(model_dir)


def test_a_base_only_step_never_runs_a_task_op(tiny: tuple[Path, ModelConfig],
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    model_dir, cfg = tiny
    engine = StageEngine(model_dir, kv_capacity_tokens=256)
    engine.add_task("l", TaskPET.from_tensors("lora", random_lora(cfg, 0, 2, LINEAR_MODULES)))
    engine.add_task("b", TaskPET.from_tensors("bitfit", random_bitfit(cfg, 0)))

    def forbidden(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("a base-only step ran a task op")

    for name in ("add_site_deltas", "add_norm_biases", "sublayer_with_residual", "add_head_biases"):
        monkeypatch.setattr(task_ops, name, forbidden)
    engine.add_request("base", SamplingParams(max_tokens=3), prompt_token_ids=[1, 2, 3])
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step().outputs
    assert len(outputs) == 3
    engine.add_request("task", SamplingParams(max_tokens=3), prompt_token_ids=[1, 2, 3], task="l")
    with pytest.raises(AssertionError, match="ran a task op"):
        engine.step()


def test_one_task_op_on_scattered_rows_is_the_dense_delta(tiny: tuple[Path, ModelConfig]) -> None:
    """The unified form on rows that are not one span (gathered, then scattered with index_add_):
    LoRA on q and v, a sparse delta on k and a bias on q, all in one task, equal ``x·ΔWᵀ + b``."""
    _, cfg = tiny
    gen = torch.Generator().manual_seed(3)
    q, k, v = (module_shape(cfg, f"self_attn.{m}_proj") for m in "qkv")
    lora = {m: pets.LoRAWeights(torch.randn(2, q[1], generator=gen), torch.randn(shape[0], 2, generator=gen), 0.5)
            for m, shape in (("self_attn.q_proj", q), ("self_attn.v_proj", v))}
    diff = torch.randn(k, generator=gen) * (torch.rand(k, generator=gen) < 0.005)
    layer = pets.LayerPET(lora=lora, diff={"self_attn.k_proj": diff.to_sparse().coalesce()},
                          bias={"self_attn.q_proj": torch.randn(q[0], generator=gen)})
    task = stage_task.bind_task("t", TaskPET(pets.PETType.LORA, {1: layer}), cfg, 0, 4)
    assert sorted(task.layers) == [1] and sorted(task.layers[1].sites) == ["qkv"]
    tasks = task_ops.TaskRows.group([(task, slice(0, 2)), (None, slice(2, 4)), (task, slice(4, 5)),
                                     (None, slice(5, 6))], torch.device("cpu"))  # fmt: skip
    assert tasks is not None and torch.equal(tasks.groups[0][1], torch.tensor([0, 1, 4]))
    assert tasks.at(0) == [] and len(tasks.at(1)) == 1
    x, y = torch.randn(6, q[1], generator=gen), torch.randn(6, q[0] + k[0] + v[0], generator=gen)
    got = task_ops.add_site_deltas(y.clone(), x, tasks.at(1), "qkv")
    delta_w = torch.cat([lora["self_attn.q_proj"].b @ lora["self_attn.q_proj"].a * 0.5, diff,
                         lora["self_attn.v_proj"].b @ lora["self_attn.v_proj"].a * 0.5])
    bias = torch.cat([layer.bias["self_attn.q_proj"], torch.zeros(k[0] + v[0])])
    rows = [0, 1, 4]
    torch.testing.assert_close(got[rows], y[rows] + x[rows] @ delta_w.T + bias)
    assert torch.equal(got[[2, 3, 5]], y[[2, 3, 5]])
    spans = y.clone()  # the same task op on one span of rows, added in place
    task.layers[1].sites["qkv"].add_to(spans, x, slice(1, 3))
    torch.testing.assert_close(spans[1:3], y[1:3] + x[1:3] @ delta_w.T + bias)


def test_a_bound_task_lies_in_one_buffer_of_its_own(tiny: tuple[Path, ModelConfig]) -> None:
    """Every tensor of a bound task (a sparse delta's indices and values too) is a view of one buffer
    just the size of the task: no allocation per tensor, and nothing it was built from kept alive (a
    sparse tensor's values() is a view whose base is the whole tensor; a CSR bound from it kept the
    int64 COO it was converted from: 3x its own bytes, bench/pets.py (a))."""
    model_dir, cfg = tiny
    gen = torch.Generator().manual_seed(4)
    diff = torch.randn(module_shape(cfg, "mlp.up_proj"), generator=gen)
    diff *= torch.rand(diff.shape, generator=gen) < 0.005
    pet = TaskPET.from_tensors("lora", random_lora(cfg, 1, 2, ("self_attn.q_proj", "self_attn.v_proj")))
    pet.layers[1].diff["mlp.up_proj"] = diff.to_sparse().coalesce()  # the unified form: one task may hold both
    task = stage_task.bind_task("t", pet, cfg, 0, 4)
    parts = [p for t in stage_task._stage_tensors(task) for p in stage_task._dense_parts(t)]
    storages = {p.untyped_storage().data_ptr() for p in parts}
    assert len(parts) == 4 * 3 + 3 and len(storages) == 1  # per layer A and two B; the CSR's three
    assert parts[0].untyped_storage().nbytes() <= task.nbytes + 64 * len(parts)
    assert all(p.data_ptr() % 64 == 0 for p in parts)
    engine = StageEngine(model_dir, kv_capacity_tokens=64)  # and it runs as before: the same as its unpacked delta
    engine.add_task("t", pet)
    x = torch.randn(3, cfg.hidden_size, generator=gen)
    site = engine.tasks["t"].layers[1].sites["gate_up"]
    want = x @ torch.cat([torch.zeros(module_shape(cfg, "mlp.gate_proj")), diff]).T
    torch.testing.assert_close(site.delta(x), want)


def test_the_batched_lora_kernel_equals_each_task_op(tiny: tuple[Path, ModelConfig],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """One ``lora_segments`` call per fused linear for all the tasks of a step (ranks 1 to 8, different
    modules, per-module scales, a task with a bias and a sparse delta beside its LoRA, a task on scattered
    rows) adds what each task's own op adds on its rows, and leaves the base rows alone."""
    from node_agent import native

    _, cfg = tiny
    kernels = native.ops()
    assert kernels is not None, native.unavailable_reason()
    gen = torch.Generator().manual_seed(7)

    layer = 1
    specs = [(8, pets.ATTENTION_MODULES), (1, ("self_attn.v_proj",)), (4, ("self_attn.q_proj", "self_attn.o_proj")),
             (3, pets.LINEAR_MODULES)]
    tasks = [stage_task.bind_task(f"t{i}", TaskPET.from_tensors("lora", random_lora(cfg, i, r, mods),
                                                                lora_scaling=0.5 + i),
                                  cfg, 0, 4) for i, (r, mods) in enumerate(specs)]  # fmt: skip
    k_shape = module_shape(cfg, "self_attn.k_proj")
    mixed = tasks[3].layers[layer].sites["qkv"]  # the last task also has a bias and a sparse delta on qkv
    mixed.bias = torch.randn(mixed.out_features, generator=gen)
    mixed.sparse = (torch.randn(mixed.out_features, k_shape[1], generator=gen)
                    * (torch.rand(mixed.out_features, k_shape[1], generator=gen) < 0.01)).to_sparse_csr()
    spans = [(tasks[0], slice(0, 3)), (None, slice(3, 4)), (tasks[1], slice(4, 5)), (tasks[2], slice(5, 13)),
             (tasks[3], slice(13, 14)), (tasks[0], slice(15, 16)), (None, slice(14, 15))]
    rows = task_ops.TaskRows.group(spans, torch.device("cpu"))
    assert rows is not None and isinstance(rows.groups[0][1], torch.Tensor)  # tasks[0]: rows 0-2 and 15
    deltas = rows.at(layer)
    calls: list[int] = []
    op = kernels.lora_segments

    def counting(*args: Any) -> None:
        calls.append(len(args[2]))
        op(*args)

    monkeypatch.setattr(task_ops, "_lora_kernel", lambda y, x: counting)
    for site in stage_task.STAGE_SITES:
        width = sum(module_shape(cfg, m)[0] for m in stage_task.STAGE_SITES[site])
        in_features = module_shape(cfg, stage_task.STAGE_SITES[site][0])[1]
        x, y = torch.randn(16, in_features, generator=gen), torch.randn(16, width, generator=gen)
        got = task_ops.add_site_deltas(y.clone(), x, deltas, site)
        want = y.clone()
        for delta, task_rows in deltas:
            if site in delta.sites:
                delta.sites[site].add_to(want, x, task_rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[[3, 14]], y[[3, 14]])  # the base rows
        assert not torch.equal(got[13], y[13])  # tasks[3] has an op on every fused linear
    # one call per fused linear, holding every task on one span (tasks[0]'s scattered rows go alone)
    assert calls == [3, 2, 1, 1]
    with pytest.raises(RuntimeError, match=r"lora_segments: entry 0 out of range"):
        op(torch.zeros(2, 4), torch.zeros(2, 3), [torch.zeros(1, 3)], [torch.zeros(1, 4)], [0, 5, 0, 1], [0, 0], [1.0])


def _lora(cfg: ModelConfig, **over: torch.Tensor) -> dict[str, torch.Tensor]:
    tensors = random_lora(cfg, 0, 2, ("self_attn.q_proj",))
    tensors.update(over)
    return tensors


@pytest.mark.parametrize(("kind", "tensors", "match"), [
    ("lora", lambda cfg: _lora(cfg, **{"model.layers.1.self_attn.q_proj.lora_B": torch.zeros(5, 2)}),
     r"model\.layers\.1\.self_attn\.q_proj\.lora_B: shape \[5, 2\] does not fit the base model \(expected \[64, 2\]\)"),
    ("lora", lambda cfg: {"model.layers.9.mlp.up_proj.lora_A": torch.zeros(2, 64),
                          "model.layers.9.mlp.up_proj.lora_B": torch.zeros(112, 2)},
     r"model\.layers\.9\.mlp\.up_proj\.lora_A: layer 9 is outside the base model's 4 layers"),
    ("lora", lambda cfg: {"model.layers.0.mlp.up_proj.lora_A": torch.zeros(2, 64)},
     r"model\.layers\.0\.mlp\.up_proj: has no lora_B beside its lora_A"),
    ("lora", lambda cfg: {"model.layers.0.mlp.up_proj.weight_diff": torch.zeros(112, 64)},
     r"model\.layers\.0\.mlp\.up_proj\.weight_diff: not a tensor of a lora PET"),
    ("diff", lambda cfg: {"model.layers.0.mlp.up_proj.weight_diff": torch.ones(112, 64)},
     r"weight_diff: 100\.00% of its entries are set; a Diff-Pruning delta must be at most 1%"),
    ("mask", lambda cfg: {"model.layers.2.self_attn.o_proj.weight_mask": torch.full((64, 64), 0.5)},
     r"model\.layers\.2\.self_attn\.o_proj\.weight_mask: a weight_mask holds only 0 and 1"),
    ("mask", lambda cfg: {"model.layers.2.self_attn.o_proj.weight_mask": torch.eye(64) == 0},
     None),  # 1/64 zeroed: fine
    ("mask", lambda cfg: {"model.layers.2.self_attn.o_proj.weight_mask": torch.zeros(64, 64)},
     r"weight_mask: 100\.00% of its entries are set; the entries a mask zeroes must be at most 5%"),
    ("bitfit", lambda cfg: {"model.layers.0.input_layernorm.bias": torch.full((64,), float("nan"))},
     r"model\.layers\.0\.input_layernorm\.bias: holds NaN or infinite values"),
    ("adapter", lambda cfg: {"model.layers.0.attn_adapter.down.weight": torch.zeros(8, 64),
                             "model.layers.0.attn_adapter.up.weight": torch.zeros(64, 4)},
     r"model\.layers\.0\.attn_adapter\.up\.weight: shape \[64, 4\] does not fit the base model "
     r"\(expected \[64, 8\]\)"),
], ids=["lora-shape", "layer-range", "lora-half", "wrong-type", "dense-diff", "mask-values", "mask-ok",
        "dense-mask", "nan-bias", "adapter-shape"])
def test_a_pet_that_does_not_fit_is_refused_naming_the_tensor(tiny: tuple[Path, ModelConfig], kind: str,
                                                               tensors: Any, match: str | None) -> None:  # fmt: skip
    model_dir, cfg = tiny
    engine = StageEngine(model_dir, kv_capacity_tokens=64)
    if match is None:
        engine.add_task("t", TaskPET.from_tensors(kind, tensors(cfg)))
        assert "t" in engine.tasks
        return
    with pytest.raises(PETError, match=match):
        engine.add_task("t", TaskPET.from_tensors(kind, tensors(cfg)))
    assert engine.tasks == {}


def test_lora_rank_limit_unknown_type_and_peft_names(tiny: tuple[Path, ModelConfig]) -> None:
    model_dir, cfg = tiny
    engine = StageEngine(model_dir, kv_capacity_tokens=64)
    pet = TaskPET.from_tensors("lora", random_lora(cfg, 0, 16, ("self_attn.v_proj",)))
    with pytest.raises(PETError, match=r"model\.layers\.0\.self_attn\.v_proj\.lora_A: rank 16 is above the "
                                       r"configured maximum 8"):  # fmt: skip
        engine.add_task("big", pet, max_lora_rank=8)
    with pytest.raises(PETError, match=r"unknown PET type 'prefix' \(one of: lora, adapter, bitfit, diff, mask\)"):
        TaskPET.from_tensors("prefix", {})
    with pytest.raises(PETError, match=r"base_model\.model\.model\.embed_tokens\.lora_embedding_A: not a LoRA"):
        lora_tensors_from_peft({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(1)})


def test_unknown_task_and_unloaded_task(tiny: tuple[Path, ModelConfig]) -> None:
    """An unknown task is refused and queues nothing; unloading a task lets its requests in flight finish."""
    model_dir, cfg = tiny
    engine = StageEngine(model_dir, kv_capacity_tokens=256)
    with pytest.raises(UnknownTaskError, match=r"request 'r': task 'nope' is not loaded on stage \[0, 4\)") as err:
        engine.add_request("r", SamplingParams(max_tokens=2), prompt_token_ids=[1, 2], task="nope")
    assert err.value.http_status == 404 and not engine.has_request("r") and not engine.has_unfinished
    engine.add_task("b", TaskPET.from_tensors("bitfit", random_bitfit(cfg, 1)))
    engine.add_request("r", SamplingParams(max_tokens=4), prompt_token_ids=[1, 2], task="b")
    engine.step()
    engine.remove_task("b")
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step().outputs
    assert len(outputs) == 3 and outputs[-1].finish_reason == "length"
    with pytest.raises(UnknownTaskError):
        engine.add_request("r2", SamplingParams(max_tokens=2), prompt_token_ids=[1, 2], task="b")


@pytest.mark.vllm
def test_the_vllm_backend_refuses_tasks(tiny: tuple[Path, ModelConfig]) -> None:
    from node_agent.backends import StageBackend

    model_dir, cfg = tiny
    engine = StageEngine(model_dir, kv_capacity_tokens=64, backend=StageBackend("vllm"))
    with pytest.raises(EngineError, match=r"fine-tuned tasks \(PETs\) run on the torch backend only \(task 'b'\)"):
        engine.add_task("b", TaskPET.from_tensors("bitfit", random_bitfit(cfg, 1)))
    with pytest.raises(RequestError, match=r"request 'r' names task 'b', but backend vllm"):
        engine.add_request("r", SamplingParams(max_tokens=2), prompt_token_ids=[1, 2], task="b")
