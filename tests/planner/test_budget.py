"""The planning time budget: one deadline reaches every phase, and the search says why it stopped.

The deadline logic is tested on a fake clock (no timing asserts); the phases themselves run
for real (HiGHS, networkx), with a spy counting the solver calls they make.
"""

from __future__ import annotations

import pytest

from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner import bounds, stages
from planner.api import baseline_placements
from planner.budget import (
    MIN_SOLVER_S,
    STALLED,
    TIME_LIMIT,
    Deadline,
    StallWatch,
    describe_stop,
    stall_window_s,
)
from planner.capacity import CapacityModel
from planner.flows import balance
from planner.graph import check_flows
from planner.local_search import Evaluator, improve
from planner.optimize import optimize
from planner.options import PlannerOptions
from planner.progress import Progress
from planner.solvers import Model

from .conftest import GEO, load, mixed64


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def solves(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The time limit of every HiGHS model the planner solves (a spy: the solves are real)."""
    seen: list[float] = []
    real = Model.solve

    def spy(self: Model, **kw: object) -> object:
        seen.append(float(kw.get("time_limit_s", 30.0)))  # type: ignore[arg-type]
        return real(self, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Model, "solve", spy)
    return seen


def test_child_deadlines_never_outlive_their_parent() -> None:
    clock = FakeClock()
    parent = Deadline.after(10.0, clock)
    assert parent.remaining() == 10.0 and not parent.expired()
    assert parent.within(100.0).at == parent.at  # capped by the parent
    half = parent.share(0.5)
    assert half.remaining() == 5.0
    assert parent.solver_limit(2.0) == 2.0 and parent.solver_limit() == 10.0
    clock.advance(6.0)
    assert half.expired() and half.remaining() == 0.0 and not parent.expired()
    assert half.solver_limit(10.0) == MIN_SOLVER_S  # never 0 (HiGHS rejects it); callers check expired() first
    child = parent.within(3.0)
    clock.advance(4.5)
    assert parent.expired() and child.expired()  # the parent's end reaches the child
    stopped = Deadline.after(10.0, clock).within(5.0, stop=lambda: True)
    assert stopped.expired() and stopped.remaining() == 0.0  # an early-stop test ends it at once


def test_stall_window_and_stop_texts() -> None:
    assert stall_window_s(60.0) == 15.0 and stall_window_s(4.0) == 3.0  # max(3 s, a quarter of the limit)
    assert stall_window_s(60.0, 2.0) == 2.0 and stall_window_s(60.0, 0.0) is None
    clock = FakeClock()
    watch = StallWatch(clock, 2.0)
    clock.advance(1.5)
    watch.improved()
    clock.advance(1.9)
    assert not watch.stalled()
    clock.advance(0.2)
    assert watch.stalled()
    assert "no improvement for 2 s" in describe_stop(STALLED, 2.0)
    assert "time limit" in describe_stop(TIME_LIMIT)


def test_local_search_stops_at_its_deadline(single24: tuple[ClusterSpec, ProfileSet]) -> None:
    cluster, profiles = single24
    cap = CapacityModel.build(cluster, profiles)
    start = baseline_placements(cluster, profiles)["petals"]
    clock = FakeClock()
    ev = Evaluator(cap, "max-flow")
    improve(ev, start, deadline=Deadline.after(0.0, clock))
    assert ev.evaluations == 1  # the start only: no move is tried after the deadline

    class Ticking(FakeClock):
        def __call__(self) -> float:  # every look at the clock costs 1 ms
            self.t += 0.001
            return self.t

    ticking = Ticking()
    ev = Evaluator(cap, "max-flow")
    improve(ev, start, deadline=Deadline.after(0.5, ticking))
    assert 1 < ev.evaluations <= 500  # it ran, and stopped when the (fake) half second was up


def test_construction_and_bound_start_no_solve_after_the_deadline(
    single24: tuple[ClusterSpec, ProfileSet], solves: list[float]
) -> None:
    cap = CapacityModel.build(*single24)
    clock = FakeClock()
    gone = Deadline.after(0.0, clock)
    assert stages.best_stage_plan(cap, lo=0.0, hi=3000.0, deadline=gone) is None
    got = bounds.upper_bound(cap, achieved=1000.0, deadline=gone)
    assert got.tok_s == bounds.cheap_bound(cap).tok_s  # only what is proven without a solver
    assert solves == []
    # with time left, every solve gets at most what is left (the fake clock does not move)
    soon = Deadline.after(0.25, clock)
    stages.best_stage_plan(cap, lo=0.0, hi=3000.0, deadline=soon)
    bounds.upper_bound(cap, achieved=1000.0, deadline=soon)
    assert solves and max(solves) <= 0.25


def test_optimize_ends_every_phase_when_its_deadline_passes(solves: list[float]) -> None:
    """The clock jumps past the deadline at the first incumbent: no phase may start after it."""
    cluster, profiles = load(GEO)
    clock = FakeClock()
    reports: list[Progress] = []
    after_jump: list[int] = []

    def on_progress(p: Progress) -> None:
        reports.append(p)
        if p.incumbent_tok_s is not None and not after_jump:
            clock.advance(3600.0)
            after_jump.append(len(solves))

    warm = list(baseline_placements(cluster, profiles).values())
    res = optimize(cluster, profiles, PlannerOptions(objective="serving"), warm_start=warm, on_progress=on_progress,
                   deadline=Deadline.after(60.0, clock))
    assert reports[0].incumbent_tok_s is None and reports[0].message == "construction"
    first = next(p for p in reports if p.incumbent_tok_s is not None)
    assert first.message.startswith("warm start")  # an incumbent before any stage MILP or bound
    assert after_jump and len(solves) == after_jump[0]  # not one solve after the deadline
    assert [p.message for p in reports[reports.index(first) + 1:]] == ["bound", "done (time_limit)"]
    assert res.stop_reason == TIME_LIMIT and res.stats["stop_reason"] == TIME_LIMIT
    assert set(res.placement) <= set(cluster.node_ids) and res.max_flow_tok_s > 0
    assert res.flows  # the max flow's edges, even when there was no time left to balance them


def test_balanced_flows_finish_on_a_large_cluster(tmp_path) -> None:
    """The balancing QP (run for every serving evaluation) once cycled to its 20 s limit here."""
    cluster, profiles = load(mixed64(tmp_path))
    cap = CapacityModel.build(cluster, profiles)
    for name, placement in baseline_placements(cluster, profiles, cap).items():
        got = balance(cap, placement, deadline=Deadline.after(60.0))
        assert got is not None, name
        check_flows(cap, placement, got[1])
