"""The coordinator core: every request's whole life, as a pure step-driven state machine.

It owns admission (a bounded FIFO queue with a deadline), routing (:class:`router.policy.Router`:
IWRR over the plan's flows; dead, KV-full and task-less nodes masked), request and attempt ids, the decision
to send each next step, stop conditions and finish reasons, and failover (a request whose
pipeline broke is re-prefilled on a new one from its prompt and the tokens generated so far).
No sockets, threads, clocks or asyncio: the caller passes ``now`` and carries the messages.

The contract is vLLM V1's engine core::

    core.add_request(request, now)          # raises NoRouteError / CapacityError / OverloadedError ...
    core.abort_request(request_id)          # the client went away
    core.update_from_output(events, now)    # tokens, refusals, agents joining and dying, KV reports
    out = core.schedule(now)                # out.messages: (node, wire message) to send, in order
                                            # out.outputs: RequestOutput per request (started, tokens,
                                            # text, finish or error)

What it reports for metrics, asks about fine-tuned tasks and hands back are its interfaces
(:mod:`router.core_interfaces`).

The server (:mod:`router.driver`) calls it from the transport's I/O thread as tokens arrive, so
the next STEP leaves without a hop through the event loop, and from the HTTP loop as requests
come and go; the simulator (:mod:`simulator.engine`) drives the same object in simulated time.

A token ends its request when it is a stop token, completes a stop string, reaches
``max_tokens``, or the last stage says the request finished; otherwise the core sends the next
STEP to the pipeline's first stage. A one-stage pipeline feeds itself on the agent, unless the
request has stop strings: then it is *paced* (``SamplingSpec.paced``) and waits for the STEP too,
so no step runs after a stop string either. Nothing is sent after a request ends: its stages get
CANCEL (to free KV), the last stage's too unless it finished the request itself.

Live membership: an agent that says LEAVING (or refuses ``leaving``) is masked at once
(``Router.draining``); an agent is routed through once it holds the plan's layers (its WELCOME and
LAYERS, :mod:`router.holdings`); :meth:`CoordinatorCore.set_router` switches to a re-plan's router.
With ``wait_for_replan`` (re-planning on), a request left with no route waits for that switch
within the admission timeout, until :meth:`CoordinatorCore.set_unavailable` says it will not come.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection, Iterable

from helix import wire
from helix.domain import ErrorCode, FinishReason, Pipeline, token_finish
from helix.errors import (
    CapacityError,
    HelixError,
    NoRouteError,
    OverloadedError,
    RequestError,
    UnknownTaskError,
)
from router.agent_events import AgentDied, AgentEvent, AgentJoined, AgentLeft, KVReported, Unreachable
from router.core_interfaces import CoreObserver, CoreOutput, QuietObserver, TaskGate
from router.holdings import AgentHoldings
from router.policy import Router, RouteRequest
from router.request import Finish, Request, RequestOutput, RequestStatus
from router.task_placement import replica_groups
from router.waiting import start_waiting

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8  # pipelines one request may be given (failovers) before it fails


class CoordinatorCore:
    """Admission, routing, stepping, stopping and failover of every request (see the module doc)."""

    def __init__(self, router: Router, *, stop_token_ids: Collection[int] = (), reply_to: str = "",
                 queue_bound: int = 256, admission_timeout_s: float = 30.0, max_attempts: int = MAX_ATTEMPTS,
                 observer: CoreObserver | None = None, tasks: TaskGate | None = None,
                 default_task_label: str = "") -> None:  # fmt: skip
        self.router = router
        self.stop_token_ids = frozenset(stop_token_ids)
        self.reply_to = reply_to  # where last stages send tokens (the transport's sink)
        self.queue_bound = queue_bound
        self.admission_timeout_s = admission_timeout_s
        self.max_attempts = max_attempts
        self.observer: CoreObserver = observer if observer is not None else QuietObserver()
        self.tasks = tasks
        self.default_task_label = default_task_label
        self.coordinator_id = router.topology.coordinator
        self.agents = AgentHoldings()  # connected agents: data addresses, layers held, KV capacity
        self.unavailable = ""  # why the cluster cannot serve the model (live membership's verdict), for 503s
        # live re-planning is on: with no route left, requests wait for the re-plan (within the admission
        # timeout) instead of failing, until the membership says the model cannot be served (set_unavailable)
        self.wait_for_replan = False
        self.now = 0.0  # the clock of the last event or schedule
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self._by_wire: dict[str, Request] = {}  # running attempts
        self._edges: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {}
        self._out = CoreOutput()
        self._next_expiry = float("inf")
        for node in router.topology.placement:  # no node is usable before its agent joins (AgentJoined)
            router.mark_dead(node)
        self.ready = False

    # -- the contract ----------------------------------------------------------------------------

    def add_request(self, request: Request, now: float) -> None:
        """Admit ``request``: start it now, or queue it. Raises (and keeps nothing) when it cannot be served."""
        params = request.params
        pinned = request.pinned is not None
        if not params.prompt_ids:
            raise RequestError(f"request {request.request_id!r}: the prompt has no tokens", param="prompt")
        if params.max_tokens < 1:
            raise RequestError(f"request {request.request_id!r}: max_tokens must be >= 1, got {params.max_tokens}",
                               param="max_tokens")  # fmt: skip
        if not self.ready and not pinned and not self._waits_for_replan():
            self.observer.rejected("no_route")
            raise NoRouteError(f"no complete pipeline is available ({self._why_down()})")
        if request.request_id in self.requests:
            raise RequestError(f"request {request.request_id!r} is already in flight", param="request_id")
        if not pinned and self.ready and (task_down := self.router.task_unroutable(params.task)):
            self.observer.rejected("no_route")
            raise NoRouteError(task_down)
        if params.task and self.tasks is not None:
            if self.tasks.servable(params.task) is None:
                raise UnknownTaskError(f"the model '{params.task}' does not exist here (no such task is loaded)",
                                       task=params.task)  # fmt: skip
            self.tasks.started(params.task)
            request.holds_task = True
        self.observer.admitted(params.task or self.default_task_label, request.prompt_tokens)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if (pinned or not self.waiting) and self._try_start(request):
            return
        reject: HelixError | None = None
        if pinned:
            reject = NoRouteError(f"the pinned pipeline {request.pinned.describe()} is not connected")  # type: ignore[union-attr]
        elif self.ready and not self.router.can_ever_fit(request.prompt_tokens + params.max_tokens):
            self.observer.rejected("too_large")
            reject = CapacityError(f"a request of {request.prompt_tokens} prompt + {params.max_tokens} output tokens "
                                   "does not fit in the KV cache of any pipeline; shorten the prompt or lower max_tokens")
        elif len(self.waiting) >= self.queue_bound:
            self.observer.rejected("queue_full")
            reject = OverloadedError(f"the server is at capacity ({len(self._by_wire)} running, {len(self.waiting)} "
                                     "waiting); retry later", retry_after_s=self._retry_after_s())
        if reject is not None:
            self._end(request, RequestStatus.FINISHED_ERROR)
            raise reject
        self._wait(request, now)

    def queues_by_node(self) -> dict[str, float]:
        """Each node's queue now, PetS's ``L``: the requests in flight on it (queued there or
        running), plus every request waiting here for a route, shared among the live nodes of each replica
        group that could take it (its task's holders; the whole group for a task nobody restricted)."""
        router = self.router
        out: dict[str, float] = dict(router.kv.requests_by_node())
        groups = replica_groups(router.routable_placement())
        for request in self.waiting:
            if request.status.finished:
                continue
            holders = router.task_nodes.holders(request.params.task)
            for group in groups:
                takers = group if holders is None else [n for n in group if n in holders]
                for node in takers:
                    out[node] = out.get(node, 0.0) + 1 / len(takers)
        return out

    def _wait(self, request: Request, now: float, *, first: bool = False) -> None:
        """Queue ``request`` until a route frees up, for at most the admission timeout."""
        request.status, request.deadline_s = RequestStatus.WAITING, now + self.admission_timeout_s
        self._next_expiry = min(self._next_expiry, request.deadline_s)
        if first:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        """The client went away: free everything the request holds (no output follows). Idempotent."""
        request = self.requests.get(request_id)
        if request is not None:
            if request.status is RequestStatus.WAITING:
                self.waiting.remove(request)
            self._end(request, RequestStatus.FINISHED_ABORTED)

    def update_from_output(self, events: Iterable[AgentEvent], now: float) -> None:
        """Apply what the cluster reported."""
        self.now = now
        for event in events:
            if isinstance(event, wire.Tokens):
                for out in event.tokens:
                    request = self._by_wire.get(out.request_id)
                    if request is not None:  # else: a late token of a finished or abandoned attempt
                        self._on_token(request, out, event.node_id, now)
            elif isinstance(event, wire.Refused):
                if event.code == ErrorCode.LEAVING:  # before its LEAVING, maybe: route around it now
                    self._on_leaving(event.node_id)
                request = self._by_wire.get(event.request_id)
                if request is not None:
                    code = ErrorCode(event.code) if event.code in _CODES else None  # decoded: always a code
                    self._on_attempt_error(request, code, f"node {event.node_id}: {event.reason}", event.node_id,
                                           str(event.code))  # fmt: skip
            elif isinstance(event, Unreachable):
                request = self._by_wire.get(event.wire_id)
                if request is not None:
                    self._on_attempt_error(request, ErrorCode.AGENT_DEAD, f"node {event.node!r} is not reachable",
                                           event.node, ErrorCode.AGENT_DEAD)  # fmt: skip
            elif isinstance(event, AgentDied | AgentLeft):
                self._on_agent_dead(event.node, "left" if isinstance(event, AgentLeft) else "is dead")
            elif isinstance(event, AgentJoined):
                self._on_agent_alive(event.node, event.welcome)
            elif isinstance(event, wire.Leaving):
                self._on_leaving(event.node_id)
            elif isinstance(event, wire.Layers) and self.agents.reported(event):
                self._use(event.node_id)
            elif isinstance(event, KVReported):
                self.router.report_kv(event.node, used=event.used, reserved=event.reserved, capacity=event.capacity)

    def schedule(self, now: float) -> CoreOutput:
        """Expire requests that waited too long, start waiting ones while routes are free, and hand over
        the messages to send and the outputs produced since the last call."""
        self.now = now
        if now >= self._next_expiry:
            self._expire(now)
        self._start_waiting()
        out, self._out = self._out, CoreOutput()
        return out

    # -- queries ---------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._by_wire)

    def set_unavailable(self, reason: str) -> None:
        """Live membership's verdict: why the model cannot be served ("" once it can). With a reason and no
        route, the requests waiting for a re-plan fail with it."""
        self.unavailable = reason
        if reason and not self.ready:
            self._fail_waiting()

    def _waits_for_replan(self) -> bool:
        return self.wait_for_replan and not self.unavailable

    def _fail_waiting(self) -> None:
        while self.waiting:
            self._fail(self.waiting.popleft(), NoRouteError(f"no complete pipeline is left ({self._why_down()})"))

    def _why_down(self) -> str:
        why = self.router.describe_down()
        return f"{why}; {self.unavailable}" if self.unavailable else why

    def _retry_after_s(self) -> float:
        return max(1.0, min(30.0, 0.5 * (1 + len(self.waiting))))

    # -- starting attempts -----------------------------------------------------------------------

    def _try_start(self, request: Request) -> bool:
        """Route ``request``'s next attempt and send its ADMIT; False when every route is masked now."""
        prompt = request.params.prompt_ids + request.output_ids
        if request.pinned is not None:
            pipeline = request.pinned
            if any(s.node not in self.agents.addresses or s.node in self.router.dead for s in pipeline.stages):
                return False
        else:
            try:
                pipeline = self.router.route(RouteRequest(request.request_id, len(prompt), request.remaining_tokens,
                                                          request.params.task))
            except NoRouteError:
                return False
        request.attempt += 1
        request.wire_id = f"{request.request_id}.{request.attempt}"
        stages = tuple(wire.StageRef(s, self.agents.addresses.get(s.node, "")) for s in pipeline.stages)
        self._send(stages[0].stage.node, wire.Admit(request.wire_id, tuple(prompt), request.remaining_tokens,
                                                 request.sampling_spec(self.stop_token_ids), stages, self.reply_to, request.params.task))
        request.pipeline, request.attempt_tokens, request.status = pipeline, 0, RequestStatus.RUNNING
        request.pipelines.append(pipeline)
        self._by_wire[request.wire_id] = request
        if request.attempt == 1:
            self._out.outputs.append(RequestOutput(request.request_id, started=True))
        return True

    def _expire(self, now: float) -> None:
        expired = [r for r in self.waiting if r.deadline_s <= now]
        for request in expired:
            self.waiting.remove(request)
            self.observer.rejected("timeout")
            self._fail(request, OverloadedError(f"no route freed up within {self.admission_timeout_s:.0f} s; "
                                                "retry later", retry_after_s=self._retry_after_s()))  # fmt: skip
        self._next_expiry = min((r.deadline_s for r in self.waiting), default=float("inf"))

    def _start_waiting(self) -> None:
        """Start waiting requests in FIFO order while routes are free (:func:`router.waiting.start_waiting`)."""
        start_waiting(self.waiting, self._try_start, lambda task: self.router.task_nodes.holders(task) is not None)

    # -- per token -------------------------------------------------------------------------------

    def _on_token(self, request: Request, out: wire.TokenOut, node: str, now: float) -> None:
        assert request.pipeline is not None
        moved = 1 if request.attempt_tokens else len(request.params.prompt_ids) + len(request.output_ids)
        self.observer.token(request, self._pipeline_edges(request.pipeline), moved, now)
        request.last_token_s = now
        request.attempt_tokens += 1
        token = out.token_id
        request.output_ids.append(token)
        reason = token_finish(token, len(request.output_ids), request.params.max_tokens, self.stop_token_ids)
        text = "" if token in self.stop_token_ids else request.stops.feed(request.detok.push(token))
        if reason is None and request.stops.stopped:
            reason = FinishReason.STOP
        elif reason is None and out.finished:  # the last stage's grammar completed
            reason = FinishReason.LENGTH if out.finish_reason == FinishReason.LENGTH else FinishReason.STOP
        if reason is None:
            if len(request.pipeline) > 1 or request.params.stop:  # else the one stage feeds itself (unpaced)
                self._send(request.pipeline.first.node, wire.Step(request.wire_id, out.step, token))
            self._out.outputs.append(RequestOutput(request.request_id, token_ids=(token,), text=text, node=node))
            return
        if not request.stops.stopped:
            text += request.stops.feed(request.detok.flush()) + request.stops.flush()
        self.observer.finished(request, now)
        finish = Finish(reason, request.prompt_tokens, len(request.output_ids), tuple(request.pipelines),
                        max(0, request.attempt - 1))  # fmt: skip
        self._end(request, RequestStatus.of(reason), last_stage_done=out.finished)
        self._out.outputs.append(RequestOutput(request.request_id, token_ids=(token,), text=text, finish=finish,
                                               node=node))

    def _pipeline_edges(self, pipeline: Pipeline) -> tuple[tuple[str, str], ...]:
        edges = self._edges.get(pipeline.nodes)
        if edges is None:  # a handful of distinct pipelines; every token asks
            hops = [self.coordinator_id, *pipeline.nodes, self.coordinator_id]
            edges = self._edges[pipeline.nodes] = tuple(zip(hops, hops[1:], strict=False))
        return edges

    # -- failures and failover -------------------------------------------------------------------

    def _on_attempt_error(self, request: Request, code: ErrorCode | None, reason: str, node: str | None,
                          raw_code: str) -> None:  # fmt: skip
        attempt = request.wire_id
        if code is ErrorCode.AGENT_DEAD and node is not None:
            self._on_agent_dead(node)  # moves every request on the node, this one included
            if request.wire_id != attempt or request.status.finished:
                return
        self._drop_attempt(request)
        if code is None or not code.retryable or request.pinned is not None:
            err = CapacityError(reason) if code is ErrorCode.CAPACITY else HelixError(
                f"the pipeline failed: {raw_code}: {reason}")
            self._fail(request, err, node=node, code=code)
            return
        self._reroute(request, f"{raw_code} at {node}")

    def _reroute(self, request: Request, why: str) -> None:
        self.observer.rerouted()
        log.info("re-routing request %s after %s (%d tokens so far)", request.request_id, why, len(request.output_ids))
        if request.attempt >= self.max_attempts:
            self._fail(request, NoRouteError(f"request given up after {request.attempt} pipelines failed ({why})"))
        elif not self.ready and not self._waits_for_replan():
            self._fail(request, NoRouteError(f"{why}: no complete pipeline is left ({self._why_down()})"))
        elif self.ready and (task_down := self.router.task_unroutable(request.params.task)):
            self._fail(request, NoRouteError(f"{why}: {task_down}"))
        elif not self.ready:
            self._wait(request, self.now, first=True)  # a re-plan is coming: first in line when it is routed
        elif not self._try_start(request):
            request.status, request.deadline_s = RequestStatus.WAITING, float("inf")
            self.waiting.appendleft(request)  # KV-masked for now: first in line

    def _fail(self, request: Request, error: HelixError, *, node: str | None = None,
              code: ErrorCode | None = None) -> None:  # fmt: skip
        request.error = error
        self._end(request, RequestStatus.FINISHED_ERROR)
        self._out.outputs.append(RequestOutput(request.request_id, error=error, node=node, code=code))

    def _end(self, request: Request, status: RequestStatus, *, last_stage_done: bool = False) -> None:
        """Final state: cancel the running attempt, release the reservation and the task, forget it."""
        if request.status.finished:
            return
        self._drop_attempt(request, last_stage_done=last_stage_done)
        request.status = status
        if request.holds_task and self.tasks is not None:
            request.holds_task = False
            self.tasks.finished(request.params.task)
        self.requests.pop(request.request_id, None)

    def _drop_attempt(self, request: Request, *, last_stage_done: bool = False) -> None:
        """Abandon the current attempt: CANCEL on its live stages (frees their KV), release its reservation."""
        pipeline = request.pipeline
        if pipeline is None or self._by_wire.pop(request.wire_id, None) is None:
            return
        stages = pipeline.stages[:-1] if last_stage_done else pipeline.stages
        for node in dict.fromkeys(s.node for s in stages):
            if node not in self.router.dead:
                self._send(node, wire.Cancel(request.wire_id, "cancelled"))
        if request.pinned is None:
            self.router.finish(request.request_id)
        request.pipeline = None

    # -- cluster events --------------------------------------------------------------------------

    def _on_agent_dead(self, node: str, how: str = "is dead") -> None:
        """Mask the node and move its in-flight requests to new pipelines."""
        self.agents.gone(node)
        if node in self.router.dead:
            return
        (log.info if how == "left" else log.warning)("agent %s %s: masking it", node, how)
        self.router.draining.discard(node)
        self.router.mark_dead(node)
        self.ready = self.router.has_route()
        moved = [r for r in self._by_wire.values() if r.pipeline is not None and node in r.pipeline.nodes]
        for request in moved:
            self._drop_attempt(request)
        for request in moved:
            if request.pinned is not None:
                self._fail(request, NoRouteError(f"node {node} of the pinned pipeline died"), node=node,
                           code=ErrorCode.AGENT_DEAD)  # fmt: skip
            else:
                self._reroute(request, f"node {node} died")
        if not self.ready and not self._waits_for_replan():
            self._fail_waiting()
        for request in list(self.waiting) if self.ready else ():  # requests for a task whose holders are gone
            if task_down := self.router.task_unroutable(request.params.task):
                self.waiting.remove(request)
                self._fail(request, NoRouteError(task_down))

    def _on_leaving(self, node: str) -> None:
        """``node`` drains: route no new request through it; those it runs finish there."""
        if node not in self.router.draining and node not in self.router.dead:
            log.info("agent %s is leaving: routing around it", node)
            self.router.draining.add(node)
            self.ready = self.router.has_route()

    def _on_agent_alive(self, node: str, welcome: wire.Welcome) -> None:
        """``node``'s agent (re)connected: route through it once it holds the layers the plan gives it."""
        self.agents.joined(node, welcome)
        self.router.draining.discard(node)  # a new agent process: not leaving
        self._use(node)

    def _use(self, node: str) -> None:
        """Route through the connected ``node`` if it is masked dead and holds its range of the plan."""
        placement = self.router.topology.placement
        if node not in placement or node not in self.router.dead:
            return
        capacity = self.agents.serves(node, *placement[node])
        if capacity is None:
            return
        self.router.report_kv(node, used=0.0, capacity=capacity)
        log.info("agent %s is alive", node)
        self.router.mark_alive(node)
        self.ready = self.router.has_route()

    def set_router(self, router: Router) -> None:
        """Route by ``router`` (a new plan's) from now on. Requests in flight keep their pipelines, KV
        reservations and leaving nodes' masks; a node is routed through once it holds its new range."""
        router.adopt(self.router)
        placement = router.topology.placement
        router.draining |= self.router.draining & set(placement)
        self.router = router
        for node in placement:
            router.mark_dead(node)
            self._use(node)
        self.ready = router.has_route()

    def _send(self, node: str, msg: wire.Message) -> None:
        self._out.messages.append((node, msg))


_CODES = frozenset(c.value for c in ErrorCode)

