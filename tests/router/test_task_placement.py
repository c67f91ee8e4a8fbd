"""Which nodes hold which task (issue 19 part 2): the core routes a task's requests only through the
nodes holding its PET, and a task with no route is a 503 naming it, never the bare base model.

The core is stepped with fabricated agent events on the demo placement (``cpu-0 [0, 30)`` alone, or
``cpu-1 [0, 16) -> cpu-2 [16, 30)``), as in tests/router/test_core.py; the router, IWRR, KV
estimator and the task placement are the real ones.
"""

from __future__ import annotations

import pytest

from helix import wire
from helix.errors import NoRouteError
from router.agent_events import AgentDied
from router.core_interfaces import CoreOutput
from router.request import RequestStatus
from router.task_placement import PlacementPolicy, TaskPlacement, replica_groups
from tests.factories import demo_router, joined_core, request, tokens

BIG = 10**9  # KV entries per node: nothing is KV-masked


def admitted(out: CoreOutput) -> dict[str, tuple[str, ...]]:
    """Wire id -> the nodes of its pipeline, for every ADMIT sent."""
    return {m.request_id: tuple(s.stage.node for s in m.pipeline) for _, m in out.messages if isinstance(m, wire.Admit)}


def test_by_default_every_node_holds_every_task_and_routing_is_unchanged() -> None:
    plain, tasked = joined_core(demo_router(BIG)), joined_core(demo_router(BIG))
    for i in range(6):
        plain.add_request(request(f"r{i}"), now=0.0)
        tasked.add_request(request(f"r{i}", task="sql"), now=0.0)
    assert list(admitted(plain.schedule(0.0)).values()) == list(admitted(tasked.schedule(0.0)).values())
    assert tasked.router.task_nodes.holders("sql") is None and tasked.router.task_unroutable("sql") == ""


def test_a_tasks_requests_go_only_through_the_nodes_holding_it() -> None:
    core = joined_core(demo_router(BIG))
    core.router.task_nodes.assign("sql", {"cpu-1", "cpu-2"})
    for i in range(6):
        core.add_request(request(f"t{i}", task="sql"), now=0.0)
        core.add_request(request(f"b{i}"), now=0.0)
    routes = admitted(core.schedule(0.0))
    assert {routes[f"t{i}.1"] for i in range(6)} == {("cpu-1", "cpu-2")}
    assert ("cpu-0",) in {routes[f"b{i}.1"] for i in range(6)}  # the base is routed through every node
    assert core.router.in_flight("sql", "cpu-1") == 6 and core.router.in_flight("sql", "cpu-0") == 0

    core.router.task_nodes.move("sql", "cpu-1", "cpu-0", core.router.topology.placement)  # now {cpu-0, cpu-2}
    core.add_request(request("after", task="sql"), now=0.1)
    assert admitted(core.schedule(0.1)) == {"after.1": ("cpu-0",)}
    core.update_from_output([tokens("cpu-2", "t0.1", 7, finished=True, reason="length")], now=0.2)
    core.schedule(0.2)
    assert core.router.in_flight("sql", "cpu-1") == 5  # the moved task's requests in flight finish where they are


def test_a_task_whose_holders_form_no_pipeline_is_a_503_naming_it() -> None:
    core = joined_core(demo_router(BIG))
    core.router.task_nodes.assign("sql", {"cpu-1"})
    with pytest.raises(NoRouteError, match=r"task 'sql' has no route: it is held by cpu-1; no live node holding "
                                           r"it holds layers \[16, 30\)") as exc:  # fmt: skip
        core.add_request(request("t", task="sql"), now=0.0)
    assert exc.value.http_status == 503 and "t" not in core.requests
    core.add_request(request("b"), now=0.0)  # the base model and other tasks are served
    core.add_request(request("o", task="other"), now=0.0)
    assert set(admitted(core.schedule(0.0))) == {"b.1", "o.1"}


def test_when_a_tasks_holders_die_its_requests_fail_naming_it_and_are_never_served_by_the_base() -> None:
    core = joined_core(demo_router(30 * 20))  # one request of 10 + 10 tokens fills a node's KV
    core.router.task_nodes.assign("sql", {"cpu-0"})
    core.add_request(request("running", task="sql"), now=0.0)
    core.add_request(request("waiting", task="sql"), now=0.0)  # cpu-0's KV is full: it waits
    core.add_request(request("base"), now=0.0)
    routes = admitted(core.schedule(0.0))
    assert routes == {"running.1": ("cpu-0",), "base.1": ("cpu-1", "cpu-2")}
    assert core.requests["waiting"].status is RequestStatus.WAITING

    core.update_from_output([AgentDied("cpu-0")], now=0.1)
    out = core.schedule(0.1)
    errors = {o.request_id: o.error for o in out.outputs if o.error is not None}
    assert set(errors) == {"running", "waiting"} and not admitted(out)  # cpu-1 -> cpu-2 lacks the PET
    assert all(isinstance(e, NoRouteError) and "task 'sql' has no route" in e.message and "down: cpu-0" in e.message
               for e in errors.values())  # fmt: skip
    assert core.ready and not core.waiting


def test_spread_puts_each_task_on_one_node_of_each_group_holding_the_same_layers() -> None:
    layers = {"cpu-0": (16, 30), "cpu-1": (0, 16), "cpu-2": (0, 16)}
    assert replica_groups(layers) == [["cpu-1", "cpu-2"], ["cpu-0"]]
    placement = TaskPlacement()
    assert placement.initial(PlacementPolicy.ALL, layers) is None
    for name in ("a", "b", "c"):
        placement.assign(name, placement.initial(PlacementPolicy.SPREAD, layers))
    assert [sorted(placement.holders(n) or ()) for n in "abc"] == [["cpu-0", "cpu-1"], ["cpu-0", "cpu-2"],
                                                                   ["cpu-0", "cpu-1"]]  # fmt: skip
    placement.forget("a")
    assert placement.holds("a", "cpu-2") and not placement.holds("b", "cpu-1") and placement.holds("", "cpu-1")


def test_the_routable_placement_leaves_out_dead_and_draining_nodes() -> None:
    router = demo_router(BIG)
    assert router.routable_placement() == {"cpu-0": (0, 30), "cpu-1": (0, 16), "cpu-2": (16, 30)}
    router.mark_dead("cpu-1")
    router.draining.add("cpu-0")
    assert router.routable_placement() == {"cpu-2": (16, 30)}
