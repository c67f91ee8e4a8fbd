"""Fine-tuned tasks in the simulator (simulator.tasks, helix.perf_model): each task a step touches adds
its PET type's per-layer cost, a workload spread over many tasks runs slower than the base model by
what the profile's curve says, and a run without tasks is the run it was."""

from __future__ import annotations

import pytest

from helix.errors import ConfigError
from helix.perf_model import CostCurve, NodeCurves, expected_tasks
from helix.plan import Plan
from helix.profile import GpuProfile, ModelProfile, ProfileSet, ThroughputProfile
from helix.spec import ClusterSpec
from simulator.engine import SimConfig, Simulation, simulate
from simulator.tasks import TaskMix, parse_task_mix

LORA = [(1, 0.05), (64, 0.5)]  # ms one layer pays per LoRA task in a step, by the task's rows
DECODE = [(0, 0.0), (1, 1.0), (64, 2.0)]
PREFILL = [(0, 0.0), (1000, 10.0)]


def _one_node(pet: dict[str, list[tuple[float, float]]] | None = None):
    """One node holding a 4-layer model whole."""
    model = ModelProfile(num_layers=4, hidden_size=8, layer_weight_bytes=1.0, kv_bytes_per_token_per_layer=1.0)
    tp = ThroughputProfile(max_layers=4, prefill_ms_per_layer=PREFILL, decode_ms_per_layer=DECODE,
                           kv_capacity_tokens_by_layers=[1e9] * 4, pet_ms_per_layer=pet)  # type: ignore[arg-type]
    profiles = ProfileSet(models={"m": model}, gpus={"g": GpuProfile(vram_gb=1, throughput={"m": tp})})
    cluster = ClusterSpec.model_validate({
        "name": "t", "model": "m", "profiles": "p.yaml", "coordinator": {"id": "c"}, "nodes": [{"id": "n0", "gpu": "g"}],
        "defaults": {"intra_region": {"bandwidth_gbps": 1e6, "latency_ms": 0.0}}})  # fmt: skip
    plan = Plan(cluster="t", model="m", method="given", placement={"n0": (0, 4)}, max_flow_tok_s=1.0)
    return cluster, profiles, plan


def test_an_iteration_costs_more_with_every_task_it_touches() -> None:
    curves = NodeCurves(prefill=CostCurve(PREFILL), decode=CostCurve(DECODE), pet={"lora": CostCurve(LORA)})
    spans = [(4, 0.0, 16.0, 0.0)]
    costs = [curves.iteration_ms(spans, sampled=16, tasks=[[("lora", 1.0, 16 / k)] * k] if k else ())
             for k in range(0, 17)]  # the 16 decodes spread over k tasks
    assert costs[0] == curves.iteration_ms(spans, sampled=16)
    assert all(a < b for a, b in zip(costs, costs[1:], strict=False))
    assert costs[16] - costs[0] == pytest.approx(4 * 16 * 0.05)  # 16 tasks of one row each, on 4 layers
    assert curves.task_ms([("adapter", 3.0, 1.0)]) == 0.0  # a type the profile does not price: free
    assert NodeCurves(prefill=curves.prefill, decode=curves.decode).task_ms([("lora", 1.0, 1.0)]) == 0.0
    # a planner's average batch: more requests touch more of the tasks
    touched = [sum(n for _, n, _ in expected_tasks({"lora": 64}, b, b)) for b in (1, 4, 16, 64, 256)]
    assert touched[0] == pytest.approx(1.0) and all(a < b < 64 for a, b in zip(touched, touched[1:], strict=False))
    assert expected_tasks({"lora": 1}, 32, 32) == [("lora", 1.0, 32.0)]
    assert expected_tasks({}, 8, 8) == []


def test_a_node_prices_each_task_of_its_iteration_on_the_layers_it_runs() -> None:
    cluster, profiles, plan = _one_node({"lora": LORA, "diff": [(1, 0.2)]})
    sim = Simulation(cluster, profiles, plan, SimConfig(mode="online", num_requests=1, task_mix={"lora": 2, "diff": 1}))
    node = sim.nodes["n0"]
    assert node.task_types == {"lora-0": "lora", "lora-1": "lora", "diff-0": "diff"}
    base = node.iteration_ms({0: [0, 3, 0]}, 3)
    one = node.iteration_ms({0: [0, 3, 0]}, 3, {0: {"lora-0": 3}})
    three = node.iteration_ms({0: [0, 3, 0]}, 3, {0: {"lora-0": 1, "lora-1": 1, "diff-0": 1}})
    assert one - base == pytest.approx(4 * (0.05 + 0.45 * 2 / 63))
    assert three - base == pytest.approx(4 * (0.05 + 0.05 + 0.2))
    # a request that entered at layer 2 runs its task on layers 2-3 only
    split = node.iteration_ms({0: [0, 1, 0], 2: [0, 1, 0]}, 2, {2: {"diff-0": 1}})
    assert split - node.iteration_ms({0: [0, 1, 0], 2: [0, 1, 0]}, 2) == pytest.approx(2 * 0.2)


def test_requests_spread_over_64_tasks_run_slower_than_the_base_by_what_the_curve_says() -> None:
    cluster, profiles, plan = _one_node({"lora": LORA})
    cfg = {"max_inflight": 16, "lengths": "fixed:4,400", "duration_s": 30.0, "warmup_s": 5.0, "host_copy_gb_per_s": ()}
    base = simulate(cluster, profiles, plan, SimConfig(**cfg))  # type: ignore[arg-type]
    tasks = simulate(cluster, profiles, plan, SimConfig(task_mix={"lora": 64}, **cfg))  # type: ignore[arg-type]
    curves = profiles.throughput("g", "m").curves()
    assert curves is not None
    span = [(4, 0.0, 16.0, 0.0)]
    predicted = curves.iteration_ms(span, sampled=16) / curves.iteration_ms(
        span, sampled=16, tasks=[expected_tasks({"lora": 64}, 16, 16)])
    ratio = tasks.decode_tok_s / base.decode_tok_s
    assert predicted == pytest.approx(0.635, abs=0.01)  # 14.3 of the 64 tasks in a step of 16 decodes
    assert ratio == pytest.approx(predicted, rel=0.03)


def test_a_run_without_tasks_is_the_run_it_was() -> None:
    cluster, profiles, plan = _one_node({"lora": LORA})
    cfg = {"max_inflight": 8, "lengths": "fixed:20,50", "duration_s": 5.0, "warmup_s": 1.0}
    default = simulate(cluster, profiles, plan, SimConfig(**cfg)).to_json()  # type: ignore[arg-type]
    assert simulate(cluster, profiles, plan, SimConfig(task_mix={}, **cfg)).to_json() == default  # type: ignore[arg-type]
    assert TaskMix.resolve(None, cluster, profiles.models["m"], 0) is None  # the cluster lists no task


def test_the_task_mix_option() -> None:
    assert parse_task_mix("64") == {"lora": 64}
    assert parse_task_mix("0") == {}
    assert parse_task_mix("lora:32, adapter:8") == {"lora": 32, "adapter": 8}
    for bad in ("many", "prefix:3", "lora:-1", "lora:x"):
        with pytest.raises(ConfigError):
            parse_task_mix(bad)
    mix = TaskMix({"lora": 3, "mask": 1}, seed=0)
    drawn = [mix.draw() for _ in range(4000)]
    assert set(drawn) == {"lora-0", "lora-1", "lora-2", "mask-0"}
    assert drawn.count("mask-0") == pytest.approx(1000, rel=0.1)
