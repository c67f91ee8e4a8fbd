"""The simulated network shares a region's uplink / downlink and a node's NIC among the links through them;
without them every link is on its own, as before. The router's flows on such a cluster keep its IWRR going."""

from __future__ import annotations

from typing import Any

import pytest

from helix.plan import Plan
from helix.profile import GpuProfile, ModelProfile, ProfileSet, ThroughputProfile
from helix.spec import ClusterSpec
from router.policy import Router, RouteRequest
from simulator.engine import SimConfig, simulate
from simulator.links import Links

ACROSS = {"a0": (0, 3), "a1": (0, 3), "b0": (3, 6), "b1": (3, 6)}  # layers 0-2 in region A, 3-5 in B


def cluster(regions: dict[str, Any] | None = None, *, nic_gbps: float | None = None,
            inter_gbps: float = 1.0) -> ClusterSpec:
    """a0, a1 (and the coordinator) in region A, b0, b1 in B; ``inter_gbps`` between the regions."""
    nodes: list[dict[str, Any]] = [{"id": n, "gpu": "g", "region": n[0].upper()} for n in ("a0", "a1", "b0", "b1")]
    if nic_gbps is not None:
        nodes[0]["nic_gbps"] = nic_gbps
    return ClusterSpec.model_validate({
        "name": "t", "model": "m", "profiles": "p.yaml", "coordinator": {"id": "c", "region": "A"}, "nodes": nodes,
        "defaults": {"intra_region": {"bandwidth_gbps": 1000}, "inter_region": {"bandwidth_gbps": inter_gbps}},
        "regions": regions or {}})  # fmt: skip


def test_messages_through_one_uplink_go_one_after_the_other() -> None:
    mb = 125e6  # 1 s on a 1 Gbit/s link
    for regions, second in (({}, 1.0), ({"A": {"uplink_gbps": 1}}, 2.0), ({"A": {"uplink_gbps": 4}}, 1.0)):
        links = Links(cluster(regions))
        assert links.arrival("a0", "b0", mb, 0.0) == pytest.approx(1.0)
        assert links.arrival("a1", "b1", mb, 0.0) == pytest.approx(second), regions  # another link, same uplink
        assert links.arrival("a0", "a1", mb, 0.0) == pytest.approx(0.001)  # inside the region (1000 Gbit/s): no uplink
    links = Links(cluster({"B": {"downlink_gbps": 0.5}}))  # B's downlink: 2 s a message, the two in turn
    assert [links.arrival(a, b, mb, 0.0) for a, b in (("a0", "b0"), ("a1", "b1"))] == pytest.approx([2.0, 4.0])
    links = Links(cluster(nic_gbps=2.0))  # a0's NIC (out): 0.5 s of work a message, the three take 1.5 s
    assert [links.arrival("a0", b, mb, 0.0) for b in ("b0", "b1", "a1")] == pytest.approx([1.0, 1.0, 1.5])
    assert links.arrival("a1", "b1", mb, 0.0) == pytest.approx(1.0)  # not through a0's NIC


def _profiles() -> ProfileSet:
    """1 ms a layer a decode step at any batch; a token's activations are 8 x 2 bytes."""
    model = ModelProfile(num_layers=6, hidden_size=8, dtype_bytes=2, layer_weight_bytes=1.0,
                         kv_bytes_per_token_per_layer=1.0)  # fmt: skip
    tp = ThroughputProfile(max_layers=6, prefill_ms_per_layer=[(0, 0), (100, 1.0)],
                           decode_ms_per_layer=[(0, 0), (1, 1.0), (64, 1.0)], kv_capacity_tokens_by_layers=[1e7] * 6)
    return ProfileSet(models={"m": model}, gpus={"g": GpuProfile(vram_gb=1, throughput={"m": tp})})


def test_a_shared_uplink_caps_the_simulated_throughput() -> None:
    """Four 2 kB/s links from A to B (125 activations/s each); an uplink of one link's speed carries a quarter."""
    inter = 2000 * 8 / 1e9
    plan = Plan(cluster="t", model="m", method="given", placement=dict(ACROSS), max_flow_tok_s=1.0)
    cfg = SimConfig(max_inflight=64, duration_s=200.0, warmup_s=50.0, lengths="fixed:8,64", seed=1)
    free = simulate(cluster(inter_gbps=inter), _profiles(), plan, cfg)
    shared = simulate(cluster({"A": {"uplink_gbps": inter}}, inter_gbps=inter), _profiles(), plan, cfg)
    # every prompt token's and decode token's activations cross once
    assert free.decode_tok_s + free.prompt_tok_s == pytest.approx(4 * 125.0, rel=0.05)
    assert shared.decode_tok_s + shared.prompt_tok_s == pytest.approx(125.0, rel=0.05)


@pytest.mark.parametrize("planned", [False, True])
def test_the_router_splits_by_the_flows_of_a_shared_uplink_plan(planned: bool) -> None:
    """IWRR over the flows of a plan within A's uplink: the flows ``helix plan`` reports (balanced, checked when
    loaded) or, for a plan without flows, those the router computes from the cluster."""
    from planner.api import finish_plan
    from planner.capacity import CapacityModel
    from planner.flows import balanced_flows

    c = cluster({"A": {"uplink_gbps": 1000 * 16 * 8 / 1e9}}, inter_gbps=1.0)  # 1000 activations/s across
    plan = Plan(cluster="t", model="m", method="given", placement=dict(ACROSS), max_flow_tok_s=1.0)
    if planned:
        value, flows = balanced_flows(CapacityModel.build(c, _profiles()), ACROSS)
        plan = finish_plan(c, _profiles(), ACROSS, method="given", flows=flows)  # checks the flows, shared uplink too
        assert plan.max_flow_tok_s == pytest.approx(value) == pytest.approx(1000.0, rel=1e-6)
        assert {e.src for e in plan.flows} | {e.dst for e in plan.flows} <= {"c", *ACROSS}
    router = Router.from_plan(plan, c, _profiles(), watermark=1.0)
    firsts = set()
    for i in range(8):
        pipeline = router.route(RouteRequest(i, prompt_tokens=8))
        stages = [s.node for s in pipeline.stages]
        assert len(stages) == 2 and stages[0][0] == "a" and stages[1][0] == "b"
        firsts.add(stages[0])
    if planned:  # balanced flows send requests through both first stages (networkx's flows may use one)
        assert firsts == {"a0", "a1"}
