"""The re-planner out of the coordinator's interpreter (:mod:`router.membership_driver` running
``planner.replan`` in a :class:`helix.processes.WorkerProcess`), with the real planner on the demo
cluster and no agents: a re-plan runs in the driver's worker process, not the coordinator's, and
comes back as the membership's new plan; a worker that dies or does not answer mid-plan is a failed
re-plan (the old plan stays, ``last_error`` says why) and the next re-plan starts a fresh worker;
closing the driver leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import psutil
import pytest

from helix.plan import Plan
from helix.profile import load_profiles_for
from helix.spec import load_cluster
from router import membership_driver
from router.agent_events import AgentDied, AgentJoined
from router.membership_driver import MembershipDriver
from router.membership_types import MembershipPolicy, Phase
from tests.factories import DEMO_PLACEMENT, REPO, welcome
from tests.router.replan_stubs import crash, hang, replan_noting_pid

POLICY = MembershipPolicy(grace_s=0.0, min_interval_s=0.0, retry_s=0.2, replan_time_limit_s=1.0)


@pytest.fixture(autouse=True)
def _importable_stubs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker imports the stubs by name: it gets our sys.path, so the repository's root goes on it."""
    monkeypatch.syspath_prepend(str(REPO))


class _Serving:
    """The coordinator as the driver sees it, minus the agents."""

    def __init__(self) -> None:
        self.driver, self.tasks, self.io, self.loop = self, None, None, None
        self.routers: list[Any] = []

    def set_unavailable(self, reason: str) -> None:
        pass

    def switch_plan(self, router: Any, flows: Any) -> None:
        self.routers.append(router)


def _driver(replan: Any) -> MembershipDriver:
    cluster = load_cluster(REPO / "clusters" / "demo" / "cluster.yaml")
    plan = Plan(cluster="demo", model="smollm2-135m", method="manual", placement=dict(DEMO_PLACEMENT),
                max_flow_tok_s=1.0)  # fmt: skip
    driver = MembershipDriver(_Serving(), cluster, plan, load_profiles_for(cluster), POLICY,  # type: ignore[arg-type]
                              num_layers=30, watermark=0.85, replan=replan)  # fmt: skip
    for node, layers in DEMO_PLACEMENT.items():
        driver.on_event(AgentJoined(node, welcome(node, layers)))
    return driver


async def _planned(driver: MembershipDriver, timeout_s: float = 120.0) -> None:
    """Until the re-plan in flight has answered (its reconfiguration left the planning phase)."""
    deadline = time.monotonic() + timeout_s
    while (r := driver.membership.reconfig) is not None and r.phase is Phase.PLANNING:
        assert time.monotonic() < deadline, "the re-plan never answered"
        await asyncio.sleep(0.05)


def _new_plan(driver: MembershipDriver) -> Plan:
    r = driver.membership.reconfig
    return r.plan if r is not None and r.plan is not None else driver.membership.plan


def test_a_replan_runs_in_the_worker_process_and_close_leaves_none() -> None:
    async def run() -> tuple[int | None, Plan, MembershipDriver]:
        driver = _driver(replan_noting_pid)
        driver.start()
        pid = driver.worker.pid
        driver.on_event(AgentDied("cpu-0"))  # no grace: re-planned at once
        await _planned(driver)
        return pid, _new_plan(driver), driver

    pid, plan, driver = asyncio.run(run())
    try:
        assert pid is not None and plan.stats["worker_pid"] == pid != os.getpid()
        assert sorted(plan.placement) == ["cpu-1", "cpu-2"] and driver.membership.last_error == ""
    finally:
        driver.close()
    assert driver.worker.pid is None and not psutil.pid_exists(pid)


@pytest.mark.parametrize("failing", [crash, hang], ids=["dies", "hangs"])
def test_a_worker_that_dies_or_hangs_is_a_failed_replan_and_the_next_starts_afresh(
        failing: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(membership_driver, "REPLAN_SLACK_S", 1.0)  # a hang is noticed after 2 x 1 s + 1 s

    async def run() -> tuple[str, int | None, Plan, MembershipDriver]:
        driver = _driver(failing)
        driver.start()
        dead = driver.worker.call(os.getpid, timeout_s=120)  # started: the deadline below is the call's alone
        driver.on_event(AgentDied("cpu-0"))
        await _planned(driver)
        assert driver.membership.reconfig is None and driver.membership.version == 0  # the old plan stays
        error = driver.membership.last_error
        driver._replan = replan_noting_pid
        monkeypatch.setattr(membership_driver, "REPLAN_SLACK_S", 60.0)  # the fresh worker's start may be slow
        await asyncio.sleep(POLICY.retry_s)
        driver.tick()  # planned again
        await _planned(driver)
        return error, dead, _new_plan(driver), driver

    error, dead, plan, driver = asyncio.run(run())
    try:
        expected = "died during a call (exit code 7)" if failing is crash else "did not answer within 3 s; it was killed"
        assert f"the re-planner worker (pid {dead}) " in error and expected in error, error
        assert dead is not None and not psutil.pid_exists(dead) and driver.worker.pid != dead  # reaped; a fresh one
        assert "plan v2 made" in str(driver.membership.history), driver.membership.history
        assert sorted(plan.placement) == ["cpu-1", "cpu-2"] and plan.stats["worker_pid"] == driver.worker.pid
    finally:
        driver.close()
