"""The coordinator as the HTTP server sees it: the core (:mod:`router.core`) bridged to asyncio.

The request lifecycle (admission, routing, stepping, stop conditions, failover) is the core's; this
module only connects it to the server:

* :meth:`Coordinator.admit` builds the core's :class:`~router.request.Request` for a validated
  :class:`~router.request.GenerationRequest` and adds it through the :class:`~router.driver.CoreDriver`.
  The core raises at once what can be decided at once (no route: 503, too large: 400, queue full:
  429); a queued request is awaited until the core starts it or gives up on it (the admission
  deadline: 429 with Retry-After).
* The core's outputs arrive on whichever thread stepped it (mostly the transport's I/O thread) and
  are handed to this loop in one call per batch, then to each request's queue, which its
  :class:`RequestHandle` reads: text deltas, then one :class:`~router.request.Finish`, or the error.
* Agents joining go through this loop first, so their fine-tuned tasks are loaded
  (:class:`router.tasks.TaskRegistry`) before any request is routed through them; deaths go straight
  to the core (fast failover) and to the task registry here.
* With live membership (``membership``, :mod:`router.membership_driver`) the membership events
  (joins, deaths, departures, LEAVING, LAYERS) go to it on this loop too, after the core had them;
  it re-plans and :meth:`Coordinator.switch_plan` hands the core the new plan's router.
* With PET migration (``migrator``, :mod:`router.pet_migration`) the loop's tick also runs the
  balancer, which moves tasks' PETs between nodes holding the same layers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from helix import wire
from helix.domain import Pipeline
from helix.errors import HelixError, NoRouteError
from helix.wire import TaskStatus
from router.agent_events import AgentDied, AgentEvent, AgentJoined, AgentLeft
from router.agents_io import AgentsIO
from router.core import CoordinatorCore
from router.driver import CoreDriver
from router.membership_driver import MembershipDriver
from router.metrics import MetricsObserver, ServingMetrics
from router.pet_migration import PetMigrator
from router.policy import Router
from router.request import Finish, GenerationRequest, Request, RequestOutput, RequestStatus
from router.stops import StopMatcher
from router.task_placement import PlacementPolicy
from router.tasks import TaskRegistry
from router.tokenizer import ChatTokenizer, IncrementalDetokenizer

log = logging.getLogger(__name__)

STALL_TIMEOUT_S = 300.0  # a safety net for lost messages; long prefills on a busy CPU are slow
TICK_S = 0.25  # KV reports folded in, admission deadlines checked


@dataclass(slots=True)
class _Stream:
    """What the loop keeps per admitted request: its events for the handle, and its admission."""

    request: Request
    events: asyncio.Queue[str | Finish | HelixError]
    admitted: asyncio.Future[None]


class _LoopTasks:
    """The task registry as the core sees it: ``finished`` may come from the I/O thread, so it is
    posted to the loop (the registry's drain events belong to it)."""

    def __init__(self, registry: TaskRegistry, coordinator: Coordinator) -> None:
        self.registry, self.coordinator = registry, coordinator

    def servable(self, name: str) -> object | None:
        return self.registry.servable(name)

    def started(self, name: str) -> None:
        self.registry.started(name)

    def finished(self, name: str) -> None:
        self.coordinator.on_loop(self.registry.finished, name)


class Coordinator:
    """The core, its driver, the task registry and the metrics, bridged to one asyncio loop."""

    def __init__(self, router: Router, tokenizer: ChatTokenizer, *, model_names: list[str],
                 max_context_tokens: int, max_tokens_cap: int, planned_flows: Mapping[tuple[str, str], float],
                 queue_bound: int = 256, admission_timeout_s: float = 30.0, max_lora_rank: int = 0,
                 task_placement: PlacementPolicy = PlacementPolicy.ALL) -> None:
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.max_context_tokens = max_context_tokens
        self.max_tokens_cap = max_tokens_cap
        self.metrics = ServingMetrics(planned_flows, base_label=model_names[0])
        self.started_s = int(time.time())
        self.nodes = sorted(router.topology.placement)
        self.tasks = TaskRegistry(model_names, self.nodes, max_lora_rank=max_lora_rank, placement=router.task_nodes,
                                  policy=task_placement)
        self.tasks.layers = router.topology.placement
        self.core = CoordinatorCore(router, stop_token_ids=tokenizer.eos_token_ids, queue_bound=queue_bound,
                                    admission_timeout_s=admission_timeout_s, observer=MetricsObserver(self.metrics),
                                    tasks=_LoopTasks(self.tasks, self), default_task_label=model_names[0])
        self.driver = CoreDriver(self.core, self._on_outputs)
        self.io: AgentsIO | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._streams: dict[str, _Stream] = {}
        self.startup_tasks: list[tuple[str, str]] = []  # (name, directory): loaded once the agents are connected
        self.membership: MembershipDriver | None = None  # live membership (re-planning); None: a fixed plan
        self.migrator: PetMigrator | None = None  # PET migration between nodes of the same layers; None: tasks stay put

    @property
    def router(self) -> Router:
        return self.core.router

    # -- wiring ------------------------------------------------------------------------------

    def attach(self, io: AgentsIO, loop: asyncio.AbstractEventLoop) -> None:
        """Use ``io`` (created with ``on_event=coordinator.on_agent_event``) from ``loop``'s thread."""
        self.io, self.loop, self._loop_thread = io, loop, threading.get_ident()
        self.driver.attach(io)
        self.tasks.send, self.tasks.alive = io.send_task, io.alive_nodes

    def on_loop(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the loop (now, if this is the loop's thread)."""
        if threading.get_ident() == self._loop_thread or self.loop is None:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def on_agent_event(self, event: AgentEvent) -> None:  # the I/O thread
        if isinstance(event, AgentJoined):
            self.on_loop(self._agent_joined, event)
            return
        self.driver.on_event(event)
        if isinstance(event, AgentDied | AgentLeft):
            self.on_loop(self.tasks.on_agent_dead, event.node)
        if self.membership is not None and isinstance(event, AgentDied | AgentLeft | wire.Leaving | wire.Layers):
            self.on_loop(self.membership.on_event, event)

    def _agent_joined(self, event: AgentJoined) -> None:
        if event.welcome.layer_end > event.welcome.layer_start:  # a joining node gets its tasks with its layers
            self.tasks.on_agent_alive(event.node)  # sent before any request is routed through it
        self.driver.feed((event,))
        if self.membership is not None:
            self.membership.on_event(event)

    def switch_plan(self, router: Router, flows: Mapping[tuple[str, str], float]) -> None:
        """Route by a re-plan's ``router`` from now on (live membership)."""
        self.driver.switch(router)
        self.nodes = sorted(router.topology.placement)
        self.tasks.nodes = list(self.nodes)
        self.tasks.layers = router.topology.placement
        self.metrics.set_planned_flows(flows)

    def cluster_view(self) -> dict[str, object]:
        """``GET /v1/cluster``: the membership's versioned view, or the fixed plan's nodes."""
        if self.membership is not None:
            return self.membership.view()
        placement = self.router.topology.placement
        return {"version": 0, "plan": {"placement": {n: list(r) for n, r in placement.items()}},
                "members": [{"node": n, "state": "dead" if n in self.router.dead else "serving",
                             "layers": list(placement[n])} for n in self.nodes],
                "reconfiguration": None, "live_membership": False}  # fmt: skip

    def task_status_threadsafe(self, status: TaskStatus) -> None:
        self.on_loop(self.tasks.on_status, status)

    async def load_startup_tasks(self, timeout_s: float = 300.0) -> None:
        """Background task: once every agent is connected (or after ``timeout_s``), load the tasks listed at start."""
        deadline = time.monotonic() + timeout_s
        while self.io is not None and not set(self.nodes) <= self.io.alive_nodes() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await self.tasks.load_all(self.startup_tasks)

    async def watch_kv(self, interval_s: float = TICK_S) -> None:
        """Background task: fold the agents' KV reports into the core, expire waiting requests."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.driver.tick()
                if self.membership is not None:
                    self.membership.tick()
                if self.migrator is not None:
                    self.migrator.tick()
            except Exception:  # never let the watcher die
                log.exception("coordinator tick failed")

    @property
    def ready(self) -> bool:
        return self.core.ready

    def health_details(self) -> dict[str, object]:
        details: dict[str, object] = {"nodes": {n: n not in self.router.dead for n in self.nodes},
                                      "running": self.core.running, "waiting": len(self.core.waiting),
                                      "tasks": {t.name: str(t.state) for t in self.tasks.tasks.values()}}
        if self.membership is not None:
            details |= {"plan_version": self.membership.membership.version,
                        "unavailable": self.membership.membership.unavailable or None}
        if self.migrator is not None:
            details["pet_balance"] = self.migrator.describe()
        return details

    def refresh_metrics(self) -> None:
        kv = self.router.kv
        self.metrics.refresh(ready=self.ready, alive={n: n not in self.router.dead for n in self.nodes},
                             kv_usage={n: kv.usage(n) for n in kv.nodes},
                             reports=self.io.kv_reports() if self.io is not None else {},
                             waiting=len(self.core.waiting), running=self.core.running)
        if self.membership is not None:
            self.metrics.membership(self.membership.membership.version, self.membership.membership.counts())

    # -- requests ----------------------------------------------------------------------------

    async def admit(self, gen: GenerationRequest) -> RequestHandle:
        """Admit ``gen``; raises NoRouteError / OverloadedError / CapacityError / UnknownTaskError."""
        if self.io is None:
            raise NoRouteError("the coordinator is not connected to its agents yet")
        request = Request(uuid.uuid4().hex[:16], gen, arrival_s=time.monotonic(),
                          detok=IncrementalDetokenizer(self.tokenizer), stops=StopMatcher(gen.stop))
        stream = _Stream(request, asyncio.Queue(), asyncio.get_running_loop().create_future())
        self._streams[request.request_id] = stream
        try:
            self.driver.add(request)
        except BaseException:
            self._streams.pop(request.request_id, None)
            raise
        handle = RequestHandle(self, stream)
        if not stream.admitted.done():
            try:
                await stream.admitted
            except asyncio.CancelledError:
                handle.cancel("client gone while waiting")
                raise
        return handle

    def _on_outputs(self, outputs: Sequence[RequestOutput]) -> None:  # any thread, the driver's lock held
        self.on_loop(self._deliver, outputs)

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            if out.text:
                stream.events.put_nowait(out.text)
            if out.finish is not None:
                stream.events.put_nowait(out.finish)
            if out.error is not None:
                if stream.admitted.done():
                    stream.events.put_nowait(out.error)
                else:
                    stream.admitted.set_exception(out.error)
            elif not stream.admitted.done():
                stream.admitted.set_result(None)
            if out.finished:
                del streams[out.request_id]

    def cancel(self, request_id: str, reason: str) -> None:
        """Client gone or request over: free everything it holds (idempotent)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.request.status.finished:
            log.debug("cancel %s: %s", request_id, reason)
            self.driver.abort(request_id)


class RequestHandle:
    """The HTTP layer's grip on one admitted request: its events, and cancellation."""

    __slots__ = ("_coordinator", "_stream")

    def __init__(self, coordinator: Coordinator, stream: _Stream) -> None:
        self._coordinator, self._stream = coordinator, stream

    @property
    def request_id(self) -> str:
        return self._stream.request.request_id

    @property
    def status(self) -> RequestStatus:
        return self._stream.request.status

    @property
    def pipelines(self) -> tuple[Pipeline, ...]:
        """The pipelines the request has run on so far (the last one is current)."""
        return tuple(self._stream.request.pipelines)

    def response_id(self, prefix: str) -> str:
        return f"{prefix}-{self.request_id}"

    async def events(self) -> AsyncIterator[str | Finish]:
        """Text deltas, then one :class:`Finish`; raises the HelixError that ended the request."""
        queue = self._stream.events
        while True:
            try:
                async with asyncio.timeout(STALL_TIMEOUT_S):  # no extra task per token, unlike wait_for
                    event = await queue.get()
            except TimeoutError:
                self.cancel("stalled")
                raise HelixError(f"request {self.request_id} produced no token for {STALL_TIMEOUT_S:.0f} s") from None
            if isinstance(event, HelixError):
                raise event
            yield event
            if isinstance(event, Finish):
                return

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the request (idempotent): cancel on every stage, release its KV."""
        self._coordinator.cancel(self.request_id, reason)
