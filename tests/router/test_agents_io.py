"""router.agents_io against scripted agents over real ZeroMQ (no torch, no model).

A scripted agent speaks the wire protocol like a node agent holding the whole model: it checks
the handshake, heartbeats, and answers ADMIT / STEP with predictable tokens (prompt length, then
+1 per step) pushed to the coordinator's sink.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any

import pytest
import zmq

from helix import wire
from helix.domain import Stage
from helix.errors import NoRouteError, RequestError
from router.agent_events import AsyncTokenStream, TokenEvent
from router.agents_io import AgentsIO

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

    def run(self) -> None:
        next_hb = 0.0
        while not self.stop.is_set():
            if self.sock.poll(20):
                identity, *frames = self.sock.recv_multipart()
                self.handle(identity, wire.decode(frames))
            if time.monotonic() > next_hb and self.heartbeats.is_set():
                for identity in self._authed:
                    self.send(identity, wire.Heartbeat(self.node_id, 1, 5, 10, 1000, 0, len(self._left)))
                next_hb = time.monotonic() + 0.1
        self.ctx.destroy(linger=0)

    def send(self, identity: bytes, msg: wire.Message) -> None:
        self.sock.send_multipart([identity, *wire.encode(msg)])

    def handle(self, identity: bytes, msg: wire.Message) -> None:
        self.received.append(msg)
        if isinstance(msg, wire.Hello):
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

    def reply(self, address: str, msg: wire.Message) -> None:
        if self.push.closed is False and address:
            self.push.connect(address)
            self.push.send_multipart(wire.encode(msg))

    def token(self, rid: str, step: int, token: int) -> None:
        left, reply_to = self._left[rid]
        done = step + 1 >= left
        self.reply(reply_to, wire.Tokens(self.node_id, (wire.TokenOut(rid, step, token, done, "length" if done else ""),)))


@pytest.fixture
def agent() -> Any:
    a = ScriptedAgent("solo", (0, 30))
    a.start()
    yield a
    a.stop.set()
    a.join(5)


def collect(events: queue.Queue[TokenEvent]) -> list[TokenEvent]:
    out = [events.get(timeout=10)]
    while not out[-1].finished:
        out.append(events.get(timeout=10))
    return out


def test_handshake_submit_tokens_and_kv_reports(agent: ScriptedAgent) -> None:
    with AgentsIO({"solo": agent.address}, secret=SECRET) as io:
        assert io.wait_ready(timeout_s=10)
        events: queue.Queue[TokenEvent] = queue.Queue()
        # a two-stage pipeline on one scripted node makes the coordinator drive STEPs
        pipeline = [Stage("solo", 0, 10), Stage("solo", 10, 30)]
        io.submit("r1", [7, 8, 9], wire.SamplingSpec(), pipeline, max_tokens=4, on_token=events.put)
        got = collect(events)
        assert [e.token_id for e in got] == [3, 4, 5, 6] and got[-1].finish_reason == "length"
        assert [e.index for e in got] == [0, 1, 2, 3]
        admit = next(m for m in agent.received if isinstance(m, wire.Admit))
        assert admit.prompt == (7, 8, 9) and admit.pipeline[1].layer_start == 10
        assert all(len(wire.encode(m)[0]) < 100 for m in agent.received if isinstance(m, wire.Step))
        deadline = time.monotonic() + 5
        while not io.kv_reports() and time.monotonic() < deadline:
            time.sleep(0.02)
        report = io.kv_reports()["solo"]
        assert (report.used_tokens, report.reserved_tokens, report.capacity_tokens) == (5, 10, 1000)
        assert any(isinstance(m, wire.Cancel) and m.reason == "finished" for m in agent.received)


def test_refusal_cancel_and_bad_submissions(agent: ScriptedAgent) -> None:
    with AgentsIO({"solo": agent.address}, secret=SECRET) as io:
        assert io.wait_ready(timeout_s=10)
        events: queue.Queue[TokenEvent] = queue.Queue()
        io.submit("big", [1] * 10, wire.SamplingSpec(), [Stage("solo", 0, 30)], max_tokens=5000, on_token=events.put)
        [event] = collect(events)
        assert event.error_code == "capacity" and "needs too much KV" in (event.error or "")
        with pytest.raises(NoRouteError, match="unknown node"):
            io.submit("x", [1], wire.SamplingSpec(), [Stage("ghost", 0, 30)], max_tokens=1)
        with pytest.raises(RequestError, match="no tokens"):
            io.submit("x", [], wire.SamplingSpec(), [Stage("solo", 0, 30)], max_tokens=1)
        io.submit("long", [1], wire.SamplingSpec(), [Stage("solo", 0, 10), Stage("solo", 10, 30)], max_tokens=900,
                  on_token=events.put)
        assert events.get(timeout=10).token_id == 1
        io.cancel("long")
        last = collect(events)[-1]
        assert last.finish_reason == "cancelled"


def test_dead_agent_noticed_by_missing_heartbeats_and_alive_again(agent: ScriptedAgent) -> None:
    dead: queue.Queue[str] = queue.Queue()
    alive: queue.Queue[str] = queue.Queue()
    with AgentsIO({"solo": agent.address}, secret=SECRET, dead_after_s=0.5, on_agent_dead=dead.put,
                  on_agent_alive=lambda n, w: alive.put(n)) as io:
        assert alive.get(timeout=10) == "solo"
        agent.heartbeats.clear()
        assert dead.get(timeout=5) == "solo" and io.alive_nodes() == set()
        with pytest.raises(NoRouteError, match="not connected"):
            io.submit("x", [1], wire.SamplingSpec(), [Stage("solo", 0, 30)], max_tokens=1)
        agent.heartbeats.set()
        assert alive.get(timeout=10) == "solo"


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


def test_async_token_stream() -> None:
    async def main() -> list[int | None]:
        stream = AsyncTokenStream()
        threading.Thread(target=lambda: [stream.put(TokenEvent("r", t, t, t == 2)) for t in range(3)]).start()
        return [e.token_id async for e in stream]

    assert asyncio.run(main()) == [0, 1, 2]
