"""Membership traces in the simulator (issue 18): kills, leaves and joins replayed through the server's own
membership policy (router.membership) and planner.replan; what they cost; bad traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helix.errors import ConfigError
from helix.plan import Plan
from helix.profile import GpuProfile, ModelProfile, ProfileSet, ThroughputProfile
from helix.spec import ClusterSpec
from planner.api import evaluate_plan
from simulator.engine import SimConfig, simulate
from simulator.membership_trace import load_membership_trace
from simulator.nodes import build_node

MODEL = {"num_layers": 8, "hidden_size": 1024, "layer_weight_bytes": 1e9, "kv_bytes_per_token_per_layer": 1.0}
GPU = {"max_layers": 4, "prefill_ms_per_layer": [[0, 0], [1000, 5.0]], "decode_ms_per_layer": [[1, 1.0], [64, 2.0]],
       "kv_capacity_tokens_by_layers": [400000, 200000, 130000, 100000]}  # fmt: skip
PLACEMENT = {"n0": (0, 4), "n1": (4, 8), "n2": (0, 4), "n3": (4, 8)}  # two pipelines of two nodes
RUN = {"warmup_s": 0.0, "lengths": "uniform:100-300,20-80", "bucket_s": 5.0, "max_inflight": 24}
FAST = {"replan_time_limit_s": 0.3}  # the planner's time limit (and a re-plan's simulated duration)


def _cluster() -> tuple[ClusterSpec, ProfileSet, Plan]:
    """An 8-layer model on four identical nodes of at most 4 layers each, 1 ms links."""
    profiles = ProfileSet(models={"m": ModelProfile(**MODEL)},
                          gpus={"g": GpuProfile(vram_gb=1, throughput={"m": ThroughputProfile(**GPU)})})  # fmt: skip
    cluster = ClusterSpec.model_validate({
        "name": "t", "model": "m", "profiles": "p.yaml", "coordinator": {"id": "c"},
        "nodes": [{"id": f"n{i}", "gpu": "g"} for i in range(4)],
        "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 1}}})
    plan = evaluate_plan(cluster, profiles, Plan(cluster="t", model="m", method="given", max_flow_tok_s=0,
                                                 placement=PLACEMENT))  # fmt: skip
    return cluster, profiles, plan


def _trace(tmp_path: Path, doc: object, name: str = "trace.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def _mean(timeline: list[tuple[float, float]], start: float, end: float) -> float:
    """Mean decode tok/s of the windows that end in ``(start, end]``."""
    xs = [x for t, x in timeline if start < t <= end]
    return sum(xs) / len(xs)


@pytest.fixture(scope="module")
def kill_then_join(tmp_path_factory):
    """n1 dies at 15 s, n9 joins at 35 s; every planner.replan call is recorded."""
    import planner.replan

    cluster, profiles, plan = _cluster()
    path = _trace(tmp_path_factory.mktemp("trace"), {"policy": FAST, "events": [
        {"at_s": 35, "join": {"id": "n9", "gpu": "g"}}, {"at_s": 15, "kill": "n1"}]})  # in any order
    trace = load_membership_trace(path, cluster, plan, profiles)
    calls = []
    real = planner.replan.replan

    def spy(*args, **kwargs):
        calls.append((args, real(*args, **kwargs)))
        return calls[-1][1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planner.replan, "replan", spy)
        result = simulate(cluster, profiles, plan, SimConfig(duration_s=55.0, **RUN), membership=trace)
    return result, trace, calls


def test_a_kill_then_a_join_loses_no_request(kill_then_join) -> None:
    result, trace, _ = kill_then_join
    m = result.membership
    assert m["lost_requests"] == 0 and m["refused_requests"] == 0 and result.extra["failed_requests"] == 0
    assert m["requests_rerouted"] > 0  # n1's requests in flight were re-prefilled through the core's failover
    assert m["uncovered_s"] == 0  # n0 -> n3 still covered every layer
    assert [r["outcome"] for r in m["replans"]] == ["switched", "switched"]
    assert m["plan_version"] == 2 and "n1" not in m["placement"] and "n9" in m["placement"]
    covered = sorted(tuple(r) for r in m["placement"].values())
    assert covered[0][0] == 0 and max(e for _, e in covered) == 8


def test_the_replan_waits_for_the_grace_period(kill_then_join) -> None:
    result, trace, _ = kill_then_join
    died, joined = result.membership["replans"]
    policy = trace.membership_policy()
    assert died["reasons"] == ["n1 died"] and joined["reasons"] == ["n9 joined"]
    # the death is noticed detect_s after the kill, then the membership waits grace_s (ticked every 0.25 s)
    assert 15 + trace.detect_s + policy.grace_s <= died["started_s"] <= 15 + trace.detect_s + policy.grace_s + 0.25
    assert joined["started_s"] == 35.0  # a join re-plans at once
    assert died["planned_s"] == pytest.approx(died["started_s"] + trace.replan_duration_s)
    assert died["switched_s"] >= died["planned_s"]  # after its layers loaded
    timeline = [e["what"] for e in result.membership["timeline"]]
    assert timeline.index("n1 died") < timeline.index("plan v1 routed") < timeline.index("trace events[0]: join n9")


def test_throughput_dips_and_recovers(kill_then_join) -> None:
    result, _, _ = kill_then_join
    timeline = result.throughput_over_time
    before = _mean(timeline, 5, 15)
    dip = _mean(timeline, 15, 20)  # n1 dead, half the second half gone until the re-plan (about 22 s)
    after = _mean(timeline, 40, 55)  # routed by the plan with n9
    assert dip < 0.8 * before
    assert after > dip and after >= 0.75 * before


def test_the_trace_goes_through_planner_replan(kill_then_join) -> None:
    result, _, calls = kill_then_join
    assert len(calls) == 2
    (cluster1, _, current1, _), replan1 = calls[0]
    (cluster2, _, current2, _), replan2 = calls[1]
    assert "n1" not in cluster1.node_ids and current1.placement == PLACEMENT  # the membership less the dead
    assert "n9" in cluster2.node_ids and current2.placement == replan1.plan.placement
    reported = result.membership["replans"]
    for record, r in zip(reported, (replan1, replan2), strict=True):
        assert record["replan"]["moves"] == [m.to_dict() for m in r.moves if m.change != "kept"]
        assert record["replan"]["layers_moved"] == r.layers_moved
    assert {m["node"] for m in reported[0]["replan"]["moves"]} >= {"n1"}  # n1 drops its layers
    assert any(m["node"] == "n9" and m["layers_loaded"] > 0 for m in reported[1]["replan"]["moves"])
    assert result.membership["placement"] == {n: list(r) for n, r in replan2.plan.placement.items()}


def test_a_leave_drains_and_loses_nothing(tmp_path) -> None:
    cluster, profiles, plan = _cluster()
    trace = load_membership_trace(_trace(tmp_path, {"policy": FAST, "events": [{"at_s": 5, "leave": "n3"}]}),
                                  cluster, plan, profiles)  # fmt: skip
    result = simulate(cluster, profiles, plan, SimConfig(duration_s=20.0, **RUN), membership=trace)
    m = result.membership
    assert m["lost_requests"] == 0 and m["refused_requests"] == 0
    assert m["replans"][0]["reasons"] == ["n3 leaves"] and m["replans"][0]["started_s"] == 5.0  # at once
    timeline = [e["what"] for e in m["timeline"]]
    assert any(w.startswith("n3 is leaving (draining ") for w in timeline) and "n3 left" in timeline
    assert "n3" not in m["placement"] and m["uncovered_s"] == 0


def test_nodes_that_cannot_hold_the_model_make_it_unavailable(tmp_path) -> None:
    cluster, profiles, plan = _cluster()
    events = [{"at_s": 3, "kill": n} for n in ("n0", "n1", "n2")]  # n3 alone holds at most 4 of 8 layers
    trace = load_membership_trace(_trace(tmp_path, {"policy": FAST, "events": events}), cluster, plan, profiles)
    result = simulate(cluster, profiles, plan, SimConfig(duration_s=15.0, **RUN), membership=trace)
    m = result.membership
    assert m["replans"][0]["outcome"].startswith("infeasible")
    assert m["unavailable"] and "cannot serve the model" in m["unavailable"]
    assert m["lost_requests"] > 0  # the requests in flight when the last route went
    assert m["uncovered_s"] == pytest.approx(12.0)  # from the kills to the end of the run


def test_a_node_between_two_plans_prices_each_request_on_its_own_layers() -> None:
    cluster, profiles, _ = _cluster()
    node = build_node(cluster, profiles, "n1", 4, 8, SimConfig(), {})  # its new range; [0, 4) was its old one

    def cost(*spans: tuple[int, int, int, int], sampled: int) -> float:
        return node.curves.iteration_ms(spans, sampled=sampled, head_share=node.head_share)

    # a request still on the old range beside one on the new: one span each
    assert node._ranges_ms({(0, 4): [0, 1, 10], 4: [0, 1, 10]}, 1) == pytest.approx(
        cost((4, 0, 1, 10), (4, 0, 1, 10), sampled=1))
    # overlapping ranges: the layers both hold run both
    assert node._ranges_ms({(2, 6): [0, 1, 10], 4: [7, 1, 10]}, 1) == pytest.approx(
        cost((2, 0, 1, 10), (2, 7, 2, 20), (2, 7, 1, 10), sampled=1))
    # every request up to the node's end: what iteration_ms says
    assert node._ranges_ms({4: [5, 1, 10], 6: [0, 2, 30]}, 3) == pytest.approx(
        node.iteration_ms({4: [5, 1, 10], 6: [0, 2, 30]}, 3))


@pytest.mark.parametrize(("doc", "field", "says"), [
    ({"events": [{"at_s": 5, "kil": "n1"}]}, "events[0].kil", "kill"),  # a typo: the closest field is named
    ({"events": [{"at_s": 5, "kill": "n7"}]}, "events[0].kill", "not up at 5 s"),
    ({"events": [{"at_s": 9, "leave": "n1"}, {"at_s": 5, "kill": "n1"}]}, "events[0].leave", "not up at 9 s"),
    ({"events": [{"at_s": 5, "join": {"id": "n9", "gpu": "H100"}}]}, "events[0].join.gpu", "no profile"),
    ({"events": [{"at_s": 5, "join": {"id": "n2", "gpu": "g"}}]}, "events[0].join.id", "taken"),
    ({"events": [{"at_s": 5, "kill": "n2"}, {"at_s": 6, "join": {"id": "n2", "gpu": "g"}}]}, "events[1].join.id",
     "before the coordinator may know it is gone"),
    ({"events": [{"at_s": 5, "kill": "n1", "leave": "n1"}]}, "events[0]", "exactly one of"),
    ({"events": [{"at_s": -1, "kill": "n1"}]}, "events[0].at_s", "greater than or equal to 0"),
    ({"events": [], "policy": {"grace": 3}}, "policy.grace", "unknown setting"),
    ({"events": [], "load_gb_per_s": 0}, "load_gb_per_s", "greater than 0"),
])  # fmt: skip
def test_a_bad_trace_names_the_file_and_field(tmp_path, doc, field, says) -> None:
    cluster, profiles, plan = _cluster()
    path = _trace(tmp_path, doc)
    with pytest.raises(ConfigError) as err:
        load_membership_trace(path, cluster, plan, profiles)
    assert str(path) in str(err.value) and f"{field}:" in str(err.value) and says in str(err.value), str(err.value)


def test_cli_membership(tmp_path, capsys, monkeypatch) -> None:
    from helix.cli import main

    monkeypatch.setenv("COLUMNS", "120")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"models": {"m": MODEL}, "gpus": {"g": {"vram_gb": 1,
                                                                                         "throughput": {"m": GPU}}}}))
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({
        "name": "t", "model": "m", "profiles": "p.yaml", "coordinator": {"id": "c"},
        "nodes": [{"id": f"n{i}", "gpu": "g"} for i in range(4)],
        "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 1}}}))
    (tmp_path / "plan.json").write_text(json.dumps({"placement": PLACEMENT}))
    trace = _trace(tmp_path, {"policy": FAST, "events": [{"at_s": 4, "kill": "n3"}]})
    args = ["simulate", str(tmp_path / "cluster.yaml"), str(tmp_path / "plan.json"), "--duration", "15", "--warmup", "0",
            "--max-inflight", "16", "--lengths", "uniform:100-300,20-80", "--bucket-s", "5", "--membership", str(trace)]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [t for t, _ in data["throughput_over_time"]] == [5, 10, 15]
    assert data["membership"]["replans"][0]["reasons"] == ["n3 died"] and data["membership"]["lost_requests"] == 0
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "re-plans (planner.replan)" in out and "v1 moves: " in out and "n3 [4,8) -> -" in out
    assert "requests re-prefilled (failover):" in out and "decode throughput per 5 s" in out
    bad = _trace(tmp_path, {"events": [{"at_s": 4, "kill": "n8"}]}, "bad.yaml")
    assert main([*args[:-1], str(bad)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{bad}: events[0].kill: node 'n8' is not up at 4 s" in err and "Traceback" not in err
