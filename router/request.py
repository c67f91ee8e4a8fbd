"""One request on the coordinator: what it asks for, where it is in its life, what it reports.

* :class:`GenerationRequest` — what the HTTP layer asks for, validated and tokenized.
* :class:`Request` — the core's one record of it (:mod:`router.core`): a :class:`RequestStatus`,
  its attempts (one pipeline each; a failover starts a new one), the tokens generated so far,
  the text state (incremental detokenizer, stop strings), timestamps for the metrics.
* :class:`RequestOutput` — what the core reports about a request: it started (left the queue),
  new tokens and text, its :class:`Finish`, or the error that ended it.

Pure data: no sockets, threads or clocks.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from helix import wire
from helix.domain import ErrorCode, FinishReason, Pipeline
from helix.errors import HelixError
from router.stops import StopMatcher


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


class RequestStatus(Enum):
    """Where a request is in its life. Finished states are final."""

    WAITING = "waiting"  # admitted, queued until a route frees up (or re-queued after a failover)
    RUNNING = "running"  # on a pipeline
    FINISHED_STOPPED = "finished_stopped"  # a stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens
    FINISHED_ABORTED = "finished_aborted"  # the client went away
    FINISHED_ERROR = "finished_error"  # no pipeline could finish it (Request.error says why)

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)

    @staticmethod
    def of(reason: FinishReason) -> RequestStatus:
        return _STATUS_OF[reason]


_STATUS_OF = {FinishReason.STOP: RequestStatus.FINISHED_STOPPED, FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
              FinishReason.CANCELLED: RequestStatus.FINISHED_ABORTED, FinishReason.ERROR: RequestStatus.FINISHED_ERROR}


class Detokenizer(Protocol):
    """Incremental text of a growing token list (``router.tokenizer.IncrementalDetokenizer``)."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class NoText:
    """A detokenizer for callers that want tokens only (the simulator, benches)."""

    __slots__ = ()

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass(frozen=True, slots=True)
class Finish:
    """How a request ended."""

    reason: FinishReason  # STOP or LENGTH
    prompt_tokens: int
    completion_tokens: int
    pipelines: tuple[Pipeline, ...]
    reroutes: int


@dataclass(slots=True)
class Request:
    """The core's state of one request (see the module doc)."""

    request_id: str
    params: GenerationRequest
    arrival_s: float
    detok: Detokenizer
    stops: StopMatcher
    status: RequestStatus = RequestStatus.WAITING
    pinned: Pipeline | None = None  # run on this pipeline, no routing and no failover (tests, benches)
    deadline_s: float = float("inf")  # while waiting: fail with OverloadedError after this
    attempt: int = 0
    wire_id: str = ""  # "<request_id>.<attempt>": the id of the current attempt on the wire
    pipeline: Pipeline | None = None  # the current attempt's
    pipelines: list[Pipeline] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    attempt_tokens: int = 0  # tokens the current attempt produced
    last_token_s: float = 0.0
    holds_task: bool = False  # counted in its task's requests in flight (router.tasks)
    error: HelixError | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.params.prompt_ids)

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    def sampling_spec(self, stop_token_ids: Collection[int]) -> wire.SamplingSpec:
        """The next attempt's sampling parameters. A re-prefill after a failover carries the tokens
        generated so far, so the last stage's penalty counts cover the whole output and its grammar
        matcher continues where the failed pipeline's stopped."""
        p = self.params
        stateful = bool(p.presence_penalty or p.frequency_penalty or p.grammar)
        return wire.SamplingSpec(temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                                 stop_token_ids=tuple(sorted(stop_token_ids)),
                                 presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                 logit_bias=p.logit_bias, grammar=p.grammar, paced=bool(p.stop),
                                 prior_output_ids=tuple(self.output_ids) if stateful else ())  # fmt: skip


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What the core reports about a request since its last output.

    ``started``: it left the queue (its first attempt was sent). ``token_ids``/``text``: new tokens
    and the text that is safe to stream (``node``: the last stage that sent them). ``finish`` or
    ``error`` (with the ``node`` and the wire's ``code`` where a stage caused it) end the request: no
    output follows them.
    """

    request_id: str
    started: bool = False
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish: Finish | None = None
    error: HelixError | None = None
    node: str | None = None
    code: ErrorCode | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None or self.error is not None
