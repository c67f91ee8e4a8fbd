"""What the coordinator's transport (:class:`router.agents_io.AgentsIO`) reports to its caller:
every request's token events, each agent's latest KV report, and the bridge that hands a
request's events from the I/O thread to an asyncio loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from helix.wire import StepStats


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One event of a request: a token (``token_id``), its end (``finished``), or an ``error``.

    ``error_code``: ``capacity`` (can never fit in some stage's KV), ``agent_dead``, ``unreachable``,
    ``bad_request`` ...; errors are always ``finished``. ``finish_reason``: ``stop``, ``length``,
    ``cancelled`` or ``error``.
    """

    request_id: str
    token_id: int | None
    index: int
    finished: bool = False
    finish_reason: str | None = None
    error_code: str | None = None
    error: str | None = None
    node_id: str | None = None


TokenCallback = Callable[[TokenEvent], None]


@dataclass(frozen=True, slots=True)
class KVReport:
    """The latest heartbeat of an agent: KV tokens, queue lengths (``waiting`` for admission to
    its scheduler, ``running`` in it), its engine steps so far, and how old it is."""

    node_id: str
    used_tokens: int
    reserved_tokens: int
    capacity_tokens: int
    waiting: int
    running: int
    age_s: float
    steps: StepStats = StepStats()


class AsyncTokenStream:
    """Bridge to asyncio: pass ``stream.put`` as ``on_token``; ``async for event in stream`` until finished."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def put(self, event: TokenEvent) -> None:  # I/O thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def __aiter__(self) -> AsyncTokenStream:
        self._done = False
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._queue.get()
        self._done = event.finished
        return event
