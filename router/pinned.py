"""Requests on pipelines the caller chooses, over real agents: the coordinator core with no routing.

:class:`PinnedClient` connects to agents (the real transport, handshake and heartbeats), learns
their layers from their WELCOMEs, and runs each request on the stages given — no IWRR, no KV
masking, no failover (a dead stage fails the request). Tests and benches use it to drive chosen
splits; ``helix serve`` uses the routed :class:`router.coordinator.Coordinator` instead. Outputs
(:class:`router.request.RequestOutput`, tokens only) go to ``outputs``, a thread-safe queue.
Sampling is greedy unless ``submit`` says otherwise. Request ids must not repeat against the same
agents (an attempt's wire id is ``<request id>.<attempt>``): the server's coordinator draws random ones.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from helix import wire
from helix.domain import Pipeline, Stage
from helix.errors import NoRouteError
from helix.keys import CurveKeys
from router.agent_events import AgentEvent, AgentJoined
from router.agents_io import AgentsIO
from router.core import CoordinatorCore
from router.driver import CoreDriver
from router.kv import KVEstimator
from router.pipeline import Topology
from router.policy import Router
from router.request import GenerationRequest, NoText, Request, RequestOutput
from router.stops import StopMatcher

COORDINATOR = "coordinator"


class PinnedClient:
    """A coordinator core over ``agents`` (node -> control address) that runs requests on given pipelines."""

    def __init__(self, agents: Mapping[str, str], *, secret: bytes = b"", dead_after_s: float = 1.0,
                 curve: CurveKeys | None = None, ready_timeout_s: float = 30.0, **io_options: Any) -> None:
        self.outputs: queue.Queue[RequestOutput] = queue.Queue()
        self.events: queue.Queue[AgentEvent] = queue.Queue()  # joins and deaths, for tests that watch them
        self.ready_timeout_s = ready_timeout_s
        self.driver: CoreDriver | None = None
        self._early: list[AgentEvent] = []  # events before the core exists (replayed by start())
        self._lock = threading.Lock()
        self.io = AgentsIO(dict(agents), secret=secret, dead_after_s=dead_after_s, curve=curve, on_event=self._on_event,
                           **io_options)  # fmt: skip

    def __enter__(self) -> PinnedClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> PinnedClient:
        """Connect; raises NoRouteError naming the agents that did not complete the handshake in time."""
        self.io.start()
        if not self.io.wait_ready(timeout_s=self.ready_timeout_s):
            states = self.io.agents()
            missing = {n: a.auth_error or "no answer" for n, a in states.items() if not a.alive}
            self.close()
            raise NoRouteError(f"agents not ready: {missing}")
        welcomes = {n: a.welcome for n, a in self.io.agents().items() if a.welcome is not None}
        placement = {n: (w.layer_start, w.layer_end) for n, w in welcomes.items()}
        nodes = [COORDINATOR, *placement]
        links = {(a, b) for a in nodes for b in nodes if a != b}
        num_layers = max(e for _, e in placement.values())
        router = Router(Topology(COORDINATOR, num_layers, placement, links), {}, KVEstimator({}))
        driver = CoreDriver(CoordinatorCore(router), self._put)
        driver.attach(self.io)
        driver.feed(AgentJoined(n, w) for n, w in welcomes.items())
        with self._lock:
            driver.feed(e for e in self._early if not isinstance(e, AgentJoined))  # a death while starting
            self._early.clear()
            self.driver = driver
        return self

    def close(self) -> None:
        self.io.close()

    def _put(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            self.outputs.put(out)

    def _on_event(self, event: AgentEvent) -> None:  # the I/O thread
        with self._lock:
            if self.driver is None:
                self._early.append(event)
            else:
                self.driver.on_event(event)
        if not isinstance(event, wire.Tokens | wire.Refused):
            self.events.put(event)  # after the core has it: a caller that sees a join may submit at once

    def submit(self, request_id: str, prompt_ids: Sequence[int], pipeline: Pipeline | Iterable[Stage], *,
               max_tokens: int, **params: Any) -> None:
        """Run ``prompt_ids`` on ``pipeline``; ``params``: :class:`GenerationRequest`'s sampling fields
        (greedy unless ``temperature`` is given)."""
        assert self.driver is not None, "start() first"
        stages = pipeline.stages if isinstance(pipeline, Pipeline) else tuple(pipeline)
        params.setdefault("temperature", 0.0)
        gen = GenerationRequest(prompt_ids=list(prompt_ids), max_tokens=max_tokens, **params)
        self.driver.add(Request(request_id, gen, arrival_s=time.monotonic(), detok=NoText(), stops=StopMatcher(()),
                                pinned=Pipeline(stages)))  # fmt: skip

    def cancel(self, request_id: str) -> None:
        assert self.driver is not None, "start() first"
        self.driver.abort(request_id)
