"""The simulated nodes run the agents' scheduler and KV account, and the coordinator is the server's core:
reservations that make requests wait, refusals the core fails, chunks sent on as soon as they ran, the
agent's own bounds."""

from __future__ import annotations

import pytest

from helix.errors import ConfigError
from helix.plan import Plan
from helix.profile import GpuProfile, ModelProfile, ProfileSet, ThroughputProfile
from helix.spec import ClusterSpec
from simulator.engine import SimConfig, Simulation, simulate
from simulator.workload import RequestSpec

NO_COPY = {"host_copy_gb_per_s": ()}  # exact timing sums


def _cluster(nodes: int, layers: int, *, kv: float = 1e7):
    """``nodes`` identical nodes, ``kv`` KV entries each: prefill 1 ms per token per layer, a decode 1 ms per layer."""
    model = ModelProfile(num_layers=layers, hidden_size=8, layer_weight_bytes=1.0, kv_bytes_per_token_per_layer=1.0)
    tp = ThroughputProfile(max_layers=layers, prefill_ms_per_layer=[(0, 0.0), (1000, 1000.0)],
                           decode_ms_per_layer=[(0, 0.0), (1, 1.0), (64, 1.0)], kv_capacity_tokens_by_layers=[kv] * layers)
    profiles = ProfileSet(models={"m": model}, gpus={"g": GpuProfile(vram_gb=1, throughput={"m": tp})})
    cluster = ClusterSpec.model_validate({
        "name": "t", "model": "m", "profiles": "p.yaml", "coordinator": {"id": "c"},
        "nodes": [{"id": f"n{i}", "gpu": "g"} for i in range(nodes)],
        "defaults": {"intra_region": {"bandwidth_gbps": 1e6, "latency_ms": 0.0}}})
    return cluster, profiles


def _plan(placement: dict[str, tuple[int, int]]) -> Plan:
    return Plan(cluster="t", model="m", method="given", placement=placement, max_flow_tok_s=1.0)


def _online(trace: list[RequestSpec], **cfg: object) -> SimConfig:
    return SimConfig(mode="online", trace=trace, num_requests=len(trace), warmup_s=0.0, duration_s=1e6, **cfg)  # type: ignore[arg-type]


def test_a_request_waits_at_a_node_until_its_reservation_fits() -> None:
    # 200 entries on 2 layers = 100 tokens: one request of 50 + 20 reserved at a time. Random routing does not mask,
    # so both reach the node at once; the second waits for the first to finish (the agents never preempt)
    cluster, profiles = _cluster(1, 2, kv=200.0)
    plan = _plan({"n0": (0, 2)})
    trace = [RequestSpec(0.0, 50, 20) for _ in range(2)]
    res = simulate(cluster, profiles, plan, _online(trace, router="random", **NO_COPY))
    assert res.finished_requests == 2 and res.kv_waits == 1
    one = 2 * 50 / 1000 + 19 * 2 / 1000  # a prompt, then 19 decodes on 2 layers
    assert res.sim_end_s == pytest.approx(2 * one)
    assert max(res.kv_peak_fraction.values()) <= 1.0


def test_a_request_no_node_could_ever_hold_is_refused_and_fails() -> None:
    # 100 entries on 2 layers = 50 tokens, and the request needs 70: the node refuses it, the core fails it
    cluster, profiles = _cluster(1, 2, kv=100.0)
    res = simulate(cluster, profiles, _plan({"n0": (0, 2)}), _online([RequestSpec(0.0, 50, 20)], router="random"))
    assert res.finished_requests == 0 and res.extra["failed_requests"] == 1


def test_each_prefill_chunk_goes_on_as_soon_as_it_ran() -> None:
    # two stages of one layer, 16-token chunks of a 48-token prompt (16 ms each): the second stage starts on the
    # first chunk, so the first token comes at 64 ms, not 96 ms
    cluster, profiles = _cluster(2, 2)
    plan = _plan({"n0": (0, 1), "n1": (1, 2)})
    res = simulate(cluster, profiles, plan, _online([RequestSpec(0.0, 48, 1)], prefill_chunk_tokens=16, **NO_COPY))
    assert res.prompt_latency_s["p50"] == pytest.approx(0.064)


def test_the_agents_max_batch_size_bounds_the_requests_a_node_holds() -> None:
    cluster, profiles = _cluster(1, 2)
    plan = _plan({"n0": (0, 2)})
    trace = [RequestSpec(0.0, 10, 5) for _ in range(3)]
    bounded = simulate(cluster, profiles, plan, _online(trace, max_batch_size=1, **NO_COPY))
    free = simulate(cluster, profiles, plan, _online(trace, **NO_COPY))
    assert bounded.kv_waits == 2 and free.kv_waits == 0  # one at a time: the two behind it wait at the node
    assert bounded.sim_end_s == pytest.approx(3 * (2 * 10 + 4 * 2) / 1000)  # one after another: a prompt, 4 decodes
    assert free.sim_end_s < bounded.sim_end_s
    sim = Simulation(cluster, profiles, plan, _online(trace, max_batch_size=4, token_budget=64))
    config = sim.nodes["n0"].scheduler.config
    assert (config.max_batch_size, config.token_budget, config.chunk_size) == (4, 64, None)
    for bad in ({"token_budget": 64}, {"max_batch_size": 8, "token_budget": 4}, {"max_batch_size": 0}):
        with pytest.raises(ConfigError, match="max_batch_size|token_budget"):
            Simulation(cluster, profiles, plan, _online(trace, **bad))
