"""Runtime state of one request on the coordinator, and the HTTP layer's handle on it.

:class:`GenerationRequest` is what the HTTP layer asks for (validated, tokenized);
:class:`Flight` is the coordinator's state for it (attempts, pipelines, tokens so far, the event
queue the HTTP response reads); :class:`RequestHandle` is what the HTTP layer holds: the events
(text deltas then one :class:`Finish`) and cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from helix.domain import Pipeline
from helix.errors import HelixError
from router.stops import StopMatcher
from router.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from router.coordinator import Coordinator

STALL_TIMEOUT_S = 300.0  # a safety net for lost messages; long prefills on a busy CPU are slow


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What a request asks for, after the HTTP layer validated and tokenized it."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids checked against the vocabulary
    grammar: str = ""  # llguidance grammar the output follows (response_format); empty: free text
    task: str = ""  # the fine-tuned task (router.tasks) the request runs; empty: the base model


@dataclass(frozen=True, slots=True)
class Finish:
    """The last event of a request."""

    reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    pipelines: tuple[Pipeline, ...]
    reroutes: int


@dataclass(slots=True)
class Flight:
    """Runtime state of one request."""

    request_id: str
    gen: GenerationRequest
    events: asyncio.Queue[str | Finish | HelixError]
    detok: IncrementalDetokenizer
    stops: StopMatcher
    arrival_s: float
    attempt: int = 0
    wire_id: str = ""
    pipeline: Pipeline | None = None
    pipelines: list[Pipeline] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    attempt_tokens: int = 0
    last_token_s: float = 0.0
    done: bool = False
    admitted: asyncio.Future[None] | None = None
    holds_task: bool = False  # counted in its task's requests in flight (router.tasks)


class RequestHandle:
    """The HTTP layer's grip on one admitted request: its events, and cancellation."""

    __slots__ = ("_coordinator", "_flight")

    def __init__(self, coordinator: Coordinator, flight: Flight) -> None:
        self._coordinator, self._flight = coordinator, flight

    @property
    def request_id(self) -> str:
        return self._flight.request_id

    @property
    def pipelines(self) -> tuple[Pipeline, ...]:
        """The pipelines the request has run on so far (the last one is current)."""
        return tuple(self._flight.pipelines)

    def response_id(self, prefix: str) -> str:
        return f"{prefix}-{self._flight.request_id}"

    async def events(self) -> AsyncIterator[str | Finish]:
        """Text deltas, then one :class:`Finish`; raises the HelixError that ended the request."""
        queue = self._flight.events
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
        self._coordinator.cancel(self._flight, reason)


