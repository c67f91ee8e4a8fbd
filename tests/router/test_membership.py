"""router.membership's policy and reconfiguration steps, driven with fabricated events and plans (no
planner, no agents, no clock): a death waits its grace period, re-plans are rate-limited, a layer
load error keeps the old plan, the nodes left not holding the model is ``unavailable`` until the
membership changes, a leave re-plans at once, a join is dialed and planned with."""

from __future__ import annotations

import json

import pytest

from helix import wire
from helix.errors import ConfigError
from helix.plan import Plan
from helix.spec import NodeSpec, load_cluster
from router.agent_events import AgentDied, AgentJoined, AgentLeft
from router.membership import Membership
from router.membership_types import (
    Dial,
    Forget,
    MembershipPolicy,
    MemberState,
    Phase,
    ReloadTasks,
    ReplanFailed,
    Replanned,
    Send,
    StartReplan,
    SwitchPlan,
    TasksReloaded,
    Unavailable,
)
from tests.factories import DEMO_PLACEMENT, REPO, welcome

POLICY = MembershipPolicy(grace_s=5.0, min_interval_s=10.0, load_timeout_s=60.0, retry_s=15.0, drain_s=3.0)


def plan(placement: dict[str, tuple[int, int]]) -> Plan:
    return Plan(cluster="demo", model="smollm2-135m", method="manual", placement=placement, max_flow_tok_s=1.0)


def serving() -> Membership:
    """The demo placement, every agent joined holding its range."""
    m = Membership(load_cluster(REPO / "clusters" / "demo" / "cluster.yaml"), plan(dict(DEMO_PLACEMENT)), POLICY)
    assert m.update([AgentJoined(n, welcome(n, r)) for n, r in DEMO_PLACEMENT.items()], now=0.0) == []
    assert m.counts()["serving"] == 3 and m.version == 0
    return m


def loaded(node: str, version: int, rng: tuple[int, int], op: str = "load", error: str = "") -> wire.Layers:
    return wire.Layers(node, version, op, *(rng if not error else (0, 0)), error=error)


def of(actions: list, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def test_a_death_waits_its_grace_period_then_the_cluster_is_replanned_and_switched() -> None:
    m = serving()
    assert m.update([AgentDied("cpu-0")], now=10.0) == [] and m.members["cpu-0"].state is MemberState.DEAD
    assert m.tick(14.9) == []  # it may come back
    (start,) = m.tick(15.0)
    assert isinstance(start, StartReplan) and start.version == 1 and [n.id for n in start.nodes] == ["cpu-1", "cpu-2"]
    assert m.reconfig is not None and m.reconfig.reasons == ["cpu-0 died"]
    out = m.update([Replanned(1, plan({"cpu-1": (0, 20), "cpu-2": (20, 30)}))], now=16.0)
    assert [(a.node, a.message) for a in of(out, Send)] == [("cpu-1", wire.SetLayers(1, 0, 20)),
                                                            ("cpu-2", wire.SetLayers(1, 20, 30))]
    assert m.update([loaded("cpu-1", 1, (0, 20))], now=17.0) == []  # waits for every node
    assert m.update([loaded("cpu-2", 1, (20, 30))], now=18.0) == [ReloadTasks(1, ("cpu-1", "cpu-2"))]
    out = m.update([TasksReloaded(1)], now=18.1)
    assert isinstance(out[0], SwitchPlan) and out[0].version == 1 and Forget("cpu-0") in out
    assert [a.message for a in of(out, Send)] == [wire.ReleaseLayers(1, 3.0)] * 2
    assert m.version == 1 and "cpu-0" not in m.members and m.reconfig.phase is Phase.RELEASING  # type: ignore[union-attr]
    m.update([loaded("cpu-1", 1, (0, 20), op="release"), loaded("cpu-2", 1, (20, 30), op="release")], now=19.0)
    assert m.reconfig is None and m.counts()["serving"] == 2
    json.dumps(m.view(20.0))


def test_a_node_back_within_the_grace_period_moves_nothing() -> None:
    m = serving()
    m.update([AgentDied("cpu-2")], now=1.0)
    assert m.update([AgentJoined("cpu-2", welcome("cpu-2", (16, 30)))], now=3.0) == []
    assert m.tick(100.0) == [] and m.members["cpu-2"].state is MemberState.SERVING


def test_replans_are_rate_limited_and_a_load_error_keeps_the_old_plan_until_retry() -> None:
    m = serving()
    m.update([AgentDied("cpu-0")], now=0.0)
    (start,) = m.tick(5.0)
    m.update([Replanned(start.version, plan({"cpu-1": (0, 20), "cpu-2": (20, 30)}))], now=6.0)
    assert m.update([loaded("cpu-1", 1, (0, 20), error="not enough memory: 1 GB more")], now=7.0) == []
    assert m.reconfig is None and m.version == 0 and "not enough memory" in m.last_error
    assert m.tick(21.9) == []  # retry_s after the failure
    (again,) = m.tick(22.0)
    assert isinstance(again, StartReplan) and again.version == 2  # a dropped version is not reused
    m.update([Replanned(2, plan({"cpu-1": (0, 16), "cpu-2": (16, 30)}))], now=23.0)  # nothing moves: switch at once
    assert m.version == 2 and m.reconfig is None
    m.update([AgentDied("cpu-2")], now=24.0)
    assert m.tick(29.0) == [] and m.tick(31.9) == []  # grace passed, but not 10 s since the last re-plan started
    assert isinstance(m.tick(32.0)[0], StartReplan)


def test_nodes_that_cannot_hold_the_model_are_unavailable_until_the_membership_changes() -> None:
    m = serving()
    m.update([AgentDied("cpu-0"), AgentDied("cpu-2")], now=0.0)
    (start,) = m.tick(5.0)
    out = m.update([ReplanFailed(start.version, "cpu-1 holds 16 of 30 layers", infeasible=True)], now=6.0)
    assert out == [Unavailable("the 1 node(s) left cannot serve the model: cpu-1 holds 16 of 30 layers")]
    assert m.tick(100.0) == [] and m.unavailable  # the same nodes: no new attempt
    m.update([AgentJoined("cpu-0", welcome("cpu-0", (0, 30)))], now=101.0)  # back, and another plan is tried
    assert m.reconfig is not None and m.reconfig.nodes == ("cpu-0", "cpu-1")
    m.update([Replanned(m.reconfig.version, plan({"cpu-0": (0, 30), "cpu-1": (0, 16)}))], now=102.0)
    assert m.unavailable == "" and m.counts() == {"joining": 0, "serving": 2, "standby": 0, "leaving": 0, "dead": 0}


def test_a_leaving_node_is_replanned_at_once_and_forgotten_once_it_left() -> None:
    m = serving()
    (start,) = m.update([wire.Leaving("cpu-0", 30.0, 2)], now=1.0)
    assert isinstance(start, StartReplan) and m.reconfig.reasons == ["cpu-0 leaves"]  # type: ignore[union-attr]
    out = m.update([Replanned(1, plan({"cpu-1": (0, 16), "cpu-2": (16, 30)}))], now=2.0)
    assert of(out, SwitchPlan) and not of(out, Forget) and m.members["cpu-0"].state is MemberState.LEAVING
    assert m.update([AgentLeft("cpu-0")], now=5.0) == [Forget("cpu-0")] and "cpu-0" not in m.members


def test_a_death_during_a_reconfiguration_drops_it() -> None:
    m = serving()
    (start,) = m.update([wire.Leaving("cpu-0", 30.0, 0)], now=0.0)
    m.update([Replanned(1, plan({"cpu-1": (0, 20), "cpu-2": (20, 30)}))], now=1.0)
    assert m.update([AgentDied("cpu-1")], now=2.0) == [] and m.reconfig is None
    assert "cpu-1 died during the change" in m.last_error and m.version == 0


def test_a_joining_node_is_dialed_and_served_after_the_switch() -> None:
    m = serving()
    new = NodeSpec(id="cpu-3", gpu="cpu", region="local", address="tcp://127.0.0.1:7000")
    assert m.join(new, now=1.0) == [Dial("cpu-3", "tcp://127.0.0.1:7000")]
    assert m.join(new, now=1.1) == []  # asked again: nothing new
    (start,) = m.update([AgentJoined("cpu-3", welcome("cpu-3", (0, 0)))], now=2.0)
    assert [n.id for n in start.nodes] == ["cpu-0", "cpu-1", "cpu-2", "cpu-3"] and start.nodes[-1] == new
    with pytest.raises(ConfigError, match="belongs to a connected member"):
        m.join(new.model_copy(update={"address": "tcp://127.0.0.1:7001"}), now=2.5)
    out = m.update([Replanned(1, plan({**DEMO_PLACEMENT, "cpu-3": (0, 30)}))], now=3.0)
    assert [(a.node, a.message) for a in of(out, Send)] == [("cpu-3", wire.SetLayers(1, 0, 30))]
    assert m.members["cpu-3"].state is MemberState.JOINING
    m.update([loaded("cpu-3", 1, (0, 30))], now=4.0)
    out = m.update([TasksReloaded(1)], now=4.0)
    assert of(out, SwitchPlan) and m.members["cpu-3"].state is MemberState.SERVING
    assert m.view(5.0)["plan"]["placement"]["cpu-3"] == [0, 30]  # type: ignore[index]
