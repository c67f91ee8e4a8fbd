"""The request lifecycle on the coordinator: admit, route, step, stream, finish, fail over.

One :class:`Coordinator` runs inside the HTTP server's asyncio loop. For every request it:

1. **admits** it: routes it through :class:`router.policy.Router` (IWRR + KV watermark
   masking). When every route is masked it waits in a bounded FIFO queue; past the bound, or
   after ``admission_timeout_s``, the client gets :class:`~helix.errors.OverloadedError`
   (429 + Retry-After). With no complete pipeline at all it gets
   :class:`~helix.errors.NoRouteError` (503). Nothing is dropped silently.
2. **submits** it to its pipeline's first stage (``ADMIT``); for each token the last stage
   returns it applies the stop conditions (stop tokens, stop strings, max tokens), streams the
   text, and sends the next ``STEP`` to the same pipeline (the agents keep the KV).
3. **finishes** it: cancels it on every stage (frees agent KV) and releases its reservation,
   which wakes waiting requests. A client that disconnects does the same.
4. **fails over**: when the transport reports an agent dead (heartbeats stop), the node is
   masked and every request in flight on it gets a new pipeline and is re-prefilled from
   prompt + tokens generated so far (same greedy output; the tokens generated so far travel in
   the sampling parameters too, so presence/frequency penalties keep counting them). Each attempt has its own wire
   request id, so late tokens of an abandoned pipeline are ignored.

The transport is :class:`router.agents_io.AgentsIO` (ZeroMQ, its own I/O thread). It sends
each ``STEP`` itself as soon as a token arrives (no hop through the event loop); token events
are handed to this loop with ``call_soon_threadsafe``. A stop string seen here cancels the
request, so at most one extra step runs on the agents.

Fine-tuned tasks: :class:`router.tasks.TaskRegistry` (``self.tasks``) loads and unloads them on
the agents; a request naming one carries it to every stage, and counts in the task's requests
in flight from admission to its end (an unloading task waits for them).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Container, Mapping

from helix.domain import Pipeline
from helix.errors import CapacityError, HelixError, NoRouteError, OverloadedError, UnknownTaskError
from helix.wire import SamplingSpec, TaskStatus, Welcome
from router.agent_events import TokenEvent
from router.agents_io import AgentsIO
from router.metrics import ServingMetrics
from router.pipeline import build_pipeline
from router.policy import Router, RouteRequest
from router.request_state import Finish, Flight, GenerationRequest, RequestHandle
from router.stops import StopMatcher
from router.tasks import TaskRegistry
from router.tokenizer import ChatTokenizer, IncrementalDetokenizer

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8  # pipelines one request may be given (failovers) before it fails
RETRYABLE = ("agent_dead", "unreachable")


class Coordinator:
    """Admission, per-step stop conditions, streaming and failover for all requests."""

    def __init__(self, router: Router, tokenizer: ChatTokenizer, *, model_names: list[str],
                 max_context_tokens: int, max_tokens_cap: int, planned_flows: Mapping[tuple[str, str], float],
                 queue_bound: int = 256, admission_timeout_s: float = 30.0, max_lora_rank: int = 0) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.max_context_tokens = max_context_tokens
        self.max_tokens_cap = max_tokens_cap
        self.queue_bound = queue_bound
        self.admission_timeout_s = admission_timeout_s
        self.metrics = ServingMetrics(planned_flows)
        self.started_s = int(time.time())
        self.io: AgentsIO | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.coordinator_id = router.topology.coordinator
        self.nodes = sorted(router.topology.placement)
        self._by_wire: dict[str, Flight] = {}  # running attempts
        self._waiting: deque[Flight] = deque()
        self._pipeline_edges: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {}
        self._ready = False
        self._stop_ids = tuple(sorted(tokenizer.eos_token_ids))
        self.tasks = TaskRegistry(model_names, self.nodes, max_lora_rank=max_lora_rank)
        self.startup_tasks: list[tuple[str, str]] = []  # (name, directory): loaded once the agents are connected
        for node in self.nodes:  # no node is usable before its agent completes the handshake
            router.mark_dead(node)

    # -- wiring ------------------------------------------------------------------------------

    def attach(self, io: AgentsIO, loop: asyncio.AbstractEventLoop) -> None:
        """Use ``io`` (its callbacks must be :meth:`agent_dead_threadsafe` / :meth:`agent_alive_threadsafe`)."""
        self.io, self.loop = io, loop
        self.tasks.send, self.tasks.alive = lambda node, msg: io.send_task(node, msg), io.alive_nodes
        for node in io.alive_nodes():
            self.router.mark_alive(node)
        self._ready = self.router.has_route()

    def agent_dead_threadsafe(self, node: str) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_agent_dead, node)

    def agent_alive_threadsafe(self, node: str, welcome: Welcome) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_agent_alive, node, welcome)

    def task_status_threadsafe(self, status: TaskStatus) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.tasks.on_status, status)

    async def load_startup_tasks(self, timeout_s: float = 300.0) -> None:
        """Background task: once every agent is connected (or after ``timeout_s``), load the tasks listed at start."""
        deadline = time.monotonic() + timeout_s
        while self.io is not None and not set(self.nodes) <= self.io.alive_nodes() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await self.tasks.load_all(self.startup_tasks)

    async def watch_kv(self, interval_s: float = 0.25) -> None:
        """Background task: fold the agents' KV reports into the router, wake waiting requests."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.on_kv_reports()
            except Exception:  # never let the watcher die
                log.exception("KV report handling failed")

    @property
    def ready(self) -> bool:
        return self._ready

    def health_details(self) -> dict[str, object]:
        return {"nodes": {n: n not in self.router.dead for n in self.nodes},
                "running": len(self._by_wire), "waiting": len(self._waiting),
                "tasks": {t.name: str(t.state) for t in self.tasks.tasks.values()}}

    # -- admission ---------------------------------------------------------------------------

    async def admit(self, gen: GenerationRequest) -> RequestHandle:
        """Route (or queue) a request; raises NoRouteError / OverloadedError / CapacityError."""
        if not self._ready:
            self.metrics.rejected.labels("no_route").inc()
            raise NoRouteError(f"no complete pipeline is available (nodes down: {', '.join(sorted(self.router.dead))})")
        flight = Flight(request_id=uuid.uuid4().hex[:16], gen=gen, events=asyncio.Queue(),
                        detok=IncrementalDetokenizer(self.tokenizer), stops=StopMatcher(gen.stop),
                        arrival_s=time.monotonic())
        self.metrics.prompt_tokens.inc(len(gen.prompt_ids))
        if gen.task:
            if self.tasks.servable(gen.task) is None:
                raise UnknownTaskError(f"the model '{gen.task}' does not exist here (no such task is loaded)",
                                       task=gen.task)  # fmt: skip
            self.tasks.started(gen.task)
            flight.holds_task = True
        label = gen.task or self.model_names[0]
        self.metrics.task_requests.labels(label).inc()
        self.metrics.task_tokens_add(label, "prompt", len(gen.prompt_ids))
        if not self._waiting and self._try_start(flight):
            return RequestHandle(self, flight)
        if not self._can_ever_fit(len(gen.prompt_ids) + gen.max_tokens):
            self._let_go_of_task(flight)
            self.metrics.rejected.labels("too_large").inc()
            raise CapacityError(f"a request of {len(gen.prompt_ids)} prompt + {gen.max_tokens} output tokens does "
                                "not fit in the KV cache of any pipeline; shorten the prompt or lower max_tokens")
        if len(self._waiting) >= self.queue_bound:
            self._let_go_of_task(flight)
            self.metrics.rejected.labels("queue_full").inc()
            raise OverloadedError(f"the server is at capacity ({len(self._by_wire)} running, {len(self._waiting)} "
                                  "waiting); retry later", retry_after_s=self._retry_after_s())
        flight.admitted = asyncio.get_running_loop().create_future()
        self._waiting.append(flight)
        try:
            await asyncio.wait_for(asyncio.shield(flight.admitted), self.admission_timeout_s)
        except TimeoutError:
            self.cancel(flight, "admission timeout")
            self.metrics.rejected.labels("timeout").inc()
            raise OverloadedError(f"no route freed up within {self.admission_timeout_s:.0f} s; retry later",
                                  retry_after_s=self._retry_after_s()) from None
        except asyncio.CancelledError:
            self.cancel(flight, "client gone while waiting")
            raise
        return RequestHandle(self, flight)

    def _can_ever_fit(self, tokens: int) -> bool:
        """Whether some live pipeline could hold ``tokens`` if its nodes' KV were empty."""
        kv, dead = self.router.kv, self.router.dead

        def admissible(node: str, start: int, end: int) -> bool:
            cap = kv.nodes[node].capacity if node in kv.nodes else None
            return node not in dead and (cap is None or tokens * (end - start) <= kv.watermark * cap)

        def first(vertex: str, excluded: Container[str], ok: Callable[[str], bool]) -> str | None:
            return next((c for c in self.router.topology.successors[vertex] if c not in excluded and ok(c)), None)

        try:
            build_pipeline(self.router.topology, first, admissible)
        except NoRouteError:
            return False
        return True

    def _retry_after_s(self) -> float:
        return max(1.0, min(30.0, 0.5 * (1 + len(self._waiting))))

    def _try_start(self, flight: Flight) -> bool:
        """Route and submit the flight's next attempt; False when every route is masked now."""
        assert self.io is not None and self.loop is not None, "attach() the agents first"
        prompt = flight.gen.prompt_ids + flight.output_ids
        remaining = flight.gen.max_tokens - len(flight.output_ids)
        try:
            pipeline = self.router.route(RouteRequest(flight.request_id, len(prompt), remaining))
        except NoRouteError:
            return False
        flight.attempt += 1
        wire_id = f"{flight.request_id}.{flight.attempt}"
        sampling = self._sampling(flight)
        try:
            self.io.submit(wire_id, prompt, sampling, pipeline, max_tokens=remaining,
                           on_token=self._callback(flight, wire_id), task=flight.gen.task)
        except NoRouteError:  # an agent died a moment ago; its death notice is on its way
            self.router.finish(flight.request_id)
            return False
        flight.wire_id, flight.pipeline, flight.attempt_tokens = wire_id, pipeline, 0
        flight.pipelines.append(pipeline)
        self._by_wire[wire_id] = flight
        return True

    def _sampling(self, flight: Flight) -> SamplingSpec:
        """The attempt's sampling parameters. A re-prefill after a failover carries the tokens
        generated so far, so the last stage's penalty counts cover the whole output and its
        grammar matcher continues where the failed pipeline's stopped."""
        gen = flight.gen
        stateful = bool(gen.presence_penalty or gen.frequency_penalty or gen.grammar)
        return SamplingSpec(temperature=gen.temperature, top_p=gen.top_p, seed=gen.seed, stop_token_ids=self._stop_ids,
                            presence_penalty=gen.presence_penalty, frequency_penalty=gen.frequency_penalty,
                            logit_bias=gen.logit_bias, grammar=gen.grammar,
                            prior_output_ids=tuple(flight.output_ids) if stateful else ())

    def _callback(self, flight: Flight, wire_id: str) -> Callable[[TokenEvent], None]:
        loop = self.loop
        assert loop is not None

        def on_event(event: TokenEvent) -> None:  # the I/O thread
            loop.call_soon_threadsafe(self._on_event, flight, wire_id, event)

        return on_event

    def _drain_waiting(self) -> None:
        """Start waiting requests in FIFO order while routes are free."""
        while self._waiting:
            flight = self._waiting[0]
            if flight.done:
                self._waiting.popleft()
                continue
            if not self._try_start(flight):
                return
            self._waiting.popleft()
            if flight.admitted is not None and not flight.admitted.done():
                flight.admitted.set_result(None)

    def _fail_waiting(self) -> None:
        while self._waiting:
            self._fail(self._waiting.popleft(), NoRouteError(
                f"no complete pipeline is left (nodes down: {', '.join(sorted(self.router.dead))})"))

    # -- per step ------------------------------------------------------------------------------

    def _on_event(self, flight: Flight, wire_id: str, event: TokenEvent) -> None:
        if flight.done or flight.wire_id != wire_id:
            return  # late event of a finished, cancelled or abandoned attempt
        if event.error_code is not None:
            self._on_attempt_error(flight, event)
        elif event.token_id is not None:
            self._on_token(flight, event)
        elif event.finish_reason not in ("cancelled", None):
            self._finish(flight, "length" if event.finish_reason == "length" else "stop")

    def _on_token(self, flight: Flight, event: TokenEvent) -> None:
        assert flight.pipeline is not None and event.token_id is not None
        now = time.monotonic()
        prompt_len = len(flight.gen.prompt_ids) + len(flight.output_ids)
        self.metrics.tokens_moved(self._edges(flight.pipeline), 1 if flight.attempt_tokens else prompt_len)
        if flight.output_ids:
            self.metrics.tpot.observe(now - flight.last_token_s)
        else:
            self.metrics.ttft.observe(now - flight.arrival_s)
        flight.last_token_s = now
        flight.attempt_tokens += 1
        flight.output_ids.append(event.token_id)
        self.metrics.generated_tokens.inc()
        self.metrics.task_tokens_add(flight.gen.task or self.model_names[0], "generated", 1)
        is_eos = event.token_id in self.tokenizer.eos_token_ids
        text = "" if is_eos else flight.stops.feed(flight.detok.push(event.token_id))
        if text:
            flight.events.put_nowait(text)
        reason = None
        if is_eos or flight.stops.stopped:
            reason = "stop"
        elif len(flight.output_ids) >= flight.gen.max_tokens:
            reason = "length"
        elif event.finished:
            reason = "length" if event.finish_reason == "length" else "stop"
        if reason is None:
            return  # agents_io already sent the next STEP to the same pipeline
        if not flight.stops.stopped:
            tail = flight.stops.feed(flight.detok.flush()) + flight.stops.flush()
            if tail:
                flight.events.put_nowait(tail)
        self._finish(flight, reason)

    def _on_attempt_error(self, flight: Flight, event: TokenEvent) -> None:
        node = event.node_id
        if event.error_code == "agent_dead" and node is not None:
            self.on_agent_dead(node)  # the death notice may come after this event; idempotent
        self._drop_attempt(flight)
        if event.error_code not in RETRYABLE:
            err: HelixError = CapacityError(event.error or "") if event.error_code == "capacity" else HelixError(
                f"the pipeline failed: {event.error_code}: {event.error}")
            self._fail(flight, err)
            return
        self._reroute(flight, f"{event.error_code} at {node}")

    def _reroute(self, flight: Flight, why: str) -> None:
        self.metrics.reroutes.inc()
        log.info("re-routing request %s after %s (%d tokens so far)", flight.request_id, why, len(flight.output_ids))
        if flight.attempt >= MAX_ATTEMPTS:
            self._fail(flight, NoRouteError(f"request given up after {flight.attempt} pipelines failed ({why})"))
        elif not self._ready:
            self._fail(flight, NoRouteError(f"{why}: no complete pipeline is left "
                                            f"(nodes down: {', '.join(sorted(self.router.dead))})"))
        elif not self._try_start(flight):
            self._waiting.appendleft(flight)  # KV-masked for now: first in line

    def _edges(self, pipeline: Pipeline) -> tuple[tuple[str, str], ...]:
        edges = self._pipeline_edges.get(pipeline.nodes)
        if edges is None:  # a handful of distinct pipelines; every token asks
            hops = [self.coordinator_id, *pipeline.nodes, self.coordinator_id]
            edges = self._pipeline_edges[pipeline.nodes] = tuple(zip(hops, hops[1:], strict=False))
        return edges

    def _finish(self, flight: Flight, reason: str) -> None:
        self.metrics.latency.observe(time.monotonic() - flight.arrival_s)
        finish = Finish(reason=reason, prompt_tokens=len(flight.gen.prompt_ids),
                        completion_tokens=len(flight.output_ids), pipelines=tuple(flight.pipelines),
                        reroutes=max(0, flight.attempt - 1))
        self._release(flight)
        flight.events.put_nowait(finish)

    def _fail(self, flight: Flight, error: HelixError) -> None:
        self._release(flight)
        if flight.admitted is not None and not flight.admitted.done():
            flight.admitted.set_exception(error)
        else:
            flight.events.put_nowait(error)

    def _release(self, flight: Flight) -> None:
        """Cancel the flight everywhere and free its reservation (idempotent); wake waiters."""
        if flight.done:
            return
        flight.done = True
        self._drop_attempt(flight)
        self._let_go_of_task(flight)
        self._drain_waiting()

    def _let_go_of_task(self, flight: Flight) -> None:
        if flight.holds_task:
            flight.holds_task = False
            self.tasks.finished(flight.gen.task)

    def _drop_attempt(self, flight: Flight) -> None:
        if flight.pipeline is not None and self._by_wire.pop(flight.wire_id, None) is not None:
            assert self.io is not None
            self.io.cancel(flight.wire_id)
            self.router.finish(flight.request_id)
        flight.pipeline = None

    def cancel(self, flight: Flight, reason: str) -> None:
        """Client gone or request over: free everything the flight holds (idempotent)."""
        if flight.done:
            return
        log.debug("cancel %s: %s", flight.request_id, reason)
        if flight in self._waiting:
            self._waiting.remove(flight)
        self._release(flight)

    # -- cluster events --------------------------------------------------------------------------

    def on_agent_dead(self, node: str) -> None:
        """Heartbeats stopped: mask the node, move its in-flight requests to new pipelines."""
        if node in self.router.dead:
            return
        log.warning("agent %s is dead: masking it", node)
        self.tasks.on_agent_dead(node)
        self.router.mark_dead(node)
        self._ready = self.router.has_route()
        moved = [f for f in self._by_wire.values() if f.pipeline is not None and node in f.pipeline.nodes]
        for flight in moved:
            self._drop_attempt(flight)
        for flight in moved:
            self._reroute(flight, f"node {node} died")
        if not self._ready:
            self._fail_waiting()
        else:
            self._drain_waiting()

    def on_agent_alive(self, node: str, welcome: Welcome | None = None) -> None:
        """An agent (re)connected: route through it again (unless it holds other layers than planned)."""
        if node not in self.router.topology.placement:
            return
        start, end = self.router.topology.placement[node]
        if welcome is not None:
            if (welcome.layer_start, welcome.layer_end) != (start, end):
                log.error("agent %s holds layers [%d, %d) but the plan gives it [%d, %d): not using it", node,
                          welcome.layer_start, welcome.layer_end, start, end)
                return
            self.router.report_kv(node, used=0.0, capacity=float(welcome.kv_capacity_tokens * (end - start)))
        log.info("agent %s is alive", node)
        self.tasks.on_agent_alive(node)  # sent before any request is routed through it
        self.router.mark_alive(node)
        self._ready = self.router.has_route()
        self._drain_waiting()

    def on_kv_reports(self) -> None:
        """Fold the agents' KV reports into the router's estimates (entries = tokens x layers)."""
        assert self.io is not None
        placement = self.router.topology.placement
        for node, report in self.io.kv_reports().items():
            if node in placement:
                layers = placement[node][1] - placement[node][0]
                self.router.report_kv(node, used=float(report.used_tokens * layers),
                                      reserved=float(report.reserved_tokens * layers),
                                      capacity=float(report.capacity_tokens * layers))
        self._drain_waiting()

    def refresh_metrics(self) -> None:
        kv = self.router.kv
        self.metrics.refresh(ready=self._ready, alive={n: n not in self.router.dead for n in self.nodes},
                             kv_usage={n: kv.usage(n) for n in kv.nodes},
                             reports=self.io.kv_reports() if self.io is not None else {},
                             waiting=len(self._waiting), running=len(self._by_wire))
