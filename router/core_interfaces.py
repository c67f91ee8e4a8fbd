"""What the coordinator core (:mod:`router.core`) reports, asks and hands back: its interfaces.

* :class:`CoreObserver` — what the core reports for metrics, as it happens (admitted, rejected,
  each token with the pipeline's edges, re-routed, finished); :class:`router.metrics.MetricsObserver`
  counts it, :class:`QuietObserver` (the default) ignores it;
* :class:`TaskGate` — what the core asks before admitting a request for a fine-tuned task, and
  tells as it starts and finishes (:class:`router.tasks.TaskRegistry`);
* :class:`CoreOutput` — what one :meth:`router.core.CoordinatorCore.schedule` hands the caller:
  the messages to send (:data:`Outgoing`, in order) and the requests' outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from helix import wire
from router.request import Request, RequestOutput

Outgoing = tuple[str, wire.Message]  # (node id, message)


class CoreObserver(Protocol):
    """What the core reports for metrics (``router.metrics.MetricsObserver``; the default does nothing)."""

    def admitted(self, task: str, prompt_tokens: int) -> None: ...

    def rejected(self, reason: str) -> None: ...

    def token(self, request: Request, edges: tuple[tuple[str, str], ...], moved: int, now: float) -> None: ...

    def rerouted(self) -> None: ...

    def finished(self, request: Request, now: float) -> None: ...


class QuietObserver:
    """No metrics."""

    def admitted(self, task: str, prompt_tokens: int) -> None:
        pass

    def rejected(self, reason: str) -> None:
        pass

    def token(self, request: Request, edges: tuple[tuple[str, str], ...], moved: int, now: float) -> None:
        pass

    def rerouted(self) -> None:
        pass

    def finished(self, request: Request, now: float) -> None:
        pass


class TaskGate(Protocol):
    """Which fine-tuned tasks may be requested, and how many requests each has in flight (``router.tasks``)."""

    def servable(self, name: str) -> object | None: ...

    def started(self, name: str) -> None: ...

    def finished(self, name: str) -> None: ...


@dataclass(slots=True)
class CoreOutput:
    """What one :meth:`router.core.CoordinatorCore.schedule` hands to the caller."""

    messages: list[Outgoing] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
