"""The ZeroMQ node agent: drives one :class:`~node_agent.engine.StageEngine` step by step.

Sockets (all bound to loopback unless told otherwise):

* **control** (ROUTER): coordinators connect here, prove the shared secret (HELLO -> CHALLENGE
  -> AUTH -> WELCOME), then send ADMIT / STEP / CANCEL, LOAD_TASK / UNLOAD_TASK and SET_LAYERS /
  RELEASE_LAYERS; the agent sends HEARTBEATs (KV usage, queue lengths and its engine steps' times
  and batch sizes, every ~250 ms), ERRORs, TASK_STATUS, LAYERS and LEAVING back on it.
* **data** (PULL): ACTIVATIONS from the previous stage of any request's pipeline.
* outgoing PUSH sockets (one per peer): ACTIVATIONS to each request's next stage, TOKENS and
  REFUSED to the request's coordinator (``reply_to``).

Two threads. The *I/O thread* (``run``, a :class:`helix.zmq_io.IOLoop`) owns the bound sockets: it
decodes and validates messages, runs the handshake (:class:`helix.handshake.AgentHandshake`, one per
coordinator connection), sends heartbeats on time (the loop's tick) even while a long step runs, and
sends what the engine thread queues for the coordinators (ERRORs, TASK_STATUS). The *engine thread* owns the engine, all request state
and the outgoing PUSH sockets (Orca's iteration-level loop): apply arrivals, run one step, send
its ACTIVATIONS/TOKENS/REFUSED at once (ZeroMQ's own I/O threads move the bytes), repeat; so
receiving overlaps computation and a step's results leave without a thread hand-over. A bad
message is rejected (ERROR to the sender on the control plane, a log line on the data plane)
and the agent keeps serving everyone else.

Who may talk to the agent (docs/gpu.md, :mod:`helix.keys`): with the cluster's CURVE keys every
socket is encrypted; the control socket lets in only the coordinator's key, the data socket only
the keys of the coordinator and of the nodes that can precede this one in the plan; a refused
handshake is logged. Results go out only to addresses the cluster file allows: an ADMIT (or a
first ACTIVATIONS) whose ``reply_to`` or next stage names another host is refused (ERROR, logged)
and the agent keeps serving; under CURVE each peer is dialled expecting its own public key, so
even an address on an allowed host gets nothing unless the right key answers.

Fine-tuned tasks (docs/pets.md): LOAD_TASK names a task directory the agent reads itself (the
coordinator sends no tensors); the engine thread reads only the tensors of the layers this stage
holds (:func:`node_agent.task_files.load_task_slice`), binds them between two steps and answers
TASK_STATUS to the coordinator that asked (an error names the file and the tensor; the tasks
already bound are untouched). UNLOAD_TASK unbinds a task; requests running it keep it until they
finish. A request's task travels in ADMIT and in its first ACTIVATIONS' admission.

Live membership (issue 18, :mod:`node_agent.membership`): SET_LAYERS loads a new layer range on a
loader thread while the engine serves the old one (the engine thread inserts it between two steps
and answers LAYERS); RELEASE_LAYERS frees the layers outside it once no request runs them. SIGTERM
makes the agent leave: it tells its coordinators (LEAVING), refuses new requests (REFUSED
"leaving", retryable), finishes what it runs within ``drain_timeout_s`` (while a coordinator is
connected to finish them), refuses what is left and exits; a second SIGTERM, or SIGINT, stops it
at once.

This module is the shell: the sockets, the two threads and the hand-over between them. The request
routes (admission, STEP, CANCEL, refusals, sending a step's results on) are
:class:`node_agent.routes.RouteTable`'s; the coordinators' handshakes and heartbeats and the answers
to LOAD_TASK / UNLOAD_TASK are :mod:`node_agent.control`'s.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from helix import wire
from helix.domain import ErrorCode
from helix.errors import HelixError, ProtocolError
from helix.keys import CONTROL, DATA, KeyGuard, KeyPair, PeerPolicy
from helix.zmq_io import CurveSockets, Frames, IOLoop
from node_agent.control import Coordinators, task_status
from node_agent.membership import Drain, LayerChanges
from node_agent.routes import AgentStats, RouteTable, StageEngineLike
from node_agent.step_log import StepLog
from node_agent.step_meter import StepMeter
from node_agent.transport import PushPool, configure

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AgentConfig:
    node_id: str
    control_bind: str = "tcp://127.0.0.1:*"
    data_bind: str = "tcp://127.0.0.1:*"
    secret: bytes = b""
    wire_dtype: str = "float32"  # "bfloat16" halves activation bytes (not bit-exact with fp32 runs)
    heartbeat_interval_s: float = 0.25
    max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES
    # an idle engine woken by an arrival waits this long so one upstream step's messages (one per
    # request) join one step here: fewer, fuller steps (decode is memory-bound: a step streams all weights)
    gather_window_s: float = 0.003
    torch_threads: int | None = None  # set in the engine thread too (OpenMP thread counts are per thread)
    step_log: str | None = None  # write one JSON line per engine step here (StepLog)
    peers: PeerPolicy | None = None  # the cluster's keys and hosts (helix.keys); None: no checks, no CURVE
    key_pair: KeyPair | None = None  # this node's CURVE keys (needed when ``peers`` has keys)
    predecessors: frozenset[str] = frozenset()  # nodes whose activations the data socket lets in (with CURVE)
    drain_timeout_s: float = 30.0  # a leaving agent (SIGTERM) finishes its requests within this long
    max_weight_bytes: int | None = None  # the most bytes of weights SET_LAYERS may bring it to (None: free memory)


class NodeAgent:
    """One node's agent. ``run()`` blocks until :meth:`stop` (or SIGTERM/SIGINT via ``install_signals``)."""

    def __init__(self, config: AgentConfig, engine: StageEngineLike, ctx: zmq.Context[Any] | None = None) -> None:
        self.config, self.engine = config, engine
        self.ctx = ctx or zmq.Context.instance()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.data = self.ctx.socket(zmq.PULL)
        self.curve = self._curve_sockets(config)
        for sock, plane in ((self.control, CONTROL), (self.data, DATA)):
            configure(sock)
            # hard memory guard; frames between the limit and this are rejected by decode (logged)
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_frame_bytes + 65536)
            if self.curve is not None:
                self.curve.serve(sock, plane)
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.control.bind(config.control_bind)
        self.data.bind(config.data_bind)
        self.control_address: str = self.control.getsockopt_string(zmq.LAST_ENDPOINT)
        self.data_address: str = self.data.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peers = PushPool(self.ctx, self.curve)
        self._coordinators = Coordinators(self.control, config.secret, config.node_id, self._welcome)  # I/O thread
        self._stopping = False
        self._work = threading.Event()
        self.stats = AgentStats()
        self._routes = RouteTable(config.node_id, engine, config.peers, config.wire_dtype, self._out, self.stats,
                                  self._admission)  # fmt: skip
        self.layers = LayerChanges(config.node_id, engine, reply=lambda identity, msg: self._out("", msg, identity),
                                   refuse=self._routes.refuse, wake=self._work.set,
                                   kv_capacity_tokens=engine.kv_usage().capacity_tokens,
                                   max_weight_bytes=config.max_weight_bytes, threads=config.torch_threads)
        self._drain = Drain(config.drain_timeout_s)  # engine thread
        self._leave = False  # SIGTERM: drain, then stop
        # I/O thread -> engine thread: decoded messages (with the control identity, if any)
        # (handed over in batches: all messages of one drain join the same engine step)
        self._inbox: deque[list[tuple[bytes | None, wire.Message]]] = deque()
        self._arrivals: list[tuple[bytes | None, wire.Message]] = []  # I/O thread, not yet handed over
        # the I/O thread's loop; the engine thread queues its messages for the coordinators on it (it sends
        # to peers itself: self.peers is its own)
        self.loop = IOLoop(tick_s=config.heartbeat_interval_s, on_tick=self._heartbeat, after_turn=self._hand_over)
        self.loop.watch(self.control, self._on_control_frames)
        self.loop.watch(self.data, self._on_data_frames)
        if self.curve is not None:
            self.curve.watch(self.loop)
        self._kv = engine.kv_usage()
        self._queues = (0, 0)
        self._meter = StepMeter()  # engine thread records, the heartbeat reads its snapshot
        # opened here, so a path that cannot be written is a start-up error, not a dead engine thread
        self._step_log = StepLog(config.step_log) if config.step_log else None
        self.failed = False  # the engine thread died with an exception

    def _curve_sockets(self, config: AgentConfig) -> CurveSockets | None:
        policy = config.peers
        if policy is None or not policy.curve:
            return None
        if config.key_pair is None:
            raise HelixError(f"node {config.node_id!r}: the cluster has CURVE keys but the agent has no key pair")
        coordinator = {policy.coordinator: policy.public_keys[policy.coordinator]}
        senders = {n: policy.public_keys[n] for n in config.predecessors if n in policy.public_keys}
        guard = KeyGuard(config.node_id, {CONTROL: coordinator, DATA: {**coordinator, **senders}}, policy.public_keys)
        return CurveSockets(self.ctx, config.key_pair, guard)

    # -- lifecycle ------------------------------------------------------------------------------

    def install_signals(self) -> None:
        """SIGTERM: :meth:`leave` (a second one: :meth:`stop`); SIGINT: :meth:`stop`."""
        signal.signal(signal.SIGTERM, lambda *_: self.stop() if self._leave else self.leave())
        signal.signal(signal.SIGINT, lambda *_: self.stop())

    def leave(self) -> None:  # any thread (a signal handler too)
        """Drain, then stop: no new requests, the running ones finish within ``drain_timeout_s``."""
        self._leave = True
        self._work.set()

    def stop(self) -> None:  # any thread (a signal handler too)
        self._stopping = True
        self._work.set()
        self.loop.stop()

    def close(self) -> None:
        self.control.close()
        self.data.close(linger=0)
        if self.curve is not None:
            self.curve.close()
        self.loop.close()

    def run(self) -> None:
        """The I/O loop (call from the main thread); starts and joins the engine thread (either one ending
        ends the other)."""
        engine_thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        engine_thread.start()
        try:
            self.loop.run()
        finally:
            self.stop()
            engine_thread.join(timeout=10)
            self.loop.run_pending()  # what the engine thread queued last (LEAVING, LAYERS)
            if self._leave:  # let it reach the coordinators
                self.control.setsockopt(zmq.LINGER, 1000)
            self.close()

    def _to_engine(self, identity: bytes | None, msg: wire.Message) -> None:  # I/O thread
        self._arrivals.append((identity, msg))

    def _hand_over(self) -> None:  # I/O thread
        if self._arrivals:
            self._inbox.append(self._arrivals)
            self._arrivals = []
            self._work.set()

    def _out(self, address: str, msg: wire.Message, identity: bytes | None = None, vertex: str = "") -> None:
        """Send ``msg`` to a peer (the next stage, a coordinator's sink: ``vertex``, whose CURVE key the
        connection expects) from this thread (with a hand-over to the I/O thread a stage-to-stage hop
        took 1.6 ms median, 3.0 mean on the loaded demo host; without, 0.8 and 1.6); ``""``: the
        coordinator ``identity`` (None: every one) on the control socket, which the I/O thread owns."""
        if address:
            key = self.config.peers.key_of(vertex) if self.config.peers is not None else None
            if not self.peers.send(address, msg, key) and isinstance(msg, wire.Activations):
                # the next stage is gone: cancel here, applied at the top of the next loop turn
                self._inbox.append([(None, wire.Cancel(msg.request_id, f"unreachable:{address}"))])
            return
        self.loop.call(lambda: self._coordinators.send_to(identity, msg))

    def _engine_loop(self) -> None:
        """Iteration-level loop: apply arrivals, run one step, queue what it produced."""
        if self.config.torch_threads is not None:
            import torch

            torch.set_num_threads(self.config.torch_threads)
        step_log = self._step_log
        try:
            while not self._stopping:
                while self._inbox:
                    for identity, msg in self._inbox.popleft():
                        try:
                            self._apply(msg, identity)
                        except ProtocolError as exc:
                            self._reject("engine", exc)
                            if identity is not None:
                                self._out("", wire.Error("protocol", exc.message), identity)
                now = time.monotonic()
                self.layers.poll(now)
                if self._leave and self._drained(now):
                    break
                busy = self._step(step_log)
                sched = getattr(self.engine, "scheduler", None)
                self._kv = self.engine.kv_usage()
                if sched is not None:
                    self._queues = (len(sched.waiting), len(sched.running))
                if not busy:
                    if self._work.wait(0.05) and self.config.gather_window_s > 0:
                        time.sleep(self.config.gather_window_s)  # let the rest of a burst arrive
                    self._work.clear()
        except Exception:
            log.exception("the engine failed; the agent stops")
            self.failed = True
            raise
        finally:
            self.stop()
            self.peers.close(linger_ms=1000 if self._leave else 0)  # its sockets: closed by the thread that used them
            if step_log is not None:
                step_log.close()

    def _apply(self, msg: wire.Message, identity: bytes | None = None) -> None:  # engine thread
        if isinstance(msg, wire.LoadTask | wire.UnloadTask):
            self._out("", task_status(self.config.node_id, self.engine, msg), identity)
        elif isinstance(msg, wire.Admit):
            self._routes.on_admit(msg)
        elif isinstance(msg, wire.Step):
            self._routes.on_step(msg)
        elif isinstance(msg, wire.Cancel):
            self._routes.on_cancel(msg)
        elif isinstance(msg, wire.Activations):
            self._routes.on_activations(msg)
        elif isinstance(msg, wire.SetLayers):
            self.layers.on_set(msg, identity)
        elif isinstance(msg, wire.ReleaseLayers):
            self.layers.on_release(msg, identity)

    # -- membership: new admissions, leaving ----------------------------------------------------

    def _admission(self, start: int, end: int) -> tuple[ErrorCode, str] | None:  # engine thread
        if self._drain.started:
            return ErrorCode.LEAVING, f"node {self.config.node_id!r} is leaving (it drains before it stops)"
        moved = self.layers.refusal(start, end)
        return None if moved is None else (ErrorCode.LAYERS_MOVED, moved)

    def _drained(self, now: float) -> bool:  # engine thread
        """Whether the leaving agent may stop: its requests are done, or refused once its drain time is up."""
        if not self._drain.started:
            self._drain.start(now)
            self.layers.closed = f"node {self.config.node_id!r} is leaving: its layers no longer change"
            running = len(self._routes.routes)
            log.info("leaving: draining %d requests (for at most %.0f s)", running, self._drain.timeout_s)
            self._out("", wire.Leaving(self.config.node_id, self._drain.timeout_s, running))
        if self._routes.routes and (self._drain.up(now) or not self._coordinators.connected):
            why = f"its drain time ({self._drain.timeout_s:g} s) is up" if self._drain.up(now) else \
                "no coordinator is connected to finish its requests"
            self._routes.refuse(list(self._routes.routes), ErrorCode.LEAVING,
                                f"node {self.config.node_id!r} left: {why}")  # fmt: skip
        return not self._routes.routes

    # -- control plane --------------------------------------------------------------------------

    def _on_control_frames(self, frames: Frames) -> None:
        identity, body = frames[0].bytes, frames[1:]
        try:
            msg = wire.decode(body, max_frame_bytes=self.config.max_frame_bytes)
            if isinstance(msg, wire.Hello | wire.Auth):
                self._coordinators.handshake(identity, msg)
            elif identity not in self._coordinators:
                raise ProtocolError(f"{wire.KINDS[type(msg)]} before the handshake: send HELLO first")
            elif isinstance(msg, wire.Admit | wire.Step | wire.Cancel | wire.LoadTask | wire.UnloadTask | wire.SetLayers
                             | wire.ReleaseLayers):
                self._to_engine(identity, msg)
            else:
                raise ProtocolError(f"{wire.KINDS[type(msg)]} is not accepted on an agent's control socket")
        except ProtocolError as exc:
            self._reject("control", exc, identity)

    def _welcome(self) -> wire.Welcome:
        view = self.layers.welcome  # the engine thread's snapshot
        return wire.Welcome(self.config.node_id, view.layer_start, view.layer_end, self._kv.capacity_tokens,
                            self.data_address, view.version, view.held)  # fmt: skip

    # -- data plane -----------------------------------------------------------------------------

    def _on_data_frames(self, frames: Frames) -> None:
        try:
            msg = wire.decode(frames, max_frame_bytes=self.config.max_frame_bytes)
            if not isinstance(msg, wire.Activations):
                raise ProtocolError(f"{wire.KINDS[type(msg)]} is not accepted on an agent's data socket")
            self._to_engine(None, msg)
        except ProtocolError as exc:
            self._reject("data", exc)

    # -- engine steps, heartbeats, rejections --------------------------------------------------

    def _step(self, step_log: StepLog | None = None) -> bool:
        t0 = time.monotonic()
        result = self.engine.step() if step_log is None else step_log.run(self.engine.step)
        if not result.outputs:
            return False
        self._meter.record(time.monotonic() - t0, len(result.outputs), result.num_tokens)
        self.stats.steps += 1
        self._routes.deliver(result.outputs)
        return True

    def _heartbeat(self) -> None:  # I/O thread
        self._coordinators.heartbeat(self._kv, self._queues, self._meter.stats)  # snapshots from the engine thread

    def _reject(self, plane: str, exc: ProtocolError, identity: bytes | None = None) -> None:
        self.stats.rejected += 1
        self.stats.errors = [*self.stats.errors[-15:], exc.message]
        log.warning("rejected a %s-plane message: %s", plane, exc.message)
        if identity is not None:
            self._coordinators.send(identity, wire.Error("protocol", exc.message))
