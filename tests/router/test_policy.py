"""Pure-policy tests of the router: IWRR proportions, pipelines, KV masking, dead nodes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from helix.domain import Pipeline, Stage
from helix.errors import NoRouteError
from helix.plan import load_plan
from helix.profile import load_profiles_for
from helix.spec import load_cluster
from router.iwrr import IWRR
from router.kv import KVEstimator
from router.pipeline import Topology, build_pipeline
from router.policy import Router, RouteRequest

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "clusters" / "helix-paper-single24"


# -- IWRR ------------------------------------------------------------------------------------


def test_iwrr_proportions_and_interleaving() -> None:
    w = IWRR(["a", "b", "c"], [5.0, 3.0, 2.0])
    picks = [w.pick() for _ in range(1000)]
    counts = Counter(picks)
    assert counts == {"a": 500, "b": 300, "c": 200}
    # interleaved: "a" never appears more than twice in a row with weights 5:3:2
    run = longest = 0
    for prev, cur in zip(picks, picks[1:], strict=False):
        run = run + 1 if cur == prev == "a" else 0
        longest = max(longest, run)
    assert longest <= 1


def test_iwrr_real_weights_and_determinism() -> None:
    a = IWRR(["x", "y"], [1.0, 2.1])
    b = IWRR(["x", "y"], [1.0, 2.1])
    seq_a = [a.pick() for _ in range(3000)]
    assert seq_a == [b.pick() for _ in range(3000)]
    assert abs(seq_a.count("x") / 3000 - 1 / 3.1) < 0.002


def test_iwrr_skips_excluded_and_uses_fallbacks() -> None:
    w = IWRR(["a", "b", "z"], [1.0, 1.0, 0.0])
    assert Counter(w.pick() for _ in range(100)) == {"a": 50, "b": 50}  # zero weight never in normal use
    assert all(w.pick(excluded={"a"}) == "b" for _ in range(10))
    assert w.pick(admissible=lambda c: c == "z") == "z"  # fallback only when weighted ones are out
    assert w.pick(excluded={"a", "b", "z"}) is None


# -- pipelines ---------------------------------------------------------------------------------


def _overlap_topology() -> Topology:
    # coordinator -> a[0,4) ; b[2,6) and c[4,8) overlap a ; d[6,10) ; e[5,10) ends the model
    placement = {"a": (0, 4), "b": (2, 6), "c": (4, 8), "d": (6, 10), "e": (5, 10)}
    names = ["coordinator", *placement]
    links = {(s, t) for s in names for t in names if s != t}
    return Topology("coordinator", 10, placement, links)


def _iwrr_chooser(topo: Topology, flows: dict[tuple[str, str], float]):
    inst = {v: IWRR(s, [flows.get((v, c), 0.0) for c in s]) for v, s in topo.successors.items()}
    return lambda v, ex, ok: inst[v].pick(ex, ok)


def test_pipelines_run_every_layer_once_with_overlaps() -> None:
    topo = _overlap_topology()
    assert set(topo.successors["a"]) == {"b", "c"}  # b starts inside a, c starts at a's end
    flows = {("coordinator", "a"): 2, ("a", "b"): 1, ("a", "c"): 1, ("b", "e"): 1, ("c", "d"): 1,
             ("e", "coordinator"): 1, ("d", "coordinator"): 1}
    choose = _iwrr_chooser(topo, flows)
    seen = set()
    for _ in range(20):
        p = build_pipeline(topo, choose)
        p.check(10)
        seen.add(p.nodes)
    assert seen == {("a", "b", "e"), ("a", "c", "d")}
    p = build_pipeline(topo, choose)
    # b holds [2,6) but a already ran up to 4: b runs only [4,6)
    stages = p.stages if p.nodes[1] == "b" else build_pipeline(topo, choose).stages
    assert stages[1] == Stage("b", 4, 6) and stages[2] == Stage("e", 6, 10)


def test_masking_backtracks_and_no_route_raises() -> None:
    topo = _overlap_topology()
    flows = {("coordinator", "a"): 2, ("a", "b"): 1, ("a", "c"): 1, ("b", "e"): 1, ("c", "d"): 1,
             ("e", "coordinator"): 1, ("d", "coordinator"): 1}
    choose = _iwrr_chooser(topo, flows)
    for _ in range(5):  # e masked: b's only planned successor is gone; backtrack or use a fallback edge
        p = build_pipeline(topo, choose, lambda n, s, e: n != "e")
        p.check(10)
        assert "e" not in p.nodes and p.nodes[-1] == "d"
    for _ in range(5):  # b and e masked: a -> c -> d
        assert build_pipeline(topo, choose, lambda n, s, e: n not in {"b", "e"}).nodes == ("a", "c", "d")
    with pytest.raises(NoRouteError):
        build_pipeline(topo, choose, lambda n, s, e: n not in {"e", "d"})


def test_kv_masking_reserve_release_and_reports() -> None:
    kv = KVEstimator({"n": 1000.0}, watermark=0.5, expected_output_tokens=0)
    assert kv.fits("n", 500) and not kv.fits("n", 501)
    kv.reserve("r1", [("n", 2)], 200)  # 400 entries
    assert not kv.fits("n", 101) and kv.fits("n", 100)
    kv.report("n", used=480)  # the agent sees more than we reserved: estimate corrected upward
    assert not kv.fits("n", 21)
    kv.report("n", used=10)  # a low report never lowers the estimate below our reservations
    assert not kv.fits("n", 101)
    assert kv.release("r1") and not kv.release("r1")
    kv.report("n", used=0)
    assert kv.fits("n", 500)


# -- the facade on the paper's cluster ----------------------------------------------------------


@pytest.fixture(scope="module")
def paper():
    cluster = load_cluster(PAPER / "cluster.yaml")
    return cluster, load_profiles_for(cluster), load_plan(PAPER / "reference" / "milp.json")


def test_router_shares_follow_flows(paper) -> None:
    cluster, profiles, plan = paper
    router = Router.from_plan(plan, cluster, profiles)
    counts: Counter[str] = Counter()
    n = 4000
    for i in range(n):
        p = router.route(RouteRequest(i, 100))
        p.check(80)
        router.finish(i)
        counts[p.nodes[0]] += 1
    w = router.iwrr["coordinator"]
    for node in w.candidates:
        assert abs(counts[node] / n - w.share(node)) < 0.01


def test_router_kv_mask_limits_in_flight_and_dead_nodes(paper) -> None:
    cluster, profiles, plan = paper
    router = Router.from_plan(plan, cluster, profiles, watermark=0.85)
    admitted = 0
    with pytest.raises(NoRouteError):
        for i in range(100_000):
            router.route(RouteRequest(i, 2000, 1000))
            admitted += 1
    assert admitted > 10
    for node, kv in router.kv.nodes.items():
        assert kv.reserved <= 0.85 * kv.capacity + 1e-6, node
    for i in range(admitted):
        router.finish(i)
    assert all(kv.reserved == pytest.approx(0.0, abs=1e-6) for kv in router.kv.nodes.values())
    # t4-15 is the only holder of layer 0: killing it leaves no pipeline
    in_flight = router.route(RouteRequest("x", 10))
    assert router.mark_dead("t4-15") == ["x"] and in_flight.nodes[0] == "t4-15"
    assert not router.has_route()
    with pytest.raises(NoRouteError):
        router.route(RouteRequest("y", 10))
    router.mark_alive("t4-15")
    assert router.route(RouteRequest("y", 10)).nodes[0] == "t4-15"
    # a node with parallel holders is avoided when dead
    router.mark_dead("l4-3")
    for i in range(50):
        assert "l4-3" not in router.route(RouteRequest(f"z{i}", 10)).nodes


def test_pipeline_value_object() -> None:
    p = Pipeline((Stage("a", 0, 3), Stage("b", 3, 5)))
    p.check(5)
    assert p.layers_on("b") == 2 and p.describe() == "a[0,3) -> b[3,5)"
