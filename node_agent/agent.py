"""The ZeroMQ node agent: drives one :class:`~node_agent.engine.StageEngine` step by step.

Sockets (all bound to loopback unless told otherwise):

* **control** (ROUTER): coordinators connect here, prove the shared secret (HELLO -> CHALLENGE
  -> AUTH -> WELCOME), then send ADMIT / STEP / CANCEL and LOAD_TASK / UNLOAD_TASK; the agent sends
  HEARTBEATs (KV usage, queue lengths and its engine steps' times and batch sizes, every ~250 ms),
  ERRORs and TASK_STATUS back on it.
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
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from helix import wire
from helix.domain import ErrorCode, FinishReason
from helix.errors import CapacityError, HelixError, PETError, ProtocolError
from helix.handshake import AgentHandshake
from helix.keys import CONTROL, DATA, KeyGuard, KeyPair, PeerPolicy
from helix.zmq_io import CurveSockets, Frames, IOLoop
from node_agent.step_log import StepLog
from node_agent.step_meter import StepMeter
from node_agent.transport import PushPool, configure, frame_tensor, sampling_params, tensor_frame

log = logging.getLogger(__name__)

TOMBSTONES = 65_536  # cancelled request ids remembered (late activations for them are dropped)
MAX_HANDSHAKES = 1024


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


@dataclass(slots=True)
class _Route:
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


@dataclass(slots=True)
class _Stats:
    rejected: int = 0
    refused: int = 0
    steps: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


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
        self._routes: dict[str, _Route] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._handshakes: OrderedDict[bytes, AgentHandshake] = OrderedDict()  # identity -> its handshake so far
        self._coordinators: dict[bytes, str] = {}  # authenticated identity -> coordinator name
        self._stopping = False
        self._hb_seq = 0
        self.stats = _Stats()
        # I/O thread -> engine thread: decoded messages (with the control identity, if any)
        # (handed over in batches: all messages of one drain join the same engine step)
        self._inbox: deque[list[tuple[bytes | None, wire.Message]]] = deque()
        self._arrivals: list[tuple[bytes | None, wire.Message]] = []  # I/O thread, not yet handed over
        self._work = threading.Event()
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
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def stop(self) -> None:  # any thread (a signal handler too)
        self._stopping = True
        self._work.set()
        self.loop.stop()

    def close(self) -> None:
        self.control.close(linger=0)
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
            self.close()

    def _to_coordinators(self, identity: bytes | None, msg: wire.Message) -> None:  # I/O thread
        for to in list(self._coordinators) if identity is None else [identity]:
            self._send_control(to, msg)

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
        self.loop.call(lambda: self._to_coordinators(identity, msg))

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
            self.peers.close()  # its sockets: closed by the thread that used them
            if step_log is not None:
                step_log.close()

    def _apply(self, msg: wire.Message, identity: bytes | None = None) -> None:  # engine thread
        if isinstance(msg, wire.LoadTask | wire.UnloadTask):
            self._out("", self._on_task(msg), identity)
        elif isinstance(msg, wire.Admit):
            self._on_admit(msg)
        elif isinstance(msg, wire.Step):
            self._on_step(msg)
        elif isinstance(msg, wire.Cancel):
            self._on_cancel(msg)
        elif isinstance(msg, wire.Activations):
            self._on_activations(msg)

    # -- control plane --------------------------------------------------------------------------

    def _on_control_frames(self, frames: Frames) -> None:
        identity, body = frames[0].bytes, frames[1:]
        try:
            msg = wire.decode(body, max_frame_bytes=self.config.max_frame_bytes)
            if isinstance(msg, wire.Hello | wire.Auth):
                self._handshake(identity, msg)
            elif identity not in self._coordinators:
                raise ProtocolError(f"{wire.KINDS[type(msg)]} before the handshake: send HELLO first")
            elif isinstance(msg, wire.Admit | wire.Step | wire.Cancel | wire.LoadTask | wire.UnloadTask):
                self._to_engine(identity, msg)
            else:
                raise ProtocolError(f"{wire.KINDS[type(msg)]} is not accepted on an agent's control socket")
        except ProtocolError as exc:
            self._reject("control", exc, identity)

    def _handshake(self, identity: bytes, msg: wire.Hello | wire.Auth) -> None:
        # an AUTH ends the handshake, either way; a HELLO starts one (a repeated HELLO continues it)
        handshake = self._handshakes.pop(identity, None) or AgentHandshake(self.config.secret, self.config.node_id,
                                                                           self._welcome)  # fmt: skip
        if isinstance(msg, wire.Hello):
            self._coordinators.pop(identity, None)
            self._handshakes[identity] = handshake  # the latest MAX_HANDSHAKES pending ones are kept
            while len(self._handshakes) > MAX_HANDSHAKES:
                self._handshakes.popitem(last=False)
        outcome = handshake.on_message(msg)
        for reply in outcome.replies:
            self._send_control(identity, reply)
        if outcome.error is not None:
            log.warning("rejected coordinator %r: %s", handshake.peer, outcome.error)
        elif outcome.trusted:
            self._coordinators[identity] = handshake.peer
            log.info("coordinator %s authenticated", handshake.peer)

    def _welcome(self) -> wire.Welcome:
        return wire.Welcome(self.config.node_id, self.engine.layer_start, self.engine.layer_end,
                            self._kv.capacity_tokens, self.data_address)  # fmt: skip

    def _send_control(self, identity: bytes, msg: wire.Message) -> bool:
        try:
            self.control.send_multipart([identity, *wire.encode(msg)], flags=zmq.NOBLOCK, copy=False)
            return True
        except (zmq.Again, zmq.ZMQError):  # peer gone (ROUTER_MANDATORY) or full
            self._coordinators.pop(identity, None)
            return False

    def _on_admit(self, msg: wire.Admit) -> None:
        me = msg.pipeline[0].stage
        if me.node != self.config.node_id:
            raise ProtocolError(f"ADMIT for {msg.request_id!r} names {me.node!r} as first stage, not this node")
        self._check_route(msg.request_id, msg.pipeline, 0, msg.reply_to)
        route = _Route(msg.pipeline, 0, msg.sampling, msg.max_tokens, len(msg.prompt), msg.reply_to, msg.task)
        self._tombstones.pop(msg.request_id, None)
        self._add(msg.request_id, route, prompt=list(msg.prompt))

    def _on_step(self, msg: wire.Step) -> None:
        route = self._routes.get(msg.request_id)
        if route is None or not self.engine.has_request(msg.request_id):
            log.debug("STEP for unknown request %s (finished or cancelled): dropped", msg.request_id)
            return
        if route.is_last:  # a one-stage pipeline: the engine holds the whole model for it
            if not route.sampling.paced:
                return  # and loops its tokens back itself
        else:
            route.step = msg.step
        self.engine.push_token(msg.request_id, msg.token_id)

    def _on_cancel(self, msg: wire.Cancel) -> None:
        route = self._routes.get(msg.request_id)
        if msg.reason.startswith("unreachable:") and route is not None:
            reason = f"next stage at {msg.reason[12:]} is not reachable"
            self._refuse(msg.request_id, route, ErrorCode.UNREACHABLE, reason)
        else:
            self._forget(msg.request_id)

    def _check_route(self, rid: str, pipeline: tuple[wire.StageRef, ...], hop: int, reply_to: str) -> None:
        """ProtocolError unless every address this node would send the request's results to (the later
        stages', ``reply_to``) is where the cluster file puts that vertex (no-op without a cluster policy)."""
        policy = self.config.peers
        if policy is None:
            return
        for ref in pipeline[hop + 1:]:
            policy.check_address(ref.stage.node, ref.address, f"request {rid!r}: stage address")
        policy.check_address(policy.coordinator, reply_to, f"request {rid!r}: reply_to")

    def _forget(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        self._routes.pop(request_id, None)
        self._tombstones[request_id] = None
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)

    # -- fine-tuned tasks -------------------------------------------------------------------------

    def _on_task(self, msg: wire.LoadTask | wire.UnloadTask) -> wire.TaskStatus:  # engine thread
        node = self.config.node_id
        if isinstance(msg, wire.UnloadTask):
            self.engine.remove_task(msg.task_id)
            log.info("task %s unloaded", msg.task_id)
            return wire.TaskStatus(node, msg.task_id, "unload", True)
        from node_agent.task_files import in_file, load_task_slice

        try:
            descriptor, pet = load_task_slice(msg.path, self.engine.config, self.engine.layer_start,
                                              self.engine.layer_end)  # fmt: skip
            with in_file(str(descriptor.weights)):
                bound = self.engine.add_task(msg.task_id, pet, max_lora_rank=msg.max_lora_rank or None)
        except PETError as exc:
            log.warning("task %s not loaded: %s", msg.task_id, exc.message)
            return wire.TaskStatus(node, msg.task_id, "load", False, exc.message)
        except HelixError as exc:  # e.g. a backend that runs no tasks
            return wire.TaskStatus(node, msg.task_id, "load", False, exc.message)
        log.info("task %s loaded (%s, %d bytes for layers [%d, %d))", msg.task_id, pet.pet_type, bound.nbytes,
                 self.engine.layer_start, self.engine.layer_end)  # fmt: skip
        return wire.TaskStatus(node, msg.task_id, "load", True, nbytes=int(bound.nbytes))

    # -- data plane -----------------------------------------------------------------------------

    def _on_data_frames(self, frames: Frames) -> None:
        try:
            msg = wire.decode(frames, max_frame_bytes=self.config.max_frame_bytes)
            if not isinstance(msg, wire.Activations):
                raise ProtocolError(f"{wire.KINDS[type(msg)]} is not accepted on an agent's data socket")
            self._to_engine(None, msg)
        except ProtocolError as exc:
            self._reject("data", exc)

    def _on_activations(self, msg: wire.Activations) -> None:
        rid = msg.request_id
        if rid in self._tombstones:
            return
        if rid not in self._routes:
            if msg.admit is None:
                log.debug("ACTIVATIONS for unknown request %s without admission: dropped", rid)
                return
            a = msg.admit
            if a.hop == 0 or a.pipeline[a.hop].stage.node != self.config.node_id:
                raise ProtocolError(f"ACTIVATIONS for {rid!r}: hop {a.hop} of its pipeline is not this node")
            self._check_route(rid, a.pipeline, a.hop, a.reply_to)
            route = _Route(a.pipeline, a.hop, a.sampling, a.max_tokens, a.prompt_tokens, a.reply_to, a.task)
            if not self._add(rid, route, prompt=None):
                return
        try:
            self.engine.push_hidden(rid, frame_tensor(msg))
        except HelixError as exc:
            self._refuse(rid, self._routes[rid], ErrorCode.BAD_REQUEST, str(exc))

    # -- admission and results ------------------------------------------------------------------

    def _add(self, rid: str, route: _Route, prompt: list[int] | None) -> bool:
        if rid in self._routes:
            raise ProtocolError(f"request {rid!r} is already admitted on this node")
        me = route.pipeline[route.hop].stage
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
        self._routes[rid] = route
        return True

    def _refuse(self, rid: str, route: _Route, code: ErrorCode, reason: str) -> None:
        log.warning("refused request %s (%s): %s", rid, code, reason)
        self.stats.refused += 1
        self._forget(rid)
        self._reply(route.reply_to, wire.Refused(rid, self.config.node_id, code, reason))

    def _reply(self, reply_to: str, msg: wire.Message) -> None:  # engine thread
        coordinator = self.config.peers.coordinator if self.config.peers is not None else ""
        self._out(reply_to, msg, vertex=coordinator)

    def _step(self, step_log: StepLog | None = None) -> bool:
        t0 = time.monotonic()
        result = self.engine.step() if step_log is None else step_log.run(self.engine.step)
        if not result.outputs:
            return False
        self._meter.record(time.monotonic() - t0, len(result.outputs), result.num_tokens)
        self.stats.steps += 1
        tokens: dict[str, list[wire.TokenOut]] = {}
        for out in result.outputs:
            route = self._routes.get(out.request_id)
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
                    self._routes.pop(out.request_id, None)
        for reply_to, outs in tokens.items():
            self.stats.tokens += len(outs)
            self._reply(reply_to, wire.Tokens(self.config.node_id, tuple(outs)))
        return True

    def _forward(self, rid: str, route: _Route, hidden: Any) -> None:
        nxt = route.pipeline[route.hop + 1]
        shape, data = tensor_frame(hidden, self.config.wire_dtype)
        admit = None
        if not route.forwarded:
            admit = wire.AdmitInfo(route.hop + 1, route.prompt_tokens, route.max_tokens, route.sampling,
                                   route.pipeline, route.reply_to, route.task)
        position, route.sent_tokens = route.sent_tokens, route.sent_tokens + shape[0]
        self._out(nxt.address, wire.Activations(rid, route.step, position, self.config.wire_dtype, shape, data, admit),
                  vertex=nxt.stage.node)
        route.forwarded = True

    def _heartbeat(self) -> None:
        if not self._coordinators:
            return
        usage, (waiting, running) = self._kv, self._queues  # snapshots from the engine thread
        self._hb_seq += 1
        hb = wire.Heartbeat(self.config.node_id, self._hb_seq, usage.used_tokens, usage.reserved_tokens,
                            usage.capacity_tokens, waiting, running, self._meter.stats)
        for identity in list(self._coordinators):
            self._send_control(identity, hb)

    def _reject(self, plane: str, exc: ProtocolError, identity: bytes | None = None) -> None:
        self.stats.rejected += 1
        self.stats.errors = [*self.stats.errors[-15:], exc.message]
        log.warning("rejected a %s-plane message: %s", plane, exc.message)
        if identity is not None:
            self._send_control(identity, wire.Error("protocol", exc.message))
