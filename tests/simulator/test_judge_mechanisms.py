"""The paper simulator's mechanisms our simulator adopted (issue 21, docs/simulator.md "Where we
differ"), each pinned with numbers and with the ``SimConfig`` switch that turns it off: a lone
decode priced as two, the prompt-count and decode-context limits of the paper's vLLM nodes, the
host copy per received token, routing by the flows the judge recomputes, and
``LEGACY_MECHANISMS`` reproducing the figures from before."""

from __future__ import annotations

from pathlib import Path

import pytest

from helix.plan import FlowEdge, Plan, load_plan
from helix.profile import GpuProfile, ModelProfile, ProfileSet, ThroughputProfile, load_profiles_for
from helix.spec import ClusterSpec, load_cluster
from node_agent.kv_account import KVAccount
from node_agent.scheduler import Scheduler, SchedulerConfig
from simulator.engine import SimConfig, Simulation, simulate
from simulator.nodes import IterationLimits
from simulator.results import LEGACY_MECHANISMS
from simulator.routing import judge_flows
from simulator.workload import RequestSpec

PAPER = Path(__file__).resolve().parents[2] / "clusters" / "helix-paper-single24"
NO_COPY = {"host_copy_gb_per_s": ()}  # exact timing sums for the mechanisms tested alone


def _cluster(nodes: int, *, layers: int, hidden: int = 8, decode=((0, 0.0), (1, 1.0), (8, 1.0)),
             prefill=((0, 0.0), (100, 1.0)), pmax: int | None = None, dmax: int | None = None, gbps: float = 1e6,
             kv: float = 1e7):
    """``nodes`` identical nodes of one GPU type serving a ``layers``-layer model, ``kv`` KV entries each; links free."""
    model = ModelProfile(num_layers=layers, hidden_size=hidden, layer_weight_bytes=1.0, kv_bytes_per_token_per_layer=1.0)
    tp = ThroughputProfile(max_layers=layers, prefill_ms_per_layer=list(prefill), decode_ms_per_layer=list(decode),
                           kv_capacity_tokens_by_layers=[kv] * layers,
                           prompt_max_tokens_by_layers=None if pmax is None else [pmax] * layers,
                           decode_max_tokens_by_layers=None if dmax is None else [dmax] * layers)  # fmt: skip
    profiles = ProfileSet(models={"m": model}, gpus={"g": GpuProfile(vram_gb=1, throughput={"m": tp})})
    cluster = ClusterSpec.model_validate({
        "name": "t", "model": "m", "profiles": "p.yaml", "coordinator": {"id": "c"},
        "nodes": [{"id": f"n{i}", "gpu": "g"} for i in range(nodes)],
        "defaults": {"intra_region": {"bandwidth_gbps": gbps, "latency_ms": 0.0}}})
    return cluster, profiles


def _plan(placement: dict[str, tuple[int, int]], flows: list[FlowEdge] | None = None) -> Plan:
    return Plan(cluster="t", model="m", method="given", placement=placement, max_flow_tok_s=1.0, flows=flows or [])


def _online(trace: list[RequestSpec], **cfg: object) -> SimConfig:
    return SimConfig(mode="online", trace=trace, num_requests=len(trace), warmup_s=0.0, duration_s=1e6, **cfg)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def paper():
    cluster = load_cluster(PAPER / "cluster.yaml")
    return cluster, load_profiles_for(cluster), load_plan(PAPER / "reference" / "milp.json")


def test_a_lone_decode_costs_what_two_cost() -> None:
    # the paper's tables start (0, 0), (2, y): one decode was interpolated to y / 2
    cluster, profiles = _cluster(1, layers=6, decode=((0, 0.0), (2, 1.0), (8, 1.6)))
    plan = _plan({"n0": (0, 6)})
    trace = [RequestSpec(0.0, 10, 3)]
    gap = simulate(cluster, profiles, plan, _online(trace, **NO_COPY)).decode_latency_s["p50"]
    assert gap == pytest.approx(0.006)  # 6 layers x 1.0 ms, the cost of two decodes
    old = simulate(cluster, profiles, plan, _online(trace, decode_floor=False, **NO_COPY)).decode_latency_s["p50"]
    assert old == pytest.approx(0.003)  # 6 layers x 0.5 ms


def test_slow_nodes_prefill_one_prompt_per_iteration(paper) -> None:
    # a 2048-token prompt limit is one prompt slot: three 763-token prompts at once on one node; the first
    # starts alone (2 layers x 7.63 ms), the two behind it shared one iteration and now take one each
    cluster, profiles = _cluster(1, layers=2, prefill=((0, 0.0), (1000, 10.0)), pmax=2048)
    plan = _plan({"n0": (0, 2)})
    trace = [RequestSpec(0.0, 763, 1) for _ in range(3)]
    one = 2 * 7.63 / 1000
    ttft = simulate(cluster, profiles, plan, _online(trace, **NO_COPY)).prompt_latency_s
    assert ttft["mean"] == pytest.approx((one + 2 * one + 3 * one) / 3)
    old = simulate(cluster, profiles, plan, _online(trace, prompt_slot_tokens=None, **NO_COPY)).prompt_latency_s
    assert old["mean"] == pytest.approx((one + 3 * one + 3 * one) / 3)
    # the paper's nodes: A100 6144 tokens = 3 prompts, L4 and T4 2048 = 1, decodes' context 1000 per decode slot
    cluster, profiles, milp = paper
    sim = Simulation(cluster, profiles, milp, SimConfig())
    by_gpu = {cluster.node(n).gpu: (node.limits.prompts, node.limits.decode_context)
              for n, node in sim.nodes.items() if node.k in (4, 9)}
    assert by_gpu == {"A100": (3, 480_000.0), "L4": (1, 380_000.0), "T4": (1, 300_000.0)}
    old = Simulation(cluster, profiles, milp, SimConfig(**LEGACY_MECHANISMS))  # type: ignore[arg-type]
    assert {(node.limits.prompts, node.limits.decode_context) for node in old.nodes.values()} == {(None, None)}


def test_decodes_whose_contexts_pass_the_limit_wait_for_the_next_iteration() -> None:
    # the agents' scheduler offers every decode that has its token; the paper's vLLM limits keep what fits
    scheduler = Scheduler(SchedulerConfig(max_batch_size=8, token_budget=8 + 4 * 1500, chunk_size=None), KVAccount(10**6))
    for i in range(4):
        scheduler.add(f"r{i}", 1500, 10, pending_tokens=1500)
    scheduler.update(scheduler.schedule())  # the four prompts
    for i in range(4):
        scheduler.add_input(f"r{i}", 1)  # each one's first sampled token
    batch = scheduler.schedule()
    assert [w.first_position for w in batch.work] == [1500] * 4

    def kept(dctx: float | None) -> int:
        return len(IterationLimits(decodes=4, prompt_tokens=2048, decode_context=dctx).trim(batch).work)

    # decode_max_tokens 4 x 1000 context tokens per slot: two 1501-token contexts fit (3002), a third does not
    assert kept(4 * 1000.0) == 2
    assert kept(None) == 4
    assert len(IterationLimits(decodes=3, prompt_tokens=2048).trim(batch).work) == 3  # decode_max_tokens itself


def test_received_tokens_are_copied_to_the_gpu_before_the_batch_runs() -> None:
    # LLaMA-2 70B's activations: 8192 values x 2 bytes = 16384 bytes per token, copied at 4 then 5 GB/s
    cluster, profiles = _cluster(2, layers=2, hidden=8192)
    plan = _plan({"n0": (0, 1), "n1": (1, 2)})
    trace = [RequestSpec(0.0, 763, 1)]
    with_copy = simulate(cluster, profiles, plan, _online(trace)).prompt_latency_s["p50"]
    without = simulate(cluster, profiles, plan, _online(trace, **NO_COPY)).prompt_latency_s["p50"]
    per_byte = 1 / 4e9 + 1 / 5e9
    # n1 copies the prompt's 763 activations (5.63 ms), n0 its 763 token ids from the coordinator (2 bytes each)
    assert with_copy - without == pytest.approx(763 * 16384 * per_byte + 763 * 2 * per_byte)
    assert 763 * 16384 * per_byte == pytest.approx(0.005626, abs=1e-6)


def test_judge_flows_leave_a_parallel_node_idle_where_the_plans_flows_use_it() -> None:
    # [0,2) and [4,6) on one node each; [2,4) on three identical nodes: the min cut is one node's capacity, so the
    # middle has 3x what the max flow needs
    cluster, profiles = _cluster(5, layers=6)
    placement = {"n0": (0, 2), "n1": (2, 4), "n2": (2, 4), "n3": (2, 4), "n4": (4, 6)}
    third = 100.0
    balanced = [FlowEdge(src="c", dst="n0", tok_s=3 * third), FlowEdge(src="n4", dst="c", tok_s=3 * third)]
    balanced += [FlowEdge(src="n0", dst=m, tok_s=third) for m in ("n1", "n2", "n3")]
    balanced += [FlowEdge(src=m, dst="n4", tok_s=third) for m in ("n1", "n2", "n3")]
    plan = _plan(placement, balanced)
    kept = judge_flows(plan, cluster, profiles)
    middle_used = {m for m in ("n1", "n2", "n3") if ("n0", m) in kept}
    assert 1 <= len(middle_used) < 3  # preflow-push routes the min cut's flow through fewer than all three
    trace = [RequestSpec(0.01 * i, 50, 20) for i in range(30)]
    ours = simulate(cluster, profiles, plan, _online(trace))
    judge = simulate(cluster, profiles, plan, _online(trace, flows="judge"))
    assert all(ours.node_utilization[m] > 0 for m in ("n1", "n2", "n3"))
    assert {m for m in ("n1", "n2", "n3") if judge.node_utilization[m] > 0} == middle_used


def test_judge_flows_drop_hops_under_five_percent_of_their_vertex(monkeypatch) -> None:
    import planner.graph
    from planner.graph import FlowResult

    cluster, profiles = _cluster(4, layers=4)
    plan = _plan({"n0": (0, 2), "n1": (2, 4), "n2": (2, 4), "n3": (2, 4)})
    # a max flow that sends 4 % of n0's out-flow to n2 and 6 % to n3: the judge keeps n3's hop, not n2's
    flows = [FlowEdge(src="c", dst="n0", tok_s=100.0), FlowEdge(src="n0", dst="n1", tok_s=90.0),
             FlowEdge(src="n0", dst="n2", tok_s=4.0), FlowEdge(src="n0", dst="n3", tok_s=6.0),
             FlowEdge(src="n1", dst="c", tok_s=90.0), FlowEdge(src="n2", dst="c", tok_s=4.0),
             FlowEdge(src="n3", dst="c", tok_s=6.0)]
    monkeypatch.setattr(planner.graph, "evaluate", lambda *a, **k: FlowResult(100.0, flows, []))
    kept = judge_flows(plan, cluster, profiles)
    assert set(kept) == {("c", "n0"), ("n0", "n1"), ("n0", "n3"), ("n1", "c"), ("n3", "c"), ("n2", "c")}
    # n2's own out-edge is all of its vertex's flow, but nothing reaches n2: every pipeline avoids it
    res = simulate(cluster, profiles, plan, _online([RequestSpec(0.01 * i, 50, 20) for i in range(40)], flows="judge"))
    assert res.node_utilization["n2"] == 0 and res.node_utilization["n3"] > 0


def test_unknown_flows_and_bad_limits_name_the_field(paper) -> None:
    from helix.errors import ConfigError

    cluster, profiles, milp = paper
    for bad, field in (({"flows": "networkx"}, "flows"), ({"prompt_slot_tokens": 0}, "prompt_slot_tokens"),
                       ({"decode_context_per_slot": 0.0}, "decode_context_per_slot"),
                       ({"host_copy_gb_per_s": (4.0, 0.0)}, "host_copy_gb_per_s")):
        with pytest.raises(ConfigError, match=field):
            simulate(cluster, profiles, milp, SimConfig(duration_s=1.0, warmup_s=0.0, **bad))  # type: ignore[arg-type]


def test_legacy_mechanisms_turn_every_adopted_mechanism_off() -> None:
    # LEGACY_MECHANISMS prices as the simulator did before issue 21: a lone decode at the interpolated half of two,
    # the prompts queued behind the first share one iteration, nothing copied to the GPU (here all at once)
    cluster, profiles = _cluster(1, layers=2, hidden=8192, decode=((0, 0.0), (2, 1.0), (8, 1.6)),
                                 prefill=((0, 0.0), (1000, 10.0)), pmax=2048)  # fmt: skip
    plan = _plan({"n0": (0, 2)})
    one = 2 * 7.63 / 1000  # a 763-token prompt on 2 layers
    prompts = [RequestSpec(0.0, 763, 1) for _ in range(3)]
    old = simulate(cluster, profiles, plan, _online(prompts, **LEGACY_MECHANISMS)).prompt_latency_s  # type: ignore[arg-type]
    assert old["mean"] == pytest.approx((one + 3 * one + 3 * one) / 3)
    gap = simulate(cluster, profiles, plan, _online([RequestSpec(0.0, 10, 3)], **LEGACY_MECHANISMS))  # type: ignore[arg-type]
    assert gap.decode_latency_s["p50"] == pytest.approx(2 * 0.5 / 1000)
    new = simulate(cluster, profiles, plan, _online(prompts)).prompt_latency_s  # one prompt per iteration
    assert new["mean"] == pytest.approx((one + 2 * one + 3 * one) / 3, abs=1e-5)


def test_prompt_latency_from_admission_leaves_out_the_wait_for_kv() -> None:
    # the paper's simulator counts a prompt's latency from its admission; ours also from its arrival, which counts
    # the wait in the coordinator's queue while KV masks every route: here a node holds one request at a time
    cluster, profiles = _cluster(1, layers=2, kv=200.0)  # 0.85 x 200 entries: one request of 70 tokens x 2 layers
    plan = _plan({"n0": (0, 2)})
    res = simulate(cluster, profiles, plan, _online([RequestSpec(0.0, 50, 20) for _ in range(3)], **NO_COPY))
    assert res.finished_requests == 3
    for k in ("mean", "p50", "p90", "p99"):
        assert 0 < res.extra[f"prompt_latency_from_admission_{k}_s"] <= res.prompt_latency_s[k]
    assert res.extra["prompt_latency_from_admission_mean_s"] < res.prompt_latency_s["mean"]  # two waited
    # with nothing masked, nothing waits: both count the same
    light = simulate(*_cluster(1, layers=2), plan, _online([RequestSpec(2.0 * i, 50, 5) for i in range(5)]))
    assert light.extra["prompt_latency_from_admission_p50_s"] == pytest.approx(light.prompt_latency_s["p50"])


def test_per_request_messages_fragment_a_batch_at_an_idle_node() -> None:
    # two requests admitted together: as one message they run every iteration together on both stages; one message
    # per request (the paper's simulator) reaches an idle node 16 us apart (16384 bytes at 1 GB/s), so the first
    # runs alone and the second waits for it, at every stage and every token
    cluster, profiles = _cluster(2, layers=2, hidden=8192, gbps=8.0)  # 1e9 bytes/s
    plan = _plan({"n0": (0, 1), "n1": (1, 2)})
    cfg = {"num_requests": 2, "offline_initial": 2, "warmup_s": 0.0, "duration_s": 1e6, "lengths": "fixed:10,4",
           **NO_COPY}

    def iterations(per_request: bool) -> tuple[int, int]:
        sim = Simulation(cluster, profiles, plan, SimConfig(per_request_messages=per_request, **cfg))  # type: ignore[arg-type]
        assert sim.run().finished_requests == 2
        return sim.nodes["n0"].iters, sim.nodes["n1"].iters

    assert iterations(False) == (4, 4)  # prompt + 3 decodes, both requests in each
    assert iterations(True) == (8, 8)


def test_cli_flows_messages_and_legacy_switches(paper, capsys) -> None:
    import json

    from helix.cli import main

    cluster, profiles, milp = paper
    args = ["simulate", str(PAPER / "cluster.yaml"), str(PAPER / "reference" / "milp.json"), "--duration", "20",
            "--warmup", "10", "--json"]
    assert main([*args, "--flows", "judge", "--per-request-messages", "--legacy-mechanisms"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = SimConfig(duration_s=20.0, warmup_s=10.0, flows="judge", per_request_messages=True, **LEGACY_MECHANISMS)  # type: ignore[arg-type]
    same = simulate(cluster, profiles, milp, cfg)
    assert out["flows"] == "judge" and out["events"] == same.events
    assert out["decode_tok_s"] == pytest.approx(same.decode_tok_s)
    with pytest.raises(SystemExit):  # argparse names the choices
        main([*args, "--flows", "maxflow"])
    assert "--flows: invalid choice: 'maxflow'" in capsys.readouterr().err
