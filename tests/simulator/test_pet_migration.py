"""Task popularity, task placement and PET migration in the simulator (simulator.tasks, simulator.pet_migration):
Zipf draws reshuffled on schedule, a task's requests routed only through its holders, the real PetBalancer
moving PETs under a skew (and throughput above the static assignment's), nothing moved under an even
popularity, and options refused with errors that name them."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from helix.errors import ConfigError
from helix.plan import Plan
from helix.profile import GpuProfile, ModelProfile, ProfileSet, ThroughputProfile
from helix.spec import ClusterSpec
from router.pet_balancer import BalancePolicy, PetBalancer
from simulator.commands import add_simulate_arguments, run_simulate
from simulator.engine import SimConfig, Simulation, simulate
from simulator.pet_migration import pet_layer_bytes
from simulator.tasks import Popularity, TaskMix

DECODE = [(0, 0.0), (1, 0.5), (64, 32.0)]  # ms per layer, linear in the batch: a node's work grows with its requests
PREFILL = [(0, 0.0), (1000, 10.0)]


def _replicas():
    """Two nodes holding the same 4 layers (one replica group), compute-bound."""
    model = ModelProfile(num_layers=4, hidden_size=64, layer_weight_bytes=1e6, kv_bytes_per_token_per_layer=1.0)
    tp = ThroughputProfile(max_layers=4, prefill_ms_per_layer=PREFILL, decode_ms_per_layer=DECODE,
                           kv_capacity_tokens_by_layers=[12000.0] * 4)  # type: ignore[arg-type]
    profiles = ProfileSet(models={"m": model}, gpus={"g": GpuProfile(vram_gb=1, throughput={"m": tp})})
    cluster = ClusterSpec.model_validate({
        "name": "t", "model": "m", "profiles": "p.yaml", "coordinator": {"id": "c"},
        "nodes": [{"id": "a", "gpu": "g"}, {"id": "b", "gpu": "g"}],
        "defaults": {"intra_region": {"bandwidth_gbps": 1e6, "latency_ms": 0.0}}})  # fmt: skip
    flows = [{"src": "c", "dst": n, "tok_s": 1.0} for n in "ab"] + [{"src": n, "dst": "c", "tok_s": 1.0} for n in "ab"]
    plan = Plan.model_validate({"cluster": "t", "model": "m", "method": "given", "placement": {"a": [0, 4], "b": [0, 4]},
                                "max_flow_tok_s": 2.0, "flows": flows})  # fmt: skip
    return cluster, profiles, plan


# 8 tasks of Zipf 1.0 popularity (seed 0: the static spread gives one node 60 % of the requests), at about
# 95 % of the two nodes' capacity (~32 requests/s each)
SKEW = {"mode": "online", "rate_per_s": 60.0, "lengths": "fixed:32,16", "duration_s": 30.0, "warmup_s": 5.0,
        "host_copy_gb_per_s": (), "task_mix": {"lora": 8}, "task_placement": "spread", "bucket_s": 5.0,
        "task_popularity": Popularity(1.0)}  # fmt: skip
POLICY = BalancePolicy(interval_s=2.0, min_interval_s=1.0, max_interval_s=10.0)


def test_zipf_popularity_draws_by_a_ranking_reshuffled_every_shift() -> None:
    mix = TaskMix({"lora": 16}, seed=3, popularity=Popularity(1.1, 60.0))
    shares = mix.shares(0.0)
    assert sum(shares.values()) == pytest.approx(1.0)
    top = mix.ranking(0.0)[0]
    assert shares[top] == pytest.approx(1 / sum(r**-1.1 for r in range(1, 17)))
    drawn = Counter(mix.draw(t / 100) for t in range(3000))  # within the first 60 s
    assert drawn.most_common(1)[0][0] == top
    assert mix.ranking(59.9) == mix.ranking(0.0) and mix.ranking(60.0) != mix.ranking(0.0)
    assert mix.ranking(125.0) == TaskMix({"lora": 16}, seed=3, popularity=Popularity(1.1, 60.0)).ranking(125.0)
    fixed = TaskMix({"lora": 16}, seed=3, popularity=Popularity(1.1))  # no shift: one ranking for the run
    assert fixed.ranking(0.0) == fixed.ranking(1e6)
    # even draws are the draws they were (the same generator, the same order)
    even, before = TaskMix({"lora": 16}, seed=3), TaskMix({"lora": 16}, seed=3)
    assert [even.draw(t) for t in range(50)] == [before.draw() for _ in range(50)]


def test_spread_routes_each_task_only_through_the_node_holding_it() -> None:
    cluster, profiles, plan = _replicas()
    sim = Simulation(cluster, profiles, plan, SimConfig(**{**SKEW, "duration_s": 10.0}))  # type: ignore[arg-type]
    result = sim.run()
    holders = result.tasks["holders"]  # type: ignore[index]
    assert sorted(holders) == [f"lora-{i}" for i in range(8)] and all(len(h) == 1 for h in holders.values())
    assert sorted(Counter(h[0] for h in holders.values()).values()) == [4, 4]  # spread: 4 tasks a node
    assert sim.balance is not None
    counted = sim.balance.counter.window
    assert counted and all(node in holders[task] for task, node in counted)
    assert result.tasks["moves"] == []  # type: ignore[index]


def test_under_a_skew_the_real_balancer_moves_pets_and_throughput_beats_the_static_assignment(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    cluster, profiles, plan = _replicas()
    static = simulate(cluster, profiles, plan, SimConfig(**SKEW))  # type: ignore[arg-type]
    calls: list[float] = []
    real_step = PetBalancer.step

    def spy(self: PetBalancer, now: float, view):  # type: ignore[no-untyped-def]
        calls.append(now)
        return real_step(self, now, view)

    monkeypatch.setattr(PetBalancer, "step", spy)
    moved = simulate(cluster, profiles, plan, SimConfig(**SKEW, pet_balance=POLICY))  # type: ignore[arg-type]
    report = moved.tasks
    assert report is not None and static.tasks is not None
    assert len(calls) >= 4 and calls == sorted(calls)  # the balancer ran, round after round, in simulated time
    assert report["moves_done"] >= 1 and static.tasks["moves"] == []
    assert all(m["outcome"] == "moved" and m["freed_s"] >= m["switched_s"] >= m["asked_s"] for m in report["moves"])
    assert moved.decode_tok_s > 1.05 * static.decode_tok_s
    phi = [p for _, p in report["phi_over_time"][2:]]
    static_phi = [p for _, p in static.tasks["phi_over_time"][2:]]
    assert sum(phi) / len(phi) > sum(static_phi) / len(static_phi)


def test_under_an_even_popularity_moves_are_few_settle_and_cost_nothing() -> None:
    """Even popularity near saturation: the counts say chance, but the queues wander (one node's mean
    queue 40 requests, the other's 3, for seconds), and where they agree with the counts a task
    moves. A moved task stays ``settle_s``; the moves cost no throughput."""
    cluster, profiles, plan = _replicas()
    even = {**SKEW, "task_popularity": Popularity()}
    static = simulate(cluster, profiles, plan, SimConfig(**even))  # type: ignore[arg-type]
    result = simulate(cluster, profiles, plan, SimConfig(**even, pet_balance=POLICY))  # type: ignore[arg-type]
    assert result.tasks is not None
    moves = result.tasks["moves"]
    assert len(result.tasks["rounds"]) >= 4 and len(moves) <= 12  # of 30-odd rounds
    asked: dict[str, float] = {}
    for m in moves:
        assert m["asked_s"] - asked.get(m["task"], -POLICY.settle_s) >= POLICY.settle_s, m
        asked[m["task"]] = m["asked_s"]
    assert result.decode_tok_s >= 0.99 * static.decode_tok_s


def test_a_move_copies_the_pets_bytes_for_the_targets_layers() -> None:
    model = ModelProfile(num_layers=80, hidden_size=8192, layer_weight_bytes=1.6e9, kv_bytes_per_token_per_layer=1.0)
    assert pet_layer_bytes("lora", model) == 4 * 16 * 2 * 8192 * 2  # rank 16 on q/k/v/o, 2-byte values
    assert pet_layer_bytes("mask", model) == pytest.approx(0.8e9 * 0.05 * 8)  # 5 % of the weights, 8 B a non-zero
    cluster, profiles, plan = _replicas()
    cfg = SimConfig(**SKEW, pet_balance=POLICY, pet_load_gb_per_s=0.001)  # type: ignore[arg-type]
    result = simulate(cluster, profiles, plan, cfg)
    copies = [m["copy_s"] for m in result.tasks["moves"]]  # type: ignore[index]
    assert copies and all(c == pytest.approx(4 * 4 * 16 * 2 * 64 * 2 / 1e6) for c in copies)


def _cli(*extra: str) -> None:
    p = argparse.ArgumentParser()
    add_simulate_arguments(p)
    run_simulate(p.parse_args(["cluster.yaml", "plan.json", *extra]))


@pytest.mark.parametrize(("argv", "field", "words"), [
    (["--task-popularity", "zipf"], "--task-popularity", "zipf:S"),
    (["--task-popularity", "zipf:-1"], "--task-popularity", "S > 0"),
    (["--task-popularity", "pareto:1"], "--task-popularity", "even or zipf"),
    (["--task-popularity", "zipf:1.1", "--popularity-shift-s", "0"], "--popularity-shift-s", "positive"),
    (["--popularity-shift-s", "60"], "--popularity-shift-s", "zipf:S"),
    (["--pet-balance", "--pet-node-bytes", "a=lots"], "--pet-node-bytes", "NODE=BYTES"),
    (["--pet-balance", "--pet-balance-theta", "1.5"], "--pet-balance", "theta"),
    (["--pet-load-gb-per-s", "0", "--task-popularity", "zipf:1"], "--pet-load-gb-per-s", "positive"),
])  # fmt: skip
def test_bad_options_are_refused_naming_the_option(argv: list[str], field: str, words: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    cluster, profiles, plan = _replicas()
    monkeypatch.setattr("helix.spec.load_cluster", lambda path: cluster)
    monkeypatch.setattr("helix.profile.load_profiles_for", lambda c: profiles)
    monkeypatch.setattr("planner.api.load_for_evaluation", lambda path, c, p: (plan, []))
    with pytest.raises(ConfigError) as err:
        _cli("--tasks", "lora:4", "--duration", "1", "--warmup", "0", *argv)
    assert err.value.field == field and words in str(err.value)


@pytest.mark.parametrize("flag", [["--pet-balance"], ["--task-placement", "spread"], ["--task-popularity", "zipf:1"]])
def test_task_options_without_tasks_are_refused(flag: list[str]) -> None:
    cluster, profiles, plan = _replicas()
    cfg = SimConfig(task_mix={}, task_placement="spread" if "spread" in flag else "all",
                    pet_balance=POLICY if flag == ["--pet-balance"] else None,
                    task_popularity=Popularity(1.0) if "zipf:1" in flag else Popularity())  # fmt: skip
    with pytest.raises(ConfigError) as err:
        Simulation(cluster, profiles, plan, cfg)
    assert err.value.field == flag[0] and "--tasks" in str(err.value)
    with pytest.raises(ConfigError, match="all or spread"):
        SimConfig(task_placement="some").check()



def test_serial_drains_move_as_well() -> None:
    cluster, profiles, plan = _replicas()
    static = simulate(cluster, profiles, plan, SimConfig(**SKEW))  # type: ignore[arg-type]
    cfg = SimConfig(**SKEW, pet_balance=POLICY, pet_serial_drains=True)  # type: ignore[arg-type]
    serial = simulate(cluster, profiles, plan, cfg)
    assert serial.tasks is not None and serial.tasks["moves_done"] >= 1
    assert all(m["switched_s"] is not None for m in serial.tasks["moves"])
    assert serial.decode_tok_s > 1.05 * static.decode_tok_s
