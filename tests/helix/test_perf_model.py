"""The performance model (helix.perf_model): the curve-reading rule, an iteration's cost, the
network-free bound, and that the planner and the simulator price the same iteration alike."""

from __future__ import annotations

import pytest

from helix.perf_model import CostCurve, NodeCurves, best_layer_tok_s, network_free_bound

CURVE = CostCurve([(8, 3.0), (4, 2.0), (16, 7.0)])  # unsorted on purpose


def test_no_work_costs_nothing() -> None:
    assert CURVE.at(0) == 0.0
    assert CURVE.at(-3) == 0.0


def test_below_the_first_point_is_flat() -> None:
    # a step smaller than the smallest measured one costs what that one did (not 1/4 of it)
    assert CURVE.at(1) == 2.0
    assert CURVE.at(4) == 2.0


def test_between_points_is_linear() -> None:
    assert CURVE.at(6) == pytest.approx(2.5)
    assert CURVE.at(8) == pytest.approx(3.0)
    assert CURVE.at(12) == pytest.approx(5.0)


def test_above_the_last_point_extends_the_last_segment() -> None:
    assert CURVE.at(20) == pytest.approx(9.0)  # slope 0.5 ms per unit from (16, 7)
    assert CostCurve([(2, 5.0)]).at(10) == 5.0  # one point: constant


def test_a_zero_anchor_prices_one_decode_at_half_of_two() -> None:
    # the paper's A100 decode table starts (0, 0), (2, 1.4): batch 1 is interpolated from (0, 0)
    assert CostCurve([(0, 0.0), (2, 1.4), (20, 1.5)]).at(1) == pytest.approx(0.7)


PAPER_A100_DECODE = [(0, 0.0), (2, 1.4), (20, 1.5), (50, 1.7), (100, 2.5)]  # ms per layer, the artifact's table


def test_a_node_prices_one_decode_as_two_on_the_papers_table() -> None:
    # issue 21: a decode step below the smallest measured batch (2 here) costs that batch, as the paper's simulator
    # prices a lone decode; CostCurve.at itself still interpolates from (0, 0)
    a100 = NodeCurves(prefill=CostCurve([(0, 0.0), (250, 2.0)]), decode=CostCurve(PAPER_A100_DECODE))
    assert a100.decode.smallest_measured == 2.0
    assert a100.decode_ms(1) == pytest.approx(1.4)
    assert a100.decode_ms(2) == pytest.approx(1.4)
    assert a100.decode_ms(11) == pytest.approx(1.45)  # above the first point: the curve, unchanged
    assert a100.decode_ms(0) == 0.0
    assert a100.layer_ms(0, 1, 0) == pytest.approx(1.4)
    assert a100.layer_ms(125, 0, 0) == pytest.approx(1.0)  # a short prompt is still interpolated from (0, 0)
    # 8 layers, one decode: 8 x 1.4 ms (it was 8 x 0.7)
    assert a100.iteration_ms([(8, 0, 1, 0)], sampled=1) == pytest.approx(11.2)
    old = NodeCurves(prefill=a100.prefill, decode=a100.decode, decode_floor=False)
    assert old.decode_ms(1) == pytest.approx(0.7)
    assert old.iteration_ms([(8, 0, 1, 0)], sampled=1) == pytest.approx(5.6)


def test_the_decode_floor_leaves_curves_measured_from_batch_one_alone() -> None:
    profiled = NodeCurves(prefill=CostCurve([(0, 0.0), (16, 0.2)]), decode=CostCurve([(0, 0.0), (1, 0.3), (2, 0.5)]))
    assert profiled.decode_ms(1) == pytest.approx(0.3)
    assert profiled.decode_ms(0.5) == pytest.approx(0.3)  # a planner's mean batch below 1: the batch-1 cost
    no_anchor = NodeCurves(prefill=CostCurve([(16, 0.2)]), decode=CostCurve([(4, 2.0), (8, 3.0)]))
    assert no_anchor.decode_ms(1) == pytest.approx(2.0)  # flat below the first point, with or without the floor


def test_planner_prices_a_lone_decode_as_the_simulator_does() -> None:
    from planner.capacity import CapacityModel
    from planner.serving_model import ServingModel
    from planner.serving_workload import Workload
    from simulator.engine import SimConfig, Simulation

    cluster, profiles, plan = _two_node_case(decode=PAPER_A100_DECODE, prefill=[(0, 0.0), (250, 2.0)])
    sim = Simulation(cluster, profiles, plan, SimConfig(mode="online", num_requests=1))
    planner = ServingModel(CapacityModel.build(cluster, profiles), Workload(prompt_tokens=0.0, output_tokens=40.0))
    # one decode alone on 2 layers, no prompt riding along: 2 x 1.4 ms in both
    assert sim.nodes["n0"].iteration_ms({0: [0, 1, 0]}, 1) == pytest.approx(2.8)
    assert planner.decode_s("n0", 2, 1.0) == pytest.approx(0.0028)
    old = Simulation(cluster, profiles, plan, SimConfig(mode="online", num_requests=1, decode_floor=False))
    assert old.nodes["n0"].iteration_ms({0: [0, 1, 0]}, 1) == pytest.approx(1.4)


def _two_node_case(*, decode: list[tuple[float, float]], prefill: list[tuple[float, float]]):
    from helix.plan import Plan
    from helix.profile import GpuProfile, ModelProfile, ProfileSet, ThroughputProfile
    from helix.spec import ClusterSpec

    model = ModelProfile(num_layers=4, hidden_size=8, layer_weight_bytes=1.0, kv_bytes_per_token_per_layer=1.0)
    tp = ThroughputProfile(max_layers=4, prefill_ms_per_layer=prefill, decode_ms_per_layer=decode,
                           kv_capacity_tokens_by_layers=[1e9] * 4)  # fmt: skip
    profiles = ProfileSet(models={"m": model}, gpus={"g": GpuProfile(vram_gb=1, throughput={"m": tp})})
    cluster = ClusterSpec.model_validate({
        "name": "t", "model": "m", "profiles": "p.yaml", "coordinator": {"id": "c"},
        "nodes": [{"id": "n0", "gpu": "g"}, {"id": "n1", "gpu": "g"}],
        "defaults": {"intra_region": {"bandwidth_gbps": 1000, "latency_ms": 0.0}}})
    plan = Plan(cluster="t", model="m", method="given", placement={"n0": (0, 2), "n1": (2, 4)}, max_flow_tok_s=1.0)
    return cluster, profiles, plan


def test_repeated_x_and_empty_curves() -> None:
    twice = CostCurve([(1, 1.0), (2, 2.0), (2, 3.0), (4, 5.0)])
    assert twice.at(3) == pytest.approx(4.0)  # from the later point at x = 2
    with pytest.raises(ValueError, match="at least one"):
        CostCurve([])


def test_an_iteration_by_hand() -> None:
    curves = NodeCurves(
        prefill=CostCurve([(0, 0.0), (100, 1.0)]),
        decode=CostCurve([(0, 0.0), (1, 0.5), (9, 1.3)]),
        step=CostCurve([(1, 2.0), (200, 4.0)]),
        head=CostCurve([(1, 3.0)]),
        context_ref_tokens=100.0,
        ms_per_context_token=0.001,
    )
    # 4 layers carry 50 prompt tokens; 2 more layers also carry 5 decodes of 300 tokens of context each
    spans = [(4, 50, 0, 0), (2, 50, 5, 1500)]
    layer_a = 0.5
    layer_b = 0.5 + 0.9 + 0.001 * (1500 - 5 * 100)  # prefill(50) + decode(5) + context beyond the measured one
    step = 2.0 + 2.0 * (55 - 1) / 199  # at the whole batch: 50 prompt tokens + 5 decodes
    expected = 4 * layer_a + 2 * layer_b + step
    assert curves.iteration_ms(spans, sampled=5) == pytest.approx(expected)
    assert curves.iteration_ms(spans, sampled=5, head_share=1.0) == pytest.approx(expected + 3.0)
    assert curves.iteration_ms(spans, sampled=5, head_share=0.25) == pytest.approx(expected + 0.75)


def test_short_contexts_make_a_layer_cheaper_not_negative() -> None:
    curves = NodeCurves(prefill=CostCurve([(0, 0.0), (10, 1.0)]), decode=CostCurve([(0, 0.0), (1, 0.1)]),
                        context_ref_tokens=1000.0, ms_per_context_token=0.01)  # fmt: skip
    assert curves.layer_ms(0, 1, 900) == pytest.approx(0.0)  # 0.1 - 0.01 * 100 < 0 -> 0
    assert curves.layer_ms(0, 1, 995) == pytest.approx(0.05)


def test_network_free_bound_by_hand() -> None:
    assert best_layer_tok_s([10.0, 8.0, 5.0]) == 16.0  # max(1 x 10, 2 x 8, 3 x 5)
    # two such nodes and one of max(4, 2 x 3) = 6, over 4 layers
    assert network_free_bound([[10.0, 8.0, 5.0], [10.0, 8.0, 5.0], [4.0, 3.0]], 4) == pytest.approx((16 + 16 + 6) / 4)


def test_planner_and_simulator_price_one_iteration_alike() -> None:
    from helix.plan import Plan
    from helix.profile import GpuProfile, ModelProfile, ProfileSet, ThroughputProfile
    from helix.spec import ClusterSpec
    from planner.capacity import CapacityModel
    from planner.serving_model import ServingModel
    from planner.serving_workload import Workload
    from simulator.engine import SimConfig, Simulation

    model = ModelProfile(num_layers=4, hidden_size=8, layer_weight_bytes=1.0, kv_bytes_per_token_per_layer=1.0)
    tp = ThroughputProfile(max_layers=4, prefill_ms_per_layer=[(16, 0.4), (256, 4.0)],
                           decode_ms_per_layer=[(1, 0.3), (32, 0.9)], kv_capacity_tokens_by_layers=[1e9] * 4,
                           step_overhead_ms=[(1, 1.0), (256, 2.0)], head_ms=[(1, 0.5), (32, 1.5)],
                           decode_context_tokens=64.0, decode_ms_per_context_token=0.0005)  # fmt: skip
    profiles = ProfileSet(models={"m": model}, gpus={"g": GpuProfile(vram_gb=1, throughput={"m": tp})})
    cluster = ClusterSpec.model_validate({
        "name": "t", "model": "m", "profiles": "p.yaml", "coordinator": {"id": "c"},
        "nodes": [{"id": "n0", "gpu": "g"}, {"id": "n1", "gpu": "g"}],
        "defaults": {"intra_region": {"bandwidth_gbps": 1000, "latency_ms": 0.0}}})
    plan = Plan(cluster="t", model="m", method="given", placement={"n0": (0, 2), "n1": (2, 4)}, max_flow_tok_s=1.0)
    sim = Simulation(cluster, profiles, plan, SimConfig(mode="online", num_requests=1))
    workload = Workload(prompt_tokens=100.0, output_tokens=40.0, mixed_batches=True)
    planner = ServingModel(CapacityModel.build(cluster, profiles), workload)
    # 8 decodes at the workload's mean context with its share of prompt tokens (8 x 100 / 40 = 20), which the
    # planner prices as 20 / 100 of a whole 100-token prompt, as the simulator prices a prompt
    context = 8 * (100 + 40 / 2)
    curves = sim.nodes["n0"].curves
    riding_as_prompts = 2 * (20 / 100 * curves.prefill.at(100) - curves.prefill.at(20))
    for node, last in (("n0", False), ("n1", True)):
        simulated = sim.nodes[node].iteration_ms({0 if node == "n0" else 2: [20, 8, int(context)]}, 8)
        assert planner.decode_s(node, 2, 8.0, last=last) == pytest.approx((simulated + riding_as_prompts) / 1000)
    # below both curves' first points (10 prompt tokens, flat at 16's cost) and a prompt alone
    assert sim.nodes["n0"].iteration_ms({0: [10, 0, 0]}, 1) == pytest.approx(2 * 0.4 + 1.0 + 1.0 * 9 / 255)
    prompt_alone = sim.nodes["n1"].iteration_ms({2: [100, 0, 0]}, 1)
    assert planner.prefill_s("n1", 2, last=True) == pytest.approx(prompt_alone / 1000)
