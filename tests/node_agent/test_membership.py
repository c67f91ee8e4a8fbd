"""Live membership on the agent side (issue 18): an agent's layers change while it serves, and it leaves.

SmolLM2-135M over real ZeroMQ on loopback: agents run in this process (``NodeAgent`` on its threads)
or, for SIGTERM, as a ``helix agent`` subprocess. Requests go through the coordinator core on chosen
pipelines (:class:`router.pinned.PinnedClient`) or a bare coordinator (``BareCoordinator``), which
also sends SET_LAYERS / RELEASE_LAYERS and reads LAYERS / LEAVING. Tokens are checked against
``transformers`` (``hf_greedy``) or the single-process engine. The union of old and new layers, and
freeing them, are checked on the engine with a random tiny Llama.
"""

from __future__ import annotations

import queue
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from helix import wire
from helix.domain import ErrorCode, LayerRange, Stage
from node_agent.agent import AgentConfig, NodeAgent
from node_agent.engine import StageEngine
from node_agent.memory import why_not_fit
from node_agent.sampling import SamplingParams
from node_agent.stage_layers import build_layers, missing, spans
from router.pinned import PinnedClient
from router.request import RequestOutput
from tests.node_agent.conftest import BareCoordinator, make_tiny_llama
from tests.node_agent.test_agent import SECRET, start_agents

KEY = SECRET.encode()
SPLIT = [Stage("a", 0, 15), Stage("b", 15, 30)]


# -- the engine: the union of old and new layers, and freeing them (tiny Llama) ----------------


def _greedy(engine: StageEngine, rid: str, prompt: list[int], layers: tuple[int, int], n: int) -> list[int]:
    engine.add_request(rid, SamplingParams(max_tokens=n), prompt_token_ids=prompt, layer_range=layers)
    tokens: list[int] = []
    while engine.has_request(rid):
        tokens += [o.token for o in engine.step().outputs if o.request_id == rid and o.token is not None]
    return tokens


def test_the_engine_holds_the_union_of_its_ranges_and_frees_what_no_request_runs(tmp_path: Path) -> None:
    model_dir, _ = make_tiny_llama(tmp_path, "gqa-tied-llama3", num_layers=4)
    want = _greedy(StageEngine(model_dir, kv_capacity_tokens=256), "ref", [5, 17, 3], (0, 4), 8)
    engine = StageEngine(model_dir, 0, 0, kv_capacity_tokens=256)  # no layers yet (a joining node)
    assert engine.held == () and engine.weight_bytes == 0 and (engine.layer_start, engine.layer_end) == (0, 0)
    model = engine.layer_model()
    engine.insert_layers(build_layers(model, model_dir, missing(model, 0, 2)), 0, 2)
    head = engine.weight_bytes
    engine.add_request("old", SamplingParams(max_tokens=8), prompt_token_ids=[5, 17, 3], layer_range=(0, 2))
    (hidden,) = engine.step().outputs  # the old range's request is mid-flight while [2, 4) comes in
    need = missing(model, 1, 4)
    assert need.layers == (2, 3) and not need.embed and need.head
    engine.insert_layers(build_layers(model, model_dir, need), 1, 4)
    assert engine.held == (LayerRange(0, 4),) and (engine.layer_start, engine.layer_end) == (1, 4)
    assert _greedy(engine, "new", [5, 17, 3], (0, 4), 8) == want  # the union runs the whole model
    assert engine.drop_layers(2, 4) == ()  # "old" runs [0, 2): nothing freed under it
    engine.cancel("old")
    assert engine.drop_layers(2, 4) == (0, 1) and engine.held == (LayerRange(2, 4),)
    assert engine.weight_bytes < 2 * head and model.embed_tokens is None and hidden.hidden is not None
    with pytest.raises(Exception, match=r"layer range \[0, 4\) is not inside the layers this stage holds \(\[2, 4\)\)"):
        engine.add_request("gone", SamplingParams(), prompt_token_ids=[1], layer_range=(0, 4))
    assert spans([7, 3, 4, 9, 8]) == (LayerRange(3, 5), LayerRange(7, 10))


def test_the_memory_check_names_the_bytes() -> None:
    assert why_not_fit(weights=100, kv=50, free=1000, held=10, limit=None) is None
    limited = why_not_fit(weights=100, kv=0, free=10**9, held=950, limit=1000) or ""
    assert "need 100 bytes" in limited and "--max-weight-bytes 1,000 leaves 50 bytes" in limited
    full = why_not_fit(weights=600, kv=500, free=1000, held=0, limit=None) or ""
    assert "need 1,100 bytes (600 of weights, 500 of KV room" in full and "1,000 bytes free" in full


# -- agents in this process -------------------------------------------------------------------


class Agents:
    """SmolLM2 agents on their own threads (stopped at the end of the test)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.nodes: dict[str, NodeAgent] = {}
        self._threads: list[threading.Thread] = []

    def start(self, node: str, start: int, end: int, *, kv_capacity_tokens: int = 8192, **config: Any) -> NodeAgent:
        engine = StageEngine(self.model_dir, start, end, kv_capacity_tokens=kv_capacity_tokens)
        agent = NodeAgent(AgentConfig(node, secret=KEY, **config), engine, self.ctx)
        thread = threading.Thread(target=agent.run, name=f"agent-{node}", daemon=True)
        thread.start()
        self.nodes[node], self._threads = agent, [*self._threads, thread]
        return agent

    def addresses(self) -> dict[str, str]:
        return {n: a.control_address for n, a in self.nodes.items()}

    def control(self, node: str) -> BareCoordinator:
        return BareCoordinator(self.ctx, self.nodes[node].control_address, node, KEY)

    def close(self) -> None:
        for agent in self.nodes.values():
            agent.stop()
        for thread in self._threads:
            thread.join(timeout=15)
        assert not any(a.failed for a in self.nodes.values())
        self.ctx.destroy(linger=0)


@pytest.fixture
def agents(smollm2_dir: Path) -> Iterator[Agents]:
    running = Agents(smollm2_dir)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> StageEngine:
    """The single-process engine holding the whole model."""
    return StageEngine(smollm2_dir, kv_capacity_tokens=4096)


def reply(control: BareCoordinator, kind: type[Any]) -> Any:
    """The next control message of ``kind`` (others skipped: heartbeats)."""
    while True:
        msg = control.control_reply()
        if isinstance(msg, kind):
            return msg


def outputs(client: PinnedClient, request_id: str, timeout_s: float = 30) -> list[tuple[float, RequestOutput]]:
    """``request_id``'s outputs with when they came, until it finished (others' are dropped)."""
    got: list[tuple[float, RequestOutput]] = []
    deadline = time.monotonic() + timeout_s
    while not got or not got[-1][1].finished:
        out = client.outputs.get(timeout=max(0.01, deadline - time.monotonic()))
        if out.request_id == request_id:
            got.append((time.monotonic(), out))
    return got


def tokens(got: list[tuple[float, RequestOutput]]) -> list[int]:
    return [t for _, out in got for t in out.token_ids]


def held(msg: wire.Layers | wire.Welcome) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in msg.held]


def _while_loading(client: PinnedClient, control: BareCoordinator,
                   timeout_s: float = 60) -> tuple[list[tuple[float, RequestOutput]], wire.Layers, float]:
    """The one running request's outputs (with when they came) until it finished, and the LAYERS
    answer with when it came, read side by side."""
    rest: list[tuple[float, RequestOutput]] = []
    done, loaded, deadline = None, 0.0, time.monotonic() + timeout_s
    while done is None or not rest or not rest[-1][1].finished:
        assert time.monotonic() < deadline
        try:
            rest.append((time.monotonic(), client.outputs.get(timeout=0.002)))
        except queue.Empty:
            pass
        if done is None and control.dealer.poll(0):
            msg = wire.decode(control.dealer.recv_multipart())
            if isinstance(msg, wire.Layers):
                done, loaded = msg, time.monotonic()
    return rest, done, loaded


def test_set_layers_loads_while_a_request_runs_on_the_old_range(agents: Agents, smollm2_prompts: list[list[int]],
                                                                hf_greedy: list[list[int]],
                                                                reference: StageEngine) -> None:  # fmt: skip
    a = agents.start("a", 0, 15, torch_threads=1)
    agents.start("b", 15, 30)
    prompt, n = smollm2_prompts[1], 40
    want = _greedy(reference, "ref-long", prompt, (0, 30), n)
    control = agents.control("a")
    assert (control.welcome.layer_start, control.welcome.layer_end, held(control.welcome)) == (0, 15, [(0, 15)])
    before = a.engine.weight_bytes
    with PinnedClient(agents.addresses(), secret=KEY, ready_timeout_s=20) as client:
        client.submit("old", prompt, SPLIT, max_tokens=n)
        first = [client.outputs.get(timeout=30) for _ in range(3)]  # started, then tokens: mid-generation
        sent = time.monotonic()
        control.send(wire.SetLayers(1, 0, 30))
        rest, done, loaded = _while_loading(client, control)
        assert done.ok and (done.version, done.op, done.layer_start, done.layer_end) == (1, "load", 0, 30)
        assert held(done) == [(0, 30)] and done.weight_bytes == a.engine.weight_bytes > before
        assert any(t < loaded for t, out in rest if out.token_ids), "the old range served while the new one loaded"
        assert tokens([(0.0, o) for o in first]) + tokens(rest) == want  # undisturbed
        # the new range serves on its own: a one-stage pipeline on a
        client.submit("new", smollm2_prompts[0], [Stage("a", 0, 30)], max_tokens=10)
        assert tokens(outputs(client, "new")) == hf_greedy[0]
    gaps = [t1 - t0 for (t0, _), (t1, _) in zip(rest, rest[1:], strict=False)]
    during = [g for (t, _), g in zip(rest[1:], gaps, strict=True) if sent <= t <= loaded + 0.5]
    print(f"\nSET_LAYERS [0,30) on a [0,15): loaded in {done.seconds:.2f} s; inserting held the engine thread "
          f"{max(a.layers.load_stalls) * 1000:.2f} ms; time between tokens {statistics.median(gaps) * 1000:.0f} ms "
          f"median, {max(during or [0.0]) * 1000:.0f} ms at most during the load ({len(during)} tokens)")
    again = agents.control("a")  # a coordinator that connects now learns the new range
    assert (again.welcome.layer_start, again.welcome.layer_end, again.welcome.version) == (0, 30, 1)


def _admit(control: BareCoordinator, rid: str, prompt: list[int], stage: Stage, address: str, n: int) -> None:
    ref = wire.StageRef(stage, address)
    control.send(wire.Admit(rid, tuple(prompt), n, wire.SamplingSpec(), (ref,), control.reply_to))


class Sink:
    """What a bare coordinator's sink received: tokens by request, read as they are asked for."""

    def __init__(self, control: BareCoordinator) -> None:
        self.control = control
        self.tokens: dict[str, list[int]] = {}

    def next(self) -> wire.Message:
        msg = wire.decode(self.control.sink.recv_multipart())
        for t in msg.tokens if isinstance(msg, wire.Tokens) else ():
            self.tokens.setdefault(t.request_id, []).append(t.token_id)
        return msg

    def until(self, rid: str) -> wire.Refused | None:
        """Read until request ``rid`` finished (None) or was refused (its REFUSED)."""
        while True:
            msg = self.next()
            if isinstance(msg, wire.Refused) and msg.request_id == rid:
                return msg
            if isinstance(msg, wire.Tokens) and any(t.request_id == rid and t.finished for t in msg.tokens):
                return None


def test_release_layers_frees_the_old_layers_once_no_request_runs_them(agents: Agents,
                                                                       smollm2_prompts: list[list[int]],
                                                                       reference: StageEngine) -> None:  # fmt: skip
    solo = agents.start("solo", 0, 30)
    control, address = agents.control("solo"), solo.data_address
    whole = solo.engine.weight_bytes
    control.send(wire.SetLayers(1, 0, 15))  # held already: answered at once, nothing dropped
    assert held(reply(control, wire.Layers)) == [(0, 30)] and solo.engine.weight_bytes == whole
    prompt, sink = smollm2_prompts[2], Sink(control)
    _admit(control, "r1", prompt, Stage("solo", 0, 30), address, 30)
    sink.next()  # r1 runs
    control.send(wire.ReleaseLayers(1, drain_s=30))
    _admit(control, "r2", prompt, Stage("solo", 0, 30), address, 5)  # needs layers being released
    refused = sink.until("r2")
    assert refused is not None and refused.code == ErrorCode.LAYERS_MOVED and refused.code.retryable
    assert "being released" in refused.reason
    assert sink.until("r1") is None  # r1 finishes on the layers it started on
    assert sink.tokens["r1"] == _greedy(reference, "ref-r1", prompt, (0, 30), 30)
    released = reply(control, wire.Layers)
    assert released.ok and released.op == "release" and held(released) == [(0, 15)]
    assert solo.engine.held == (LayerRange(0, 15),) and released.weight_bytes == solo.engine.weight_bytes < whole
    _admit(control, "r3", prompt, Stage("solo", 0, 30), address, 5)
    refused = sink.until("r3")
    assert refused is not None and refused.code == ErrorCode.LAYERS_MOVED
    assert "does not hold layers [0, 30)" in refused.reason
    # a release whose drain time is up refuses the requests still on the layers it frees
    control.send(wire.SetLayers(2, 0, 30))
    assert reply(control, wire.Layers).ok and solo.engine.held == (LayerRange(0, 30),)
    _admit(control, "r4", prompt, Stage("solo", 0, 30), address, 1000)
    sink.next()  # r4 runs
    control.send(wire.SetLayers(3, 0, 15))
    assert reply(control, wire.Layers).ok
    control.send(wire.ReleaseLayers(3, drain_s=0))
    refused = sink.until("r4")
    assert refused is not None and refused.code == ErrorCode.LAYERS_MOVED and "drain time is up" in refused.reason
    released = reply(control, wire.Layers)
    assert released.ok and held(released) == [(0, 15)] and not solo.engine.has_request("r4")


def test_a_set_layers_that_does_not_fit_is_refused_naming_the_bytes(agents: Agents, smollm2_prompts: list[list[int]],
                                                                    hf_greedy: list[list[int]]) -> None:  # fmt: skip
    a = agents.start("a", 0, 15, kv_capacity_tokens=10**9)  # KV room for 15 more layers: beyond any device
    b = agents.start("b", 15, 30)
    b.layers.max_weight_bytes = b.engine.weight_bytes + 1000  # as --max-weight-bytes would
    control_a, control_b = agents.control("a"), agents.control("b")
    with PinnedClient(agents.addresses(), secret=KEY, ready_timeout_s=20) as client:
        client.submit("r", smollm2_prompts[3], SPLIT, max_tokens=10)
        client.outputs.get(timeout=30)  # started
        control_a.send(wire.SetLayers(1, 0, 30))
        control_b.send(wire.SetLayers(1, 0, 30))
        refused_a, refused_b = reply(control_a, wire.Layers), reply(control_b, wire.Layers)
        assert tokens(outputs(client, "r")) == hf_greedy[3]  # nothing serving was disturbed
    assert "not enough memory" in refused_a.error and "of KV room" in refused_a.error and "bytes free" in \
        refused_a.error
    assert "--max-weight-bytes" in refused_b.error and f"{b.engine.weight_bytes:,}" in refused_b.error
    for msg, agent, start in ((refused_a, a, 0), (refused_b, b, 15)):
        assert (msg.version, msg.op, msg.layer_start, msg.layer_end) == (1, "load", start, start + 15)
        assert held(msg) == [(start, start + 15)] and agent.engine.held == (LayerRange(start, start + 15),)
    # bad messages name the field; the agent keeps serving
    control_b.dealer.send_multipart([msgspec.msgpack.encode(
        [wire.PROTOCOL_VERSION, {"k": "SET_LAYERS", "version": 2, "layer_start": 5, "layer_end": 5}])])
    error = reply(control_b, wire.Error)
    assert "SET_LAYERS.layer_end: expected more than layer_start 5, got 5" in error.reason
    for msg, fragment in ((wire.SetLayers(2, 15, 40), "SET_LAYERS.layer_end: 40 is past the model's last layer"),
                          (wire.ReleaseLayers(7), "RELEASE_LAYERS.version: 7 is not the latest"),
                          (wire.SetLayers(2, 15, 30), ""),  # held already: done at once
                          (wire.SetLayers(1, 0, 30), "SET_LAYERS.version: 1 is older than version 2")):
        control_b.send(msg)
        answer = reply(control_b, wire.Layers)
        assert fragment in answer.error and bool(fragment) != answer.ok, (msg, answer)


# -- leaving: SIGTERM (a subprocess agent that joins with no layers) --------------------------


def test_sigterm_drains_refuses_new_requests_then_exits_zero(tmp_path: Path, smollm2_dir: Path,
                                                             smollm2_prompts: list[list[int]],
                                                             hf_greedy: list[list[int]]) -> None:  # fmt: skip
    agents = start_agents(tmp_path, smollm2_dir, {"solo": (0, 30)},
                          extra={"solo": ["--no-layers", "--drain-timeout-s", "3", "--kv-capacity-tokens", "8192"]})
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        control = BareCoordinator(ctx, agents.addresses()["solo"], "solo", KEY)
        assert (control.welcome.layer_start, control.welcome.layer_end, control.welcome.held) == (0, 0, ())
        control.send(wire.SetLayers(1, 0, 30))
        assert reply(control, wire.Layers).ok
        address, sink = agents.agents["solo"].ready["data"], Sink(control)
        _admit(control, "short", smollm2_prompts[0], Stage("solo", 0, 30), address, 10)
        _admit(control, "long", smollm2_prompts[0], Stage("solo", 0, 30), address, 5000)
        sink.next()  # they run
        agents.agents["solo"].popen.send_signal(signal.SIGTERM)
        leaving = reply(control, wire.Leaving)
        assert leaving.node_id == "solo" and leaving.drain_s == 3 and leaving.running >= 1
        _admit(control, "late", smollm2_prompts[1], Stage("solo", 0, 30), address, 5)
        refused = sink.until("late")
        assert refused is not None and refused.code == ErrorCode.LEAVING and refused.code.retryable
        refused = sink.until("long")
        assert refused is not None and refused.code == ErrorCode.LEAVING and "drain time (3 s) is up" in refused.reason
        assert sink.tokens["short"] == hf_greedy[0]  # finished while the agent drained
        assert agents.agents["solo"].popen.wait(timeout=10) == 0
    finally:
        ctx.destroy(linger=0)
        agents.stop()
