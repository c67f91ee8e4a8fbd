"""Live membership in the server: :class:`router.membership.Membership` run on the coordinator's asyncio
loop, its actions carried out.

* In: the agents' membership events (joins, deaths, departures, LEAVING, LAYERS; the core has
  already applied them on the transport's I/O thread), a tick from the coordinator's watcher, and
  joins from ``POST /v1/cluster/join`` (:meth:`MembershipDriver.join`).
* Out: a re-plan runs ``planner.replan`` in the re-planner's worker process (a
  :class:`helix.processes.WorkerProcess`, started with the server by :meth:`MembershipDriver.start`
  and stopped by :meth:`MembershipDriver.close`: planning takes seconds of CPU, and out of this
  interpreter it does not take the GIL from token handling; a thread waits for its answer) over the
  cluster file's nodes less those gone plus those joined (:func:`router.replan_call.replan_membership`;
  the planner is never imported here). A worker that dies or does not answer within twice the planner's time limit plus
  :data:`REPLAN_SLACK_S` (it is killed) is a failed re-plan (:class:`ReplanFailed`: the old plan
  stays, the change is tried again later) and the next re-plan starts a fresh worker. SET_LAYERS and
  RELEASE_LAYERS go out through the transport, which also dials joining nodes and forgets departed
  ones; the task registry sends the tasks again for new layers; a switch builds the new plan's
  router (:meth:`router.policy.Router.from_plan`) and hands it to the core
  (:meth:`router.driver.CoreDriver.switch`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Protocol

from helix.errors import HelixError, InfeasiblePlanError, RequestError
from helix.plan import Plan
from helix.processes import WorkerFailed, WorkerProcess
from helix.profile import ProfileSet
from helix.spec import ClusterSpec, NodeSpec
from router.agents_io import AgentsIO
from router.driver import CoreDriver
from router.membership import Membership
from router.membership_types import (
    Action,
    Dial,
    Forget,
    MembershipEvent,
    MembershipPolicy,
    ReloadTasks,
    ReplanFailed,
    Replanned,
    Send,
    StartReplan,
    SwitchPlan,
    TasksReloaded,
    Unavailable,
)
from router.policy import Router, plan_flows
from router.replan_call import ReplanResult, replan_membership
from router.tasks import TaskRegistry

log = logging.getLogger(__name__)

REPLAN_SLACK_S = 30.0  # beyond twice the planner's limit: the worker's start (imports) on a busy machine


class Serving(Protocol):
    """What the driver needs of the coordinator (:class:`router.coordinator.Coordinator`)."""

    driver: CoreDriver
    tasks: TaskRegistry
    io: AgentsIO | None
    loop: asyncio.AbstractEventLoop | None

    def switch_plan(self, router: Router, flows: Mapping[tuple[str, str], float]) -> None: ...


class MembershipDriver:
    """Runs the membership owner for ``serving`` (see the module doc); every method runs on the loop."""

    def __init__(self, serving: Serving, cluster: ClusterSpec, plan: Plan, profiles: ProfileSet,
                 policy: MembershipPolicy, *, num_layers: int, watermark: float,
                 replan: Callable[..., object] | None = None) -> None:  # fmt: skip
        """``replan``: the re-planner the worker runs, ``replan(cluster, profiles, plan, options) -> Replan``,
        importable by name (default ``planner.replan.replan``; tests give others)."""
        self.serving = serving
        self.cluster = cluster  # the cluster file's: a re-plan's membership is these nodes less the gone plus the joined
        self.profiles, self.num_layers, self.watermark = profiles, num_layers, watermark
        self.membership = Membership(cluster, plan, policy, now=time.monotonic())
        self._clusters: dict[int, ClusterSpec] = {}  # version -> the membership its re-plan was made for
        self._background: set[asyncio.Future[None]] = set()
        self._replan = replan
        self.worker = WorkerProcess("re-planner", preload=("router.replan_call", "planner.replan"))

    def start(self) -> None:
        """Start the re-planner's worker (it imports the planner now rather than at the first re-plan)."""
        self.worker.start()

    def close(self) -> None:
        """Stop the re-planner's worker (a re-plan in flight fails); the server is shutting down."""
        self.worker.close()

    # -- inputs (the loop) -------------------------------------------------------------------------

    def on_event(self, event: MembershipEvent) -> None:
        self._run(self.membership.update((event,), time.monotonic()))

    def tick(self) -> None:
        self._run(self.membership.tick(time.monotonic()))

    def join(self, node_id: str, gpu: str, control_address: str, region: str | None = None) -> None:
        """A node's agent (holding no layers) asks to join: check it, dial it; it is planned with once
        its handshake completes. RequestError when the ask cannot be taken."""
        io = self.serving.io
        if io is not None and io.curve is not None:
            raise RequestError("nodes join only a cluster without CURVE keys (its agents' keys are fixed at start)",
                               param="node_id")  # fmt: skip
        if node_id == self.cluster.coordinator.id:
            raise RequestError(f"{node_id!r} is the coordinator's id", param="node_id")
        if gpu not in self.profiles.gpus:
            raise RequestError(f"GPU type {gpu!r} has no profile here (known: {', '.join(sorted(self.profiles.gpus))})",
                               param="gpu")  # fmt: skip
        try:
            spec = NodeSpec(id=node_id, gpu=gpu, region=region or self.cluster.coordinator.region,
                            address=control_address)  # fmt: skip
            self._run(self.membership.join(spec, time.monotonic()))
        except (ValueError, HelixError) as exc:  # a pydantic ValidationError is a ValueError
            raise RequestError(f"node {node_id!r} cannot join: {getattr(exc, 'message', exc)}",
                               param="node_id") from None  # fmt: skip

    def view(self) -> dict[str, object]:
        return self.membership.view(time.monotonic())

    # -- actions -----------------------------------------------------------------------------------

    def _run(self, actions: list[Action]) -> None:
        for action in actions:
            try:
                self._do(action)
            except Exception:  # one failed action must not stop the others, nor the loop
                log.exception("membership action %s failed", type(action).__name__)

    def _do(self, action: Action) -> None:
        io = self.serving.io
        if isinstance(action, StartReplan):
            self._start_replan(action)
        elif isinstance(action, Send) and io is not None:
            io.send([(action.node, action.message)])
        elif isinstance(action, ReloadTasks):
            self._later(self._reload_tasks(action))
        elif isinstance(action, SwitchPlan):
            self._switch(action)
        elif isinstance(action, Dial) and io is not None:
            io.add_agent(action.node, action.address)
        elif isinstance(action, Forget) and io is not None:
            io.remove_agent(action.node)
        elif isinstance(action, Unavailable):
            self.serving.driver.set_unavailable(action.reason)

    def _start_replan(self, action: StartReplan) -> None:
        limit_s = self.membership.policy.replan_time_limit_s
        call = functools.partial(self.worker.call, replan_membership, self.cluster, action.nodes, self.profiles,
                                 action.plan, limit_s, self._replan, timeout_s=2 * limit_s + REPLAN_SLACK_S)  # fmt: skip
        future = asyncio.get_running_loop().run_in_executor(None, call)
        future.add_done_callback(functools.partial(self._replanned, action.version))

    def _replanned(self, version: int, future: asyncio.Future[ReplanResult]) -> None:
        event: MembershipEvent
        try:
            result = future.result()
        except InfeasiblePlanError as exc:
            event = ReplanFailed(version, exc.message, infeasible=True)
        except WorkerFailed as exc:
            log.error("re-plan v%d failed: %s", version, exc.message)
            event = ReplanFailed(version, exc.message, infeasible=False)
        except HelixError as exc:
            event = ReplanFailed(version, exc.message, infeasible=False)
        except Exception as exc:  # a planner bug: keep serving on the old plan
            log.exception("re-plan v%d failed", version)
            event = ReplanFailed(version, f"{type(exc).__name__}: {exc}", infeasible=False)
        else:
            log.info("re-plan v%d: %s, %d layers to load (%s)", version, result.decision, result.layers_moved,
                     dict(result.plan.placement))  # fmt: skip
            self._clusters[version] = result.cluster
            event = Replanned(version, result.plan)
        self.on_event(event)

    async def _reload_tasks(self, action: ReloadTasks) -> None:
        error = await self.serving.tasks.reload(action.nodes)
        self.on_event(TasksReloaded(action.version, error))

    def _switch(self, action: SwitchPlan) -> None:
        cluster = self._clusters.pop(action.version)
        for old in [v for v in self._clusters if v < action.version]:
            del self._clusters[old]
        router = Router.from_plan(action.plan, cluster, self.profiles, num_layers=self.num_layers,
                                  watermark=self.watermark)  # fmt: skip
        self.serving.switch_plan(router, plan_flows(action.plan, cluster, self.profiles))
        log.info("routing by plan v%d: %s", action.version, dict(action.plan.placement))

    def _later(self, work: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
