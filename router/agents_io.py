"""The coordinator's side of the wire: connections to node agents (pure transport, no HTTP).

:class:`AgentsIO` owns one background I/O thread (a :class:`helix.zmq_io.IOLoop`) and every ZeroMQ
socket of the coordinator:

* one DEALER per agent to its control socket: the shared-secret handshake
  (:class:`helix.handshake.CoordinatorHandshake`: HELLO -> CHALLENGE -> AUTH -> WELCOME, both sides
  prove the secret), then ADMIT / STEP / CANCEL, LOAD_TASK / UNLOAD_TASK and SET_LAYERS /
  RELEASE_LAYERS out, HEARTBEATs, TASK_STATUS, LAYERS and LEAVING in;
* one PULL (the data plane's sink) where last stages push TOKENS and any stage pushes REFUSED.

With ``curve`` (the coordinator's keys and the agents', :func:`helix.keys.coordinator_keys`) every one of these
sockets runs ZeroMQ CURVE (:class:`helix.zmq_io.CurveSockets`): each DEALER expects its agent's public
key, the sink lets in only the agents' keys, and refused handshakes are logged.

It is a pipe: it knows no requests. :meth:`AgentsIO.send` delivers the messages the coordinator core
(:mod:`router.core`, through :mod:`router.driver`) decided on; everything the agents say comes back
as one event stream (``on_event``): ``wire.Tokens``, ``wire.Refused``, ``wire.Layers`` and
``wire.Leaving`` as they arrive, :class:`~router.agent_events.AgentJoined` after a handshake,
:class:`~router.agent_events.AgentDied` when an agent's heartbeats stop for ``dead_after_s`` (it is
then re-handshaken until it answers again; :class:`~router.agent_events.AgentLeft` instead when it
had said LEAVING), :class:`~router.agent_events.Unreachable` when an ADMIT or STEP could not be
sent, and a failed ``wire.Layers`` at once when a SET_LAYERS / RELEASE_LAYERS could not. Agents may
be added (a node joining) and removed while it runs (:meth:`AgentsIO.add_agent`,
:meth:`AgentsIO.remove_agent`). TASK_STATUS goes to ``on_task_status``; the latest heartbeats are
read with :meth:`kv_reports`.

Callbacks run on the I/O thread and must be quick. All public methods are thread-safe.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from helix import wire
from helix.errors import ProtocolError
from helix.handshake import CoordinatorHandshake
from helix.keys import RESULTS, CurveKeys, KeyGuard
from helix.zmq_io import CurveSockets, Frames, IOLoop
from router.agent_events import AgentDied, AgentEvent, AgentJoined, AgentLeft, KVReport, Unreachable

log = logging.getLogger(__name__)

HELLO_RETRY_S = 1.0
TICK_S = 0.05  # how often heartbeats are checked and HELLOs retried
SINK_DRAIN = 1024  # messages taken from one socket per turn (tokens of many requests arrive together)


@dataclass(slots=True)
class AgentState:
    node_id: str
    control_address: str
    alive: bool = False
    welcome: wire.Welcome | None = None
    heartbeat: wire.Heartbeat | None = None
    heartbeat_at: float = 0.0
    last_seen: float = 0.0
    sock: Any = None
    handshake: CoordinatorHandshake | None = None
    hello_at: float = 0.0
    auth_error: str | None = None
    leaving: bool = False  # it said LEAVING: when its heartbeats stop it left (AgentLeft), it did not crash


class AgentsIO:
    """Connections to a set of agents (``node_id -> control address``); see the module doc."""

    def __init__(self, agents: Mapping[str, str], *, secret: bytes = b"", name: str = "coordinator",
                 bind_host: str = "127.0.0.1", dead_after_s: float = 1.0,
                 on_event: Callable[[AgentEvent], None] | None = None,
                 on_task_status: Callable[[wire.TaskStatus], None] | None = None,
                 max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
                 curve: CurveKeys | None = None) -> None:  # fmt: skip
        self.secret, self.name, self.dead_after_s = secret, name, dead_after_s
        self.on_event = on_event
        self.on_task_status = on_task_status
        self.max_frame_bytes = max_frame_bytes
        self.agent_keys = dict(curve.peers) if curve is not None else {}  # node -> CURVE public key
        missing = sorted(set(agents) - set(self.agent_keys)) if curve is not None else []
        if missing:
            raise ProtocolError(f"no CURVE public key for agents {', '.join(missing)}")
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.curve = None if curve is None else \
            CurveSockets(self.ctx, curve.own, KeyGuard(name, {RESULTS: self.agent_keys}, self.agent_keys))
        self.sink = self.ctx.socket(zmq.PULL)
        self.sink.setsockopt(zmq.LINGER, 0)
        self.sink.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + 4096)
        if self.curve is not None:
            self.curve.serve(self.sink, RESULTS)
        self.sink.bind(f"tcp://{bind_host}:*")
        self.reply_to: str = self.sink.getsockopt_string(zmq.LAST_ENDPOINT)
        self._agents = {n: AgentState(n, a) for n, a in agents.items()}
        self._lock = threading.Lock()
        self._loop = IOLoop(tick_s=TICK_S, on_tick=self._check_liveness, max_drain=SINK_DRAIN)
        self._thread = threading.Thread(target=self._run, name="agents-io", daemon=True)
        self.rejected = 0

    # -- public API (any thread) ----------------------------------------------------------------

    def start(self) -> AgentsIO:
        self._thread.start()
        return self

    def close(self) -> None:
        self._loop.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._loop.close()
        if self.curve is not None:
            self.curve.close()
        self.ctx.destroy(linger=0)

    def __enter__(self) -> AgentsIO:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, nodes: Iterable[str] | None = None, timeout_s: float = 30.0) -> bool:
        """Block until ``nodes`` (default: all) completed the handshake; False on timeout."""
        wanted = set(self._agents if nodes is None else nodes)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if wanted <= self.alive_nodes():
                return True
            time.sleep(0.02)
        return False

    def alive_nodes(self) -> set[str]:
        with self._lock:
            return {n for n, a in self._agents.items() if a.alive}

    def agents(self) -> dict[str, AgentState]:
        """A snapshot of every agent's state (alive, WELCOME, last heartbeat)."""
        with self._lock:
            return {n: AgentState(a.node_id, a.control_address, a.alive, a.welcome, a.heartbeat, a.heartbeat_at,
                                  a.last_seen, auth_error=a.auth_error) for n, a in self._agents.items()}  # fmt: skip

    def kv_reports(self) -> dict[str, KVReport]:
        """Latest KV usage, queue lengths and step statistics per alive agent that has sent a heartbeat."""
        now = time.monotonic()
        with self._lock:
            return {n: KVReport(n, hb.kv_used_tokens, hb.kv_reserved_tokens, hb.kv_capacity_tokens, hb.waiting,
                                hb.running, now - a.heartbeat_at, hb.steps)
                    for n, a in self._agents.items() if a.alive and (hb := a.heartbeat) is not None}  # fmt: skip

    def send(self, messages: Sequence[tuple[str, wire.Message]], *, from_io_thread: bool = False) -> None:
        """Send ``(node, message)`` pairs in order. From the I/O thread (inside ``on_event``) they leave at
        once, after anything queued before them; from other threads they are queued in call order."""
        if from_io_thread:
            self._loop.run_pending()
            self._send_all(list(messages))
        else:
            self._loop.call(functools.partial(self._send_all, list(messages)))

    def _send_all(self, messages: list[tuple[str, wire.Message]]) -> None:
        for node, msg in messages:
            self._send(node, msg)

    def add_agent(self, node_id: str, control_address: str) -> None:
        """Connect to one more agent (a node joining); an agent of that id already known is dialed anew
        at ``control_address``. Its handshake ends in :class:`~router.agent_events.AgentJoined` as at start."""
        if self.curve is not None and node_id not in self.agent_keys:
            raise ProtocolError(f"no CURVE public key for agent {node_id!r}: nodes join only without CURVE keys")

        def add() -> None:
            old = self._agents.get(node_id)
            if old is not None and old.alive and old.control_address == control_address:
                return
            agent = AgentState(node_id, control_address, sock=old.sock if old is not None else None)
            with self._lock:
                self._agents[node_id] = agent
            self._connect(agent)  # closes the old socket

        self._loop.call(add)

    def remove_agent(self, node_id: str) -> None:
        """Stop talking to ``node_id`` (it left the cluster): its socket closes, no event follows."""

        def remove() -> None:
            with self._lock:
                agent = self._agents.pop(node_id, None)
            if agent is not None and agent.sock is not None:
                self._loop.unwatch(agent.sock)
                agent.sock.close(linger=0)

        self._loop.call(remove)

    def send_task(self, node_id: str, msg: wire.LoadTask | wire.UnloadTask) -> None:
        """Send LOAD_TASK / UNLOAD_TASK to ``node_id``; its TASK_STATUS goes to ``on_task_status`` (a
        failed one at once if the agent is not connected)."""
        self._loop.call(lambda: self._send_task(node_id, msg))

    # -- internals (I/O thread) -----------------------------------------------------------------

    def _run(self) -> None:
        self._loop.watch(self.sink, self._on_sink)
        if self.curve is not None:
            self.curve.watch(self._loop)
        for agent in self._agents.values():
            self._connect(agent)
        try:
            self._loop.run()
        finally:
            for agent in self._agents.values():
                if agent.sock is not None:
                    agent.sock.close(linger=0)
            self.sink.close(linger=0)

    def _connect(self, agent: AgentState) -> None:
        if agent.sock is not None:
            self._loop.unwatch(agent.sock)
            agent.sock.close(linger=0)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes + 4096)
        if self.curve is not None:
            self.curve.dial(sock, self.agent_keys[agent.node_id])
        sock.connect(agent.control_address)
        self._loop.watch(sock, functools.partial(self._on_control, agent))
        agent.sock = sock
        agent.handshake = CoordinatorHandshake(self.secret, self.name, agent.node_id)
        agent.hello_at = time.monotonic()
        self._send_raw(agent, agent.handshake.start())

    def _send_raw(self, agent: AgentState, msg: wire.Message) -> bool:
        try:
            agent.sock.send_multipart(wire.encode(msg), flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            log.warning("agent %s is not taking messages: dropped %s", agent.node_id, type(msg).__name__)
            return False

    def _send(self, node_id: str, msg: wire.Message) -> None:
        agent = self._agents.get(node_id)
        if agent is None or not agent.alive or not self._send_raw(agent, msg):
            if isinstance(msg, wire.Admit | wire.Step):
                self._emit(Unreachable(node_id, msg.request_id))
            elif isinstance(msg, wire.SetLayers | wire.ReleaseLayers):
                op = "load" if isinstance(msg, wire.SetLayers) else "release"
                self._emit(wire.Layers(node_id, msg.version, op, 0, 0, error=f"node {node_id!r} is not connected"))

    def _send_task(self, node_id: str, msg: wire.LoadTask | wire.UnloadTask) -> None:
        agent = self._agents.get(node_id)
        if agent is None or not agent.alive or not self._send_raw(agent, msg):
            op = "load" if isinstance(msg, wire.LoadTask) else "unload"
            self._task_status(wire.TaskStatus(node_id, msg.task_id, op, False, f"node {node_id!r} is not connected"))

    def _task_status(self, status: wire.TaskStatus) -> None:
        if self.on_task_status is not None:
            try:
                self.on_task_status(status)
            except Exception:  # a caller's bug must not kill the I/O thread
                log.exception("task status callback failed")

    def _on_control(self, agent: AgentState, frames: Frames) -> None:
        try:
            msg = wire.decode(frames, max_frame_bytes=self.max_frame_bytes)
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("agent %s sent a bad message: %s", agent.node_id, exc.message)
            return
        now = time.monotonic()
        if isinstance(msg, wire.Challenge | wire.Welcome | wire.Error) and agent.handshake is not None:
            if isinstance(msg, wire.Error):
                log.warning("agent %s: error %s: %s", agent.node_id, msg.code, msg.reason)
            outcome = agent.handshake.on_message(msg)
            for reply in outcome.replies:
                self._send_raw(agent, reply)
            if outcome.error is not None:
                agent.auth_error = outcome.error
                log.error("agent %s at %s: %s", agent.node_id, agent.control_address, outcome.error)
            elif outcome.trusted and isinstance(msg, wire.Welcome):
                with self._lock:
                    agent.welcome, agent.alive, agent.last_seen, agent.auth_error = msg, True, now, None
                    agent.leaving = False
                log.info("agent %s is alive (layers [%d, %d))", agent.node_id, msg.layer_start, msg.layer_end)
                self._emit(AgentJoined(agent.node_id, msg))
        elif isinstance(msg, wire.Heartbeat) and agent.alive:
            with self._lock:
                agent.heartbeat, agent.heartbeat_at, agent.last_seen = msg, now, now
        elif isinstance(msg, wire.Tokens | wire.Refused):
            self._emit(msg)
        elif isinstance(msg, wire.Layers | wire.Leaving) and msg.node_id == agent.node_id and agent.alive:
            if isinstance(msg, wire.Leaving):
                log.info("agent %s is leaving: it drains %d requests within %.0f s", agent.node_id, msg.running,
                         msg.drain_s)  # fmt: skip
                agent.leaving = True
            self._emit(msg)
        elif isinstance(msg, wire.TaskStatus) and msg.node_id == agent.node_id:
            self._task_status(msg)

    def _on_sink(self, frames: Frames) -> None:
        try:
            msg = wire.decode(frames, max_frame_bytes=self.max_frame_bytes)
            if not isinstance(msg, wire.Tokens | wire.Refused):
                raise ProtocolError(f"{wire.KINDS[type(msg)]} is not accepted on the coordinator's sink")
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("rejected a data-plane message: %s", exc.message)
            return
        self._emit(msg)

    def _emit(self, event: AgentEvent) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(event)
        except Exception:  # a caller's bug must not kill the I/O thread
            log.exception("event handler failed on %s", type(event).__name__)

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for agent in self._agents.values():
            if agent.alive and now - agent.last_seen > self.dead_after_s:
                with self._lock:
                    agent.alive = False
                if agent.leaving:
                    log.info("agent %s left", agent.node_id)
                    self._emit(AgentLeft(agent.node_id))
                else:
                    log.warning("agent %s missed its heartbeats for %.1f s: dead", agent.node_id,
                                now - agent.last_seen)  # fmt: skip
                    self._emit(AgentDied(agent.node_id))
                self._connect(agent)
            elif not agent.alive and now - agent.hello_at > HELLO_RETRY_S and agent.handshake is not None:
                agent.hello_at = now  # same socket and nonce: a late CHALLENGE still verifies
                self._send_raw(agent, agent.handshake.hello())
