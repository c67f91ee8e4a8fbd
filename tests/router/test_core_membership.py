"""The coordinator core while the cluster changes (issue 18), stepped with fabricated agent events:
a leaving agent is masked at once and its refusals re-route elsewhere, a leaving agent that stops
is a departure, a node is routed through only while it holds its range, and a re-plan's router
takes over with the requests in flight keeping their pipelines and KV reservations.

The demo placement: ``cpu-0 [0, 30)`` alone, or ``cpu-1 [0, 16) -> cpu-2 [16, 30)``.
"""

from __future__ import annotations

import pytest

from helix import wire
from helix.domain import ErrorCode
from helix.errors import NoRouteError
from router.agent_events import AgentDied, AgentJoined, AgentLeft
from router.core import CoordinatorCore
from router.core_interfaces import CoreOutput
from tests.factories import demo_router, joined_core, request, tokens, welcome

SPLIT = {("coordinator", "cpu-1"): 1.0, ("cpu-1", "cpu-2"): 1.0, ("cpu-2", "coordinator"): 1.0}


def admits(out: CoreOutput) -> list[tuple[str, wire.Admit]]:
    return [(n, m) for n, m in out.messages if isinstance(m, wire.Admit)]


def nodes_of(admit: wire.Admit) -> list[str]:
    return [s.stage.node for s in admit.pipeline]


def refused(node: str, wire_id: str, code: ErrorCode) -> wire.Refused:
    return wire.Refused(wire_id, node, code, "refused")


def test_a_leaving_agent_takes_no_new_request_but_finishes_and_cancels_its_own() -> None:
    core = joined_core(demo_router(1e9))
    core.update_from_output([wire.Leaving("cpu-0", 30.0, 0)], now=0.0)
    assert core.ready and "cpu-0" in core.router.draining
    for rid in "abcd":
        core.add_request(request(rid), now=0.0)
    assert all(nodes_of(a) == ["cpu-1", "cpu-2"] for _, a in admits(core.schedule(0.0)))

    core = joined_core(demo_router(1e9, flows=SPLIT))
    core.add_request(request("r"), now=0.0)
    (_, admit), = admits(core.schedule(0.0))
    core.update_from_output([wire.Leaving("cpu-2", 30.0, 1), tokens("cpu-2", admit.request_id, 7)], now=0.1)
    out = core.schedule(0.1)  # its tokens still come and the next step goes on
    assert [(n, type(m)) for n, m in out.messages] == [("cpu-1", wire.Step)]
    core.abort_request("r")
    assert sorted(n for n, m in core.schedule(0.2).messages if isinstance(m, wire.Cancel)) == ["cpu-1", "cpu-2"]


@pytest.mark.parametrize("code", [ErrorCode.LEAVING, ErrorCode.LAYERS_MOVED])
def test_a_leaving_or_layers_moved_refusal_reroutes_the_request(code: ErrorCode) -> None:
    core = joined_core(demo_router(1e9))
    core.add_request(request("r"), now=0.0)
    (node, admit), = admits(core.schedule(0.0))
    core.update_from_output([tokens(admit.pipeline[-1].stage.node, "r.1", 5)], now=0.1)
    core.schedule(0.1)
    core.update_from_output([refused(node, "r.1", code)], now=0.2)
    (_, again), = admits(core.schedule(0.2))
    assert again.request_id == "r.2" and again.prompt[-1] == 5  # re-prefilled with the token so far
    if code is ErrorCode.LEAVING:  # masked before its LEAVING arrived: not sent straight back
        assert node not in nodes_of(again) and node in core.router.draining


def test_a_leaving_agent_that_stops_left_and_a_new_process_is_used_again() -> None:
    core = joined_core(demo_router(1e9, flows=SPLIT))
    core.add_request(request("r"), now=0.0)
    core.schedule(0.0)
    core.update_from_output([wire.Leaving("cpu-2", 30.0, 1), AgentLeft("cpu-2")], now=1.0)
    assert "cpu-2" in core.router.dead and "cpu-2" not in core.router.draining
    (_, again), = admits(core.schedule(1.0))
    assert "cpu-2" not in nodes_of(again)  # what it still ran moved
    core.update_from_output([AgentJoined("cpu-2", welcome("cpu-2", (16, 30)))], now=2.0)
    assert "cpu-2" not in core.router.dead | core.router.draining


def test_no_route_names_the_nodes_down_and_the_layers_no_live_node_holds() -> None:
    core = joined_core(demo_router(1e9))
    core.update_from_output([AgentDied("cpu-0"), wire.Leaving("cpu-2", 30.0, 0)], now=0.0)
    assert not core.ready
    core.unavailable = "the remaining nodes cannot hold the model"
    with pytest.raises(NoRouteError) as exc:
        core.add_request(request("x"), now=0.0)
    assert exc.value.message == ("no complete pipeline is available (nodes down: cpu-0, cpu-2; no live node holds "
                                 "layers [16, 30); the remaining nodes cannot hold the model)")


def _layers(node: str, version: int, start: int, end: int, held: tuple[tuple[int, int], ...] = (),
            op: str = "load", error: str = "") -> wire.Layers:  # fmt: skip
    return wire.Layers(node, version, op, start, end, tuple(wire.LayerSpan(s, e) for s, e in held), error=error)


def test_a_node_is_routed_through_once_it_holds_its_range() -> None:
    core = CoordinatorCore(demo_router(1e9, placement={"cpu-0": (0, 30)}, flows={("coordinator", "cpu-0"): 1.0}))
    core.update_from_output([AgentJoined("cpu-0", welcome("cpu-0", (0, 0)))], now=0.0)  # joined with no layers
    assert not core.ready
    core.update_from_output([_layers("cpu-0", 1, 0, 0, error="not enough memory")], now=0.1)
    assert not core.ready
    core.update_from_output([_layers("cpu-0", 1, 0, 30)], now=0.2)
    assert core.ready


def test_a_new_router_takes_over_with_requests_in_flight_on_their_old_pipelines() -> None:
    core = joined_core(demo_router(1e9, flows=SPLIT))
    core.add_request(request("old"), now=0.0)
    (_, admit), = admits(core.schedule(0.0))
    assert nodes_of(admit) == ["cpu-1", "cpu-2"]
    # the re-plan: cpu-1 grows to [0, 20) (loaded: it holds both), cpu-2 shrinks to [20, 30), cpu-0 goes
    core.update_from_output([_layers("cpu-1", 1, 0, 20), _layers("cpu-2", 1, 20, 30, held=((16, 30),))], now=1.0)
    new = demo_router(1e9, placement={"cpu-1": (0, 20), "cpu-2": (20, 30)}, flows=SPLIT)
    core.set_router(new)
    assert core.router is new and core.ready and new.kv.holds("old") and new.pipeline_of("old") is not None
    core.add_request(request("new"), now=1.0)
    (_, fresh), = admits(core.schedule(1.0))
    assert [(s.stage.node, s.stage.layer_start, s.stage.layer_end) for s in fresh.pipeline] == \
        [("cpu-1", 0, 20), ("cpu-2", 20, 30)]
    core.update_from_output([tokens("cpu-2", "old.1", 9, finished=True, reason="length")], now=1.1)
    out = core.schedule(1.1)  # the old request finished on its old pipeline; its reservation is released
    assert any(o.request_id == "old" and o.finish for o in out.outputs) and not new.kv.holds("old")
    # a node whose agent does not hold its new range is not routed through until it does
    core.set_router(demo_router(1e9, placement={"cpu-1": (0, 25), "cpu-2": (25, 30)}, flows=SPLIT))
    assert core.router.dead == {"cpu-1"} and not core.ready
    core.update_from_output([_layers("cpu-1", 2, 0, 25)], now=2.0)
    assert not core.router.dead and core.ready
