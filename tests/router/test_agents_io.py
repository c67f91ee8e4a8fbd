"""router.agents_io, and router.pinned's client on top of it, against scripted agents over real
ZeroMQ (no torch, no model).

A scripted agent speaks the wire protocol like a node agent holding the whole model: it checks
the handshake, heartbeats, and answers ADMIT / STEP with predictable tokens (prompt length, then
+1 per step) pushed to the coordinator's sink. The transport is checked as a pipe (messages in, one
event stream out); :class:`PinnedClient` adds the coordinator core (STEPs, stops, cancels, refusals).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest
import zmq

from helix import wire
from helix.domain import ErrorCode, FinishReason, Stage
from helix.errors import CapacityError, NoRouteError, RequestError
from router.agent_events import AgentDied, AgentEvent, AgentJoined, AgentLeft, Unreachable
from router.agents_io import AgentsIO
from router.pinned import PinnedClient
from router.request import RequestOutput

SECRET = b"io-test"


class ScriptedAgent(threading.Thread):
    def __init__(self, node_id: str, layers: tuple[int, int], secret: bytes = SECRET) -> None:
        super().__init__(daemon=True)
        self.node_id, self.layers, self.secret = node_id, layers, secret
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.push = self.ctx.socket(zmq.PUSH)
        self.heartbeats = threading.Event()
        self.heartbeats.set()
        self.stop = threading.Event()
        self.received: list[wire.Message] = []
        self._nonces: dict[bytes, tuple[bytes, bytes]] = {}
        self._authed: set[bytes] = set()
        self._left: dict[str, tuple[int, str]] = {}
        self._sock_lock = threading.RLock()  # say() runs on the test's thread: a ZeroMQ socket is not thread-safe

    def run(self) -> None:
        next_hb = 0.0
        while not self.stop.is_set():
            with self._sock_lock:
                frames = self.sock.recv_multipart() if self.sock.poll(20) else None
            if frames is not None:
                identity, *rest = frames
                self.handle(identity, wire.decode(rest))
            if time.monotonic() > next_hb and self.heartbeats.is_set():
                for identity in self._authed:
                    self.send(identity, wire.Heartbeat(self.node_id, 1, 5, 10, 1000, 0, len(self._left)))
                next_hb = time.monotonic() + 0.1
        self.ctx.destroy(linger=0)

    def send(self, identity: bytes, msg: wire.Message) -> None:
        with self._sock_lock:
            self.sock.send_multipart([identity, *wire.encode(msg)])

    def handle(self, identity: bytes, msg: wire.Message) -> None:
        self.received.append(msg)
        if isinstance(msg, wire.Hello) and self.heartbeats.is_set():  # a silent agent answers nothing
            ours = wire.make_nonce()
            self._nonces[identity] = (msg.nonce, ours)
            self.send(identity, wire.Challenge(self.node_id, ours, wire.prove(self.secret, "agent", msg.nonce, ours)))
        elif isinstance(msg, wire.Auth):
            theirs, ours = self._nonces.pop(identity)
            if wire.verify(self.secret, msg.proof, "coordinator", ours, theirs):
                self._authed.add(identity)
                self.send(identity, wire.Welcome(self.node_id, *self.layers, 1000, "tcp://127.0.0.1:1"))
        elif isinstance(msg, wire.Admit):
            if len(msg.prompt) + msg.max_tokens > 1000:
                self.reply(msg.reply_to, wire.Refused(msg.request_id, self.node_id, "capacity", "needs too much KV"))
                return
            self._left[msg.request_id] = (msg.max_tokens, msg.reply_to)
            self.token(msg.request_id, 0, len(msg.prompt))
        elif isinstance(msg, wire.Step):
            self.token(msg.request_id, msg.step + 1, msg.token_id + 1)
        elif isinstance(msg, wire.SetLayers):
            self.send(identity, wire.Layers(self.node_id, msg.version, "load", msg.layer_start, msg.layer_end))

    def say(self, msg: wire.Message) -> None:
        """Send ``msg`` to every coordinator that completed the handshake (LEAVING)."""
        for identity in self._authed:
            self.send(identity, msg)

    def reply(self, address: str, msg: wire.Message) -> None:
        if self.push.closed is False and address:
            self.push.connect(address)
            self.push.send_multipart(wire.encode(msg))

    def token(self, rid: str, step: int, token: int) -> None:
        left, reply_to = self._left[rid]
        done = step + 1 >= left
        reason = FinishReason.LENGTH if done else None
        self.reply(reply_to, wire.Tokens(self.node_id, (wire.TokenOut(rid, step, token, reason),)))


@pytest.fixture
def agent() -> Any:
    a = ScriptedAgent("solo", (0, 30))
    a.start()
    yield a
    a.stop.set()
    a.join(5)


WHOLE = (wire.StageRef(Stage("solo", 0, 30), "tcp://127.0.0.1:1"),)
TWO_STAGES = [Stage("solo", 0, 10), Stage("solo", 10, 30)]  # one scripted node twice: the core drives STEPs


def admit(wire_id: str, prompt: tuple[int, ...], max_tokens: int, io: AgentsIO) -> tuple[str, wire.Message]:
    return "solo", wire.Admit(wire_id, prompt, max_tokens, wire.SamplingSpec(), WHOLE, io.reply_to)


def until_finished(outputs: queue.Queue[RequestOutput]) -> list[RequestOutput]:
    got = [outputs.get(timeout=10)]
    while not got[-1].finished:
        got.append(outputs.get(timeout=10))
    return got


def tokens_in(event: AgentEvent) -> list[tuple[str, int, int, bool]]:
    """(wire id, step, token, finished) of each token in a TOKENS event."""
    assert isinstance(event, wire.Tokens), event
    return [(t.request_id, t.step, t.token_id, t.finished) for t in event.tokens]


def test_handshake_messages_out_tokens_in_and_kv_reports(agent: ScriptedAgent) -> None:
    events: queue.Queue[AgentEvent] = queue.Queue()
    with AgentsIO({"solo": agent.address}, secret=SECRET, on_event=events.put) as io:
        assert events.get(timeout=10) == AgentJoined("solo", wire.Welcome("solo", 0, 30, 1000, "tcp://127.0.0.1:1"))
        assert io.alive_nodes() == {"solo"}
        io.send([admit("r.1", (7, 8, 9), 2, io)])
        assert tokens_in(events.get(timeout=10)) == [("r.1", 0, 3, False)]
        io.send([("solo", wire.Step("r.1", 0, 3))])
        assert tokens_in(events.get(timeout=10)) == [("r.1", 1, 4, True)]
        assert all(len(wire.encode(m)[0]) < 100 for m in agent.received if isinstance(m, wire.Step))
        deadline = time.monotonic() + 5
        while not io.kv_reports() and time.monotonic() < deadline:
            time.sleep(0.02)
        report = io.kv_reports()["solo"]
        assert (report.used_tokens, report.reserved_tokens, report.capacity_tokens) == (5, 10, 1000)


def test_refusal_is_an_event(agent: ScriptedAgent) -> None:
    events: queue.Queue[AgentEvent] = queue.Queue()
    with AgentsIO({"solo": agent.address}, secret=SECRET, on_event=events.put) as io:
        assert isinstance(events.get(timeout=10), AgentJoined)
        io.send([admit("big.1", (1,) * 10, 5000, io)])
        assert events.get(timeout=10) == wire.Refused("big.1", "solo", "capacity", "needs too much KV")


def test_dead_agent_noticed_by_missing_heartbeats_and_alive_again(agent: ScriptedAgent) -> None:
    events: queue.Queue[AgentEvent] = queue.Queue()
    with AgentsIO({"solo": agent.address}, secret=SECRET, dead_after_s=0.5, on_event=events.put) as io:
        assert isinstance(events.get(timeout=10), AgentJoined)
        agent.heartbeats.clear()
        assert events.get(timeout=5) == AgentDied("solo") and io.alive_nodes() == set()
        io.send([admit("x.1", (1,), 1, io), ("ghost", wire.Step("y.1", 0, 1)), ("solo", wire.Cancel("x.1"))])
        unreachable = [events.get(timeout=5), events.get(timeout=5)]
        assert unreachable == [Unreachable("solo", "x.1"), Unreachable("ghost", "y.1")]  # and no event for the CANCEL
        agent.heartbeats.set()
        joined = events.get(timeout=10)
        assert isinstance(joined, AgentJoined) and joined.node == "solo" and io.alive_nodes() == {"solo"}


def test_wrong_secret_agent_is_not_trusted() -> None:
    impostor = ScriptedAgent("solo", (0, 30), secret=b"other")
    impostor.start()
    try:
        with AgentsIO({"solo": impostor.address}, secret=SECRET) as io:
            assert not io.wait_ready(timeout_s=0.5)
            assert "did not prove the shared secret" in (io.agents()["solo"].auth_error or "")
    finally:
        impostor.stop.set()
        impostor.join(5)


def test_pinned_client_steps_a_pipeline_and_stops_at_max_tokens(agent: ScriptedAgent) -> None:
    with PinnedClient({"solo": agent.address}, secret=SECRET) as client:
        client.submit("r1", [7, 8, 9], TWO_STAGES, max_tokens=4, temperature=0.0)
        got = until_finished(client.outputs)
        assert got[0].started and [t for o in got for t in o.token_ids] == [3, 4, 5, 6]
        finish = got[-1].finish
        assert finish is not None and finish.reason == FinishReason.LENGTH and finish.completion_tokens == 4
        assert got[-1].node == "solo" and {o.request_id for o in got} == {"r1"}
        # a one-stage request after it: its ADMIT reaches the agent after everything the core sent for r1
        client.submit("r2", [5], [Stage("solo", 0, 30)], max_tokens=1, temperature=0.0)
        assert [t for o in until_finished(client.outputs) for t in o.token_ids] == [1]
    first = next(m for m in agent.received if isinstance(m, wire.Admit))
    assert first.request_id == "r1.1" and first.prompt == (7, 8, 9) and first.max_tokens == 4
    assert first.pipeline[1].stage.layer_start == 10 and first.sampling.temperature == 0.0
    # one STEP per token but the last: nothing runs after the request ends, its first stage is cancelled
    assert [m.step for m in agent.received if isinstance(m, wire.Step)] == [0, 1, 2]
    assert [m.request_id for m in agent.received if isinstance(m, wire.Cancel)] == ["r1.1"]


def test_pinned_client_refusal_cancel_and_bad_submissions(agent: ScriptedAgent) -> None:
    with PinnedClient({"solo": agent.address}, secret=SECRET) as client:
        client.submit("big", [1] * 10, [Stage("solo", 0, 30)], max_tokens=5000)
        last = until_finished(client.outputs)[-1]
        assert isinstance(last.error, CapacityError) and "needs too much KV" in last.error.message
        assert last.code == ErrorCode.CAPACITY and last.node == "solo"
        with pytest.raises(NoRouteError, match="not connected"):
            client.submit("x", [1], [Stage("ghost", 0, 30)], max_tokens=1)
        with pytest.raises(RequestError, match="no tokens"):
            client.submit("x", [], [Stage("solo", 0, 30)], max_tokens=1)
        with pytest.raises(RequestError, match="max_tokens"):
            client.submit("x", [1], [Stage("solo", 0, 30)], max_tokens=0)
        client.submit("long", [1], TWO_STAGES, max_tokens=900, temperature=0.0)
        assert client.outputs.get(timeout=10).started and client.outputs.get(timeout=10).token_ids == (1,)
        with pytest.raises(RequestError, match="already in flight"):
            client.submit("long", [1], TWO_STAGES, max_tokens=1)
        client.cancel("long")
        while not client.outputs.empty():  # what came before the cancel
            assert not client.outputs.get().finished
        client.submit("after", [5, 6], [Stage("solo", 0, 30)], max_tokens=1)
        got = until_finished(client.outputs)  # no output of "long" follows its cancel, late tokens included
        assert {o.request_id for o in got} == {"after"} and got[-1].token_ids == (2,)
    assert any(isinstance(m, wire.Cancel) and m.request_id == "long.1" for m in agent.received)


def test_layers_and_leaving_are_events_and_a_leaving_agent_that_stops_left(agent: ScriptedAgent) -> None:
    events: queue.Queue[AgentEvent] = queue.Queue()
    with AgentsIO({}, secret=SECRET, dead_after_s=0.5, on_event=events.put) as io:
        io.add_agent("solo", agent.address)  # a node joining at run time
        assert isinstance(events.get(timeout=10), AgentJoined)
        io.send([("solo", wire.SetLayers(3, 0, 10)), ("ghost", wire.ReleaseLayers(3))])
        got = {events.get(timeout=5), events.get(timeout=5)}
        assert got == {wire.Layers("solo", 3, "load", 0, 10),
                       wire.Layers("ghost", 3, "release", 0, 0, error="node 'ghost' is not connected")}
        agent.say(wire.Leaving("solo", 30.0, 2))
        assert events.get(timeout=5) == wire.Leaving("solo", 30.0, 2)
        agent.heartbeats.clear()
        assert events.get(timeout=5) == AgentLeft("solo")  # not AgentDied: it said it was going
        io.remove_agent("solo")
        deadline = time.monotonic() + 5
        while "solo" in io.agents() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert io.agents() == {}
