"""The agent's request routes: where each request it serves sits in its pipeline and where its results go.

The engine thread owns one :class:`RouteTable`. An ADMIT (this node is the first stage) or a first
ACTIVATIONS carrying the request's admission (a later stage) adds the request to the engine under
a :class:`Route`, once every address its results would go to (the later stages', ``reply_to``) is
where the cluster file puts that vertex; STEP hands the engine the coordinator's token; CANCEL
forgets the request, and a tombstone drops its late activations. A request the engine cannot take
(KV full, a bad request) or whose next stage is unreachable is REFUSED to its coordinator, and so
is a new one the agent's ``admission`` gate turns away (retryable: the agent is leaving, or its
layers for the request moved; :mod:`node_agent.membership`). After
each engine step :meth:`RouteTable.deliver` sends its hidden states on to the next stage
(ACTIVATIONS; the first one carries the admission) and its tokens to the coordinators' sinks (one
TOKENS per sink). The agent sends (``send``: :meth:`node_agent.agent.NodeAgent._out`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from helix import wire
from helix.domain import ErrorCode, FinishReason, LayerRange
from helix.errors import CapacityError, HelixError, ProtocolError
from helix.keys import PeerPolicy
from node_agent.transport import frame_tensor, sampling_params, tensor_frame

log = logging.getLogger(__name__)

TOMBSTONES = 65_536  # cancelled request ids remembered (late activations for them are dropped)


class StageEngineLike(Protocol):
    """What the agent needs from a stage engine (``node_agent.engine.StageEngine`` is one)."""

    layer_start: int
    layer_end: int
    config: Any  # node_agent.config.ModelConfig

    def add_request(self, request_id: str, sampling: Any, *, prompt_token_ids: list[int] | None = None,
                    prompt_len: int | None = None, layer_range: tuple[int, int] | None = None,
                    task: str | None = None) -> None: ...
    def add_task(self, task_id: str, pet: Any, *, max_lora_rank: int | None = None) -> Any: ...
    def remove_task(self, task_id: str) -> None: ...
    def push_hidden(self, request_id: str, hidden: Any) -> None: ...
    def push_token(self, request_id: str, token_id: int) -> None: ...
    def cancel(self, request_id: str) -> None: ...
    def has_request(self, request_id: str) -> bool: ...
    def step(self) -> Any: ...
    def kv_usage(self) -> Any: ...
    # the layers held, while they change (node_agent.membership)
    model_dir: Any
    @property
    def held(self) -> tuple[LayerRange, ...]: ...
    @property
    def weight_bytes(self) -> int: ...
    def holds(self, start: int, end: int) -> bool: ...
    def layer_model(self) -> Any: ...  # node_agent.model.StageModel
    def insert_layers(self, parts: Any, start: int, end: int) -> None: ...
    def drop_layers(self, keep_start: int, keep_end: int) -> tuple[int, ...]: ...
    def requests_on(self, layers: set[int]) -> list[str]: ...


class Send(Protocol):
    """Send ``msg`` to ``address`` (a peer whose vertex is ``vertex``); ``""``: to a coordinator."""

    def __call__(self, address: str, msg: wire.Message, identity: bytes | None = None, vertex: str = "") -> None: ...


@dataclass(slots=True)
class AgentStats:
    """The agent's counters: the route table counts refusals and tokens, the agent rejections and steps."""

    rejected: int = 0
    refused: int = 0
    steps: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Route:
    """The agent's view of one request: where it sits in its pipeline and where results go."""

    pipeline: tuple[wire.StageRef, ...]
    hop: int
    sampling: wire.SamplingSpec
    max_tokens: int
    prompt_tokens: int
    reply_to: str
    task: str = ""  # "" = the base model
    step: int = 0
    sent_tokens: int = 0  # positions already forwarded to the next stage
    forwarded: bool = False  # the next stage has its admission already

    @property
    def is_last(self) -> bool:
        return self.hop == len(self.pipeline) - 1


Admission = Callable[[int, int], tuple[ErrorCode, str] | None]
"""Whether a new request on layers ``[start, end)`` is turned away here, and why (None: it is not)."""


class RouteTable:
    """The routes of the requests this node serves (engine thread only)."""

    def __init__(self, node_id: str, engine: StageEngineLike, peers: PeerPolicy | None, wire_dtype: str,
                 send: Send, stats: AgentStats, admission: Admission | None = None) -> None:  # fmt: skip
        self.node_id, self.engine, self.peers, self.wire_dtype = node_id, engine, peers, wire_dtype
        self._send, self.stats, self.admission = send, stats, admission
        self.routes: dict[str, Route] = {}
        self.tombstones: OrderedDict[str, None] = OrderedDict()

    def refuse(self, request_ids: Iterable[str], code: ErrorCode, reason: str) -> None:
        """Refuse requests this node serves (REFUSED to their coordinators; unknown ids are forgotten)."""
        for rid in list(request_ids):
            route = self.routes.get(rid)
            if route is None:
                self._forget(rid)
            else:
                self._refuse(rid, route, code, reason)

    def on_admit(self, msg: wire.Admit) -> None:
        me = msg.pipeline[0].stage
        if me.node != self.node_id:
            raise ProtocolError(f"ADMIT for {msg.request_id!r} names {me.node!r} as first stage, not this node")
        self._check_route(msg.request_id, msg.pipeline, 0, msg.reply_to)
        route = Route(msg.pipeline, 0, msg.sampling, msg.max_tokens, len(msg.prompt), msg.reply_to, msg.task)
        self.tombstones.pop(msg.request_id, None)
        self._add(msg.request_id, route, prompt=list(msg.prompt))

    def on_step(self, msg: wire.Step) -> None:
        route = self.routes.get(msg.request_id)
        if route is None or not self.engine.has_request(msg.request_id):
            log.debug("STEP for unknown request %s (finished or cancelled): dropped", msg.request_id)
            return
        if route.is_last:  # a one-stage pipeline: the engine holds the whole model for it
            if not route.sampling.paced:
                return  # and loops its tokens back itself
        else:
            route.step = msg.step
        self.engine.push_token(msg.request_id, msg.token_id)

    def on_cancel(self, msg: wire.Cancel) -> None:
        route = self.routes.get(msg.request_id)
        if msg.reason.startswith("unreachable:") and route is not None:
            reason = f"next stage at {msg.reason[12:]} is not reachable"
            self._refuse(msg.request_id, route, ErrorCode.UNREACHABLE, reason)
        else:
            self._forget(msg.request_id)

    def on_activations(self, msg: wire.Activations) -> None:
        rid = msg.request_id
        if rid in self.tombstones:
            return
        if rid not in self.routes:
            if msg.admit is None:
                log.debug("ACTIVATIONS for unknown request %s without admission: dropped", rid)
                return
            a = msg.admit
            if a.hop == 0 or a.pipeline[a.hop].stage.node != self.node_id:
                raise ProtocolError(f"ACTIVATIONS for {rid!r}: hop {a.hop} of its pipeline is not this node")
            self._check_route(rid, a.pipeline, a.hop, a.reply_to)
            route = Route(a.pipeline, a.hop, a.sampling, a.max_tokens, a.prompt_tokens, a.reply_to, a.task)
            if not self._add(rid, route, prompt=None):
                return
        try:
            self.engine.push_hidden(rid, frame_tensor(msg))
        except HelixError as exc:
            self._refuse(rid, self.routes[rid], ErrorCode.BAD_REQUEST, str(exc))

    def deliver(self, outputs: Iterable[Any]) -> None:
        """Send one engine step's outputs: hidden states to the next stage, tokens to the coordinators."""
        tokens: dict[str, list[wire.TokenOut]] = {}
        for out in outputs:
            route = self.routes.get(out.request_id)
            if route is None:
                continue
            if out.hidden is not None:
                self._forward(out.request_id, route, out.hidden)
            elif out.token is not None:
                route.step += 1
                reason = None if out.finish_reason is None else FinishReason(out.finish_reason)
                out_token = wire.TokenOut(out.request_id, route.step - 1, out.token, reason)
                tokens.setdefault(route.reply_to, []).append(out_token)
                if reason is not None:
                    self.routes.pop(out.request_id, None)
        for reply_to, outs in tokens.items():
            self.stats.tokens += len(outs)
            self._reply(reply_to, wire.Tokens(self.node_id, tuple(outs)))

    def _check_route(self, rid: str, pipeline: tuple[wire.StageRef, ...], hop: int, reply_to: str) -> None:
        """ProtocolError unless every address this node would send the request's results to (the later
        stages', ``reply_to``) is where the cluster file puts that vertex (no-op without a cluster policy)."""
        policy = self.peers
        if policy is None:
            return
        for ref in pipeline[hop + 1:]:
            policy.check_address(ref.stage.node, ref.address, f"request {rid!r}: stage address")
        policy.check_address(policy.coordinator, reply_to, f"request {rid!r}: reply_to")

    def _forget(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        self.routes.pop(request_id, None)
        self.tombstones[request_id] = None
        while len(self.tombstones) > TOMBSTONES:
            self.tombstones.popitem(last=False)

    def _add(self, rid: str, route: Route, prompt: list[int] | None) -> bool:
        if rid in self.routes:
            raise ProtocolError(f"request {rid!r} is already admitted on this node")
        me = route.pipeline[route.hop].stage
        turned_away = self.admission(me.layer_start, me.layer_end) if self.admission is not None else None
        if turned_away is not None:
            self._refuse(rid, route, *turned_away)
            return False
        try:
            self.engine.add_request(rid, sampling_params(route.sampling, route.max_tokens),
                                    prompt_token_ids=prompt, prompt_len=route.prompt_tokens,
                                    layer_range=(me.layer_start, me.layer_end), task=route.task or None)
        except CapacityError as exc:
            self._refuse(rid, route, ErrorCode.CAPACITY, exc.message)
            return False
        except HelixError as exc:
            self._refuse(rid, route, ErrorCode.BAD_REQUEST, exc.message)
            return False
        self.routes[rid] = route
        return True

    def _refuse(self, rid: str, route: Route, code: ErrorCode, reason: str) -> None:
        log.warning("refused request %s (%s): %s", rid, code, reason)
        self.stats.refused += 1
        self._forget(rid)
        self._reply(route.reply_to, wire.Refused(rid, self.node_id, code, reason))

    def _reply(self, reply_to: str, msg: wire.Message) -> None:
        coordinator = self.peers.coordinator if self.peers is not None else ""
        self._send(reply_to, msg, vertex=coordinator)

    def _forward(self, rid: str, route: Route, hidden: Any) -> None:
        nxt = route.pipeline[route.hop + 1]
        shape, data = tensor_frame(hidden, self.wire_dtype)
        admit = None
        if not route.forwarded:
            admit = wire.AdmitInfo(route.hop + 1, route.prompt_tokens, route.max_tokens, route.sampling,
                                   route.pipeline, route.reply_to, route.task)
        position, route.sent_tokens = route.sent_tokens, route.sent_tokens + shape[0]
        self._send(nxt.address, wire.Activations(rid, route.step, position, self.wire_dtype, shape, data, admit),
                   vertex=nxt.stage.node)
        route.forwarded = True
