"""The batching policies over many tasks (PetS's coordinated batching and its baselines): pure tests of the
scheduler with fabricated cost models, then one real engine whose greedy tokens do not depend on the policy."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from helix.errors import EngineError
from helix.perf_model import CostCurve, NodeCurves
from node_agent.batching import BatchingMode, BatchingPolicy, StepCostModel, admission_order
from node_agent.kv_account import KVAccount
from node_agent.scheduler import Batch, Scheduler, SchedulerConfig

# one layer: a decode step of n requests costs 1 + n/32 ms (concave with the fixed part), a prompt token
# 0.01 ms; a LoRA task's op 0.1 ms at one row, a mask's 1 ms
CURVES = NodeCurves(prefill=CostCurve([(0, 0), (256, 2.56)]), decode=CostCurve([(0, 0), (1, 1.03), (32, 2.0)]),
                    pet={"lora": CostCurve([(1, 0.1), (32, 0.2)]), "mask": CostCurve([(1, 1.0), (32, 2.0)])})
COSTS = StepCostModel(CURVES, layers=1)
MODES = [BatchingMode.ALPHA, BatchingMode.BETA, BatchingMode.COORDINATED]


def make(mode: BatchingMode, bound: int = 8, capacity: int = 100_000, **kw: object) -> Scheduler:
    policy = BatchingPolicy(mode, bound, None if mode is BatchingMode.FCFS else COSTS)
    return Scheduler(SchedulerConfig(batching=policy, **kw), KVAccount(capacity))  # type: ignore[arg-type]


def step(s: Scheduler, max_tokens: dict[str, int], generated: dict[str, int]) -> Batch:
    """One step with fabricated outputs: a decode or a prompt's last chunk yields a token fed straight back."""
    batch = s.schedule()
    s.update(batch)
    for w in batch.work:
        if w.ends_prompt_or_decodes:
            generated[w.request_id] = generated.get(w.request_id, 0) + 1
            if generated[w.request_id] == max_tokens[w.request_id]:
                s.remove(w.request_id)
            else:
                s.add_input(w.request_id, 1)
    return batch


def interleaved(s: Scheduler, tasks: int, per_task: int, prompt: int = 4, pet_type: str = "lora") -> None:
    """``per_task`` requests of each of ``tasks`` tasks, arriving task 0, 1, ..., task 0, 1, ..."""
    for i in range(per_task):
        for t in range(tasks):
            s.add(f"t{t}-{i}", prompt, 4, pending_tokens=prompt, task=f"t{t}", pet_type=pet_type)


def test_every_mode_but_fcfs_needs_the_cost_models_and_the_bound_is_positive() -> None:
    assert SchedulerConfig().batching.fcfs
    for mode in MODES:
        with pytest.raises(EngineError, match="cost models"):
            BatchingPolicy(mode)
    with pytest.raises(EngineError, match="max_passed_over_steps"):
        BatchingPolicy(BatchingMode.COORDINATED, 0, COSTS)


def test_coordinated_admits_a_task_s_requests_together() -> None:
    fcfs, coordinated = make(BatchingMode.FCFS, max_batch_size=8), make(BatchingMode.COORDINATED, max_batch_size=8)
    for s in (fcfs, coordinated):
        interleaved(s, tasks=8, per_task=4)
    tasks = {name: {s.running[r].task for r in s.schedule().admitted} for name, s in
             (("fcfs", fcfs), ("coordinated", coordinated))}  # fmt: skip
    assert len(tasks["fcfs"]) == 8 and len(tasks["coordinated"]) == 2


def test_coordinated_fills_a_slot_from_a_running_task_before_a_new_one() -> None:
    s = make(BatchingMode.COORDINATED, max_batch_size=4)
    for i in range(3):
        s.add(f"a{i}", 4, 4, pending_tokens=4, task="a", pet_type="lora")
    s.add("m0", 4, 4, pending_tokens=4, task="m", pet_type="mask")  # older than a's last two
    s.add("a3", 4, 4, pending_tokens=4, task="a", pet_type="lora")
    assert s.schedule().admitted == ["a0", "a1", "a2", "a3"]


def test_coordinated_fills_every_slot_the_cheapest_mini_batch_per_row_first() -> None:
    s = make(BatchingMode.COORDINATED, max_batch_size=8)
    s.add("m0", 4, 4, pending_tokens=4, task="m", pet_type="mask")
    s.add("l0", 4, 4, pending_tokens=4, task="l", pet_type="lora")
    for i in range(3):
        s.add(f"m{i + 1}", 4, 4, pending_tokens=4, task="m2", pet_type="mask")
        s.add(f"a{i}", 4, 4, pending_tokens=4, task="a", pet_type="lora")
    # per row: a's LoRA 0.13 ms (α 0.03 + β 0.1), the lone LoRA the same, the three-row mask task 0.39 (its
    # op shared by three), the lone mask 1.03; every slot is filled, the costly lone mask row last
    assert s.schedule().admitted == ["a0", "a1", "a2", "l0", "m1", "m2", "m3", "m0"]


def test_alpha_admits_the_shortest_prompts_and_fills_every_slot() -> None:
    s = make(BatchingMode.ALPHA, max_batch_size=3)
    for rid, prompt in (("long", 40), ("mid", 20), ("short", 5), ("tiny", 2)):
        s.add(rid, prompt, 4, pending_tokens=prompt, task=rid, pet_type="mask")
    assert s.schedule().admitted == ["tiny", "short", "mid"]


def test_beta_runs_one_task_a_step_the_cheapest_per_row_first() -> None:
    s = make(BatchingMode.BETA, max_batch_size=8)
    s.add("m0", 4, 4, pending_tokens=4, task="m", pet_type="mask")
    for i in range(3):
        s.add(f"a{i}", 4, 4, pending_tokens=4, task="a", pet_type="lora")
    batch = s.schedule()
    assert batch.admitted == ["a0", "a1", "a2", "m0"]  # the lowest β per row first
    assert {w.request_id for w in batch.work} == {"a0", "a1", "a2"}  # one task's mini-batch
    assert batch.passed_over == ["m0"]


def test_admission_order_takes_forced_requests_first_oldest_first() -> None:
    s = make(BatchingMode.COORDINATED)
    interleaved(s, tasks=3, per_task=2)
    waiting = list(s.waiting)
    waiting[4].passed_over = waiting[1].passed_over = 8
    order = admission_order(s.config.batching, waiting, [], slots=3)
    assert [w.request_id for w in order[:2]] == [waiting[1].request_id, waiting[4].request_id]


@pytest.mark.parametrize("mode", MODES)
def test_a_request_waits_no_more_than_the_bound(mode: BatchingMode) -> None:
    """A mask request among a stream of LoRA requests (the policies' least favourite) is passed over at
    most ``bound`` steps (a step with no free slot passes no waiting request over), then runs; every step
    keeps to the token budget and the prefill chunk, and every request finishes."""
    bound = 3
    s = make(mode, bound=bound, max_batch_size=4, token_budget=16, chunk_size=8)
    max_tokens: dict[str, int] = {}
    generated: dict[str, int] = {}
    rng = random.Random(0)

    def lora(i: int) -> None:
        rid = f"a{i}"
        s.add(rid, rng.randint(1, 6), 5, pending_tokens=0, task=f"a{i % 2}", pet_type="lora")
        s.add_input(rid, s._all[rid].prompt_tokens)
        max_tokens[rid] = 5

    lora(-2)
    lora(-1)
    s.add("m0", 3, 6, pending_tokens=3, task="m", pet_type="mask")
    max_tokens["m0"] = 6
    worst = m0_worst = 0
    m0_first: int | None = None
    for i in range(200):
        while i < 150 and len(s.waiting) < 8:  # keep LoRA requests queued behind it
            lora(len(max_tokens))
        batch = step(s, max_tokens, generated)
        assert batch.num_tokens <= 16 and sum(w.num_tokens for w in batch.work if w.is_prefill) <= 8
        if m0_first is None and any(w.request_id == "m0" for w in batch.work):
            m0_first = i
        worst = max([worst, *(seq.passed_over for seq in s._all.values())])
        m0_worst = max(m0_worst, s._all["m0"].passed_over if "m0" in s else 0)
    while s.has_unfinished:
        step(s, max_tokens, generated)
    assert m0_first is not None and worst <= bound
    if mode is not BatchingMode.ALPHA:  # passed over until forced (task-blind alpha has no reason to)
        assert m0_first > 0 and m0_worst == bound
    assert all(generated[r] == n for r, n in max_tokens.items())


def test_fcfs_records_nobody_passed_over() -> None:
    s = make(BatchingMode.FCFS, max_batch_size=2)
    interleaved(s, tasks=3, per_task=2)
    assert s.schedule().passed_over == []


# ---- a real engine: the policy changes the order, never a request's tokens ------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 4-layer Llama (hidden 64, 4 heads over 2 KV heads, MLP 112)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    model_dir = tmp_path_factory.mktemp("tiny-batching") / "model"
    model.save_pretrained(model_dir)
    return model_dir


def test_a_coordinated_engine_serves_mixed_tasks_with_fcfs_s_greedy_tokens(tiny_model: Path) -> None:
    from node_agent.engine import StageEngine
    from node_agent.pet_samples import sample_pet
    from node_agent.sampling import SamplingParams

    kinds = ["lora", "adapter", "bitfit", "diff", "mask", "lora"]
    gen = torch.Generator().manual_seed(1)
    requests = [(torch.randint(0, 97, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen).tolist(),
                 None if i % 7 == 6 else f"task{i % 6}") for i in range(21)]  # fmt: skip

    def serve(mode: BatchingMode) -> tuple[dict[str, list[int]], list[str]]:
        policy = BatchingPolicy(mode, 4, None if mode is BatchingMode.FCFS else COSTS)
        engine = StageEngine(tiny_model, kv_capacity_tokens=2048,
                             scheduler=SchedulerConfig(max_batch_size=4, token_budget=32, chunk_size=16,
                                                       batching=policy))  # fmt: skip
        for t, kind in enumerate(kinds):
            engine.add_task(f"task{t}", sample_pet(kind, engine.config, seed=t))
        for i, (prompt, task) in enumerate(requests):
            engine.add_request(f"r{i}", SamplingParams(max_tokens=6), prompt_token_ids=prompt, task=task)
        tokens: dict[str, list[int]] = {}
        started: list[str] = []
        while engine.has_unfinished:
            before = set(engine.scheduler.running)
            for out in engine.step().outputs:
                if out.token is not None:
                    tokens.setdefault(out.request_id, []).append(out.token)
            started += sorted(set(engine.scheduler.running) - before, key=lambda r: int(r[1:]))
        return tokens, started

    fcfs_tokens, fcfs_order = serve(BatchingMode.FCFS)
    for mode in MODES:
        tokens, order = serve(mode)
        assert tokens == fcfs_tokens, mode
        assert all(len(t) == 6 for t in tokens.values()) and len(tokens) == len(requests)
    assert serve(BatchingMode.COORDINATED)[1] != fcfs_order  # the policy did reorder the requests


# ---- the agent's flag: cost models from the node's profile ----------------------------------------

def test_the_agent_s_policy_comes_from_the_node_s_profile(tmp_path: Path) -> None:
    import yaml

    from helix.errors import ConfigError
    from helix.spec import load_cluster
    from node_agent.commands import batching_policy

    demo = load_cluster(Path(__file__).resolve().parents[2] / "clusters" / "demo" / "cluster.yaml")
    assert batching_policy(demo, demo.nodes[0], "fcfs", 16, 30).fcfs
    with pytest.raises(ConfigError, match="no prefill_ms_per_layer and decode_ms_per_layer"):
        batching_policy(demo, demo.nodes[0], "coordinated", 16, 30)  # its profile gives tok_s only
    curves = {"max_layers": 30, "prefill_ms_per_layer": [[0, 0], [256, 21.4]],
              "decode_ms_per_layer": [[0, 0], [1, 1.23], [32, 3.48]]}
    model = {"num_layers": 30, "hidden_size": 576, "dtype_bytes": 4, "layer_weight_bytes": 14200000,
             "kv_bytes_per_token_per_layer": 1536}
    for pets, error in ((None, "no pet_ms_per_layer"), ({"lora": [[1, 0.025], [16, 0.073]]}, None)):
        (tmp_path / "profiles.yaml").write_text(yaml.safe_dump({"models": {"smollm2-135m": model}, "gpus": {"cpu": {
            "vram_gb": 1, "throughput": {"smollm2-135m": {**curves, **({"pet_ms_per_layer": pets} if pets else {})}}}}}))
        (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({
            "name": "one", "model": "smollm2-135m", "profiles": "profiles.yaml", "coordinator": {"id": "coordinator"},
            "nodes": [{"id": "cpu-0", "gpu": "cpu"}],
            "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 0.1}}}))  # fmt: skip
        cluster = load_cluster(tmp_path / "cluster.yaml")
        if error:
            with pytest.raises(ConfigError, match=error):
                batching_policy(cluster, cluster.nodes[0], "coordinated", 16, 30)
            continue
        policy = batching_policy(cluster, cluster.nodes[0], "coordinated", 5, 0)  # no layers yet: max_layers
        assert policy.mode is BatchingMode.COORDINATED and policy.max_passed_over_steps == 5
        assert policy.costs is not None and policy.costs.layers == 30
        assert policy.costs.beta_ms("lora", 1) == pytest.approx(30 * 0.025) and policy.costs.beta_ms(None, 4) == 0
        assert policy.costs.alpha_ms(0, 32) == pytest.approx(30 * 3.48)
    with pytest.raises(ConfigError, match="1 or more"):
        batching_policy(cluster, cluster.nodes[0], "coordinated", 0, 30)
