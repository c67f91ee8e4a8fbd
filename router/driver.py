"""The core's thin shell: one :class:`~router.core.CoordinatorCore` behind one lock, stepped by
whichever thread has news, its messages handed to the transport in the order the core made them.

* The transport's I/O thread calls :meth:`CoreDriver.on_event` for every agent event (tokens,
  refusals, deaths): the core updates, schedules, and the next STEP leaves from that thread at once
  (no hop through an event loop).
* Any other thread calls :meth:`add`, :meth:`abort`, :meth:`feed` or :meth:`tick`: the core's
  messages are queued to the I/O thread while the lock is held, so they keep the core's order.
* Every :class:`~router.request.RequestOutput` goes to ``on_output`` (on the thread that produced
  it); :class:`router.coordinator.Coordinator` hands them to its asyncio loop, tests and benches
  collect them in a queue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from router.agent_events import AgentEvent, KVReported
from router.agents_io import AgentsIO
from router.core import CoordinatorCore
from router.policy import Router
from router.request import Request, RequestOutput

OutputSink = Callable[[Sequence[RequestOutput]], None]
T = TypeVar("T")


class CoreDriver:
    """Steps ``core`` from the transport's events and from callers (see the module doc)."""

    def __init__(self, core: CoordinatorCore, on_output: OutputSink) -> None:
        self.core = core
        self.on_output = on_output
        self.io: AgentsIO | None = None
        self.lock = threading.Lock()

    def attach(self, io: AgentsIO) -> None:
        """Use ``io``: its events come to :meth:`on_event`, tokens go to its sink (``reply_to``)."""
        self.io = io
        self.core.reply_to = io.reply_to

    # -- callers ---------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Admit ``request`` (raises what :meth:`CoordinatorCore.add_request` raises)."""
        with self.lock:
            now = time.monotonic()
            try:
                self.core.add_request(request, now)
            finally:
                self._schedule(now, from_io=False)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.core.abort_request(request_id)
            self._schedule(time.monotonic(), from_io=False)

    def feed(self, events: Iterable[AgentEvent]) -> None:
        """Apply events that did not come from the I/O thread (an agent joining, KV reports)."""
        with self.lock:
            now = time.monotonic()
            self.core.update_from_output(events, now)
            self._schedule(now, from_io=False)

    def switch(self, router: Router) -> None:
        """Route by ``router`` (a re-plan's) from now on (:meth:`CoordinatorCore.set_router`)."""
        with self.lock:
            self.core.set_router(router)
            self._schedule(time.monotonic(), from_io=False)

    def locked(self, fn: Callable[[CoordinatorCore], T]) -> T:
        """``fn(core)`` between two of the core's steps (a consistent look at it, or a change to its routing)."""
        with self.lock:
            return fn(self.core)

    def set_unavailable(self, reason: str) -> None:
        """Why the cluster cannot serve the model (said in 503s); "" once it can again."""
        with self.lock:
            self.core.set_unavailable(reason)
            self._schedule(time.monotonic(), from_io=False)  # the requests it fails are answered now

    def tick(self) -> None:
        """Expire requests that waited too long and start waiting ones (call a few times a second)."""
        if self.io is not None:
            placement = self.core.router.topology.placement
            reports = [KVReported(n, float(r.used_tokens * (placement[n][1] - placement[n][0])),
                                  float(r.reserved_tokens * (placement[n][1] - placement[n][0])),
                                  float(r.capacity_tokens * (placement[n][1] - placement[n][0])))
                       for n, r in self.io.kv_reports().items() if n in placement]  # fmt: skip
            self.feed(reports)
        else:
            self.feed(())

    # -- the transport's I/O thread --------------------------------------------------------------

    def on_event(self, event: AgentEvent) -> None:
        with self.lock:
            now = time.monotonic()
            self.core.update_from_output((event,), now)
            self._schedule(now, from_io=True)

    def _schedule(self, now: float, *, from_io: bool) -> None:  # the lock is held
        out = self.core.schedule(now)
        if out.messages and self.io is not None:
            self.io.send(out.messages, from_io_thread=from_io)
        if out.outputs:
            self.on_output(out.outputs)
