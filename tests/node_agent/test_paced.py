"""A paced request on a one-stage pipeline: the stage runs the whole model for it, yet each next step
waits for the coordinator's STEP (the coordinator decides stop strings), so nothing runs after the
coordinator stops it. Checked on the engine (``SamplingParams.paced``) and on a real agent over real
ZeroMQ on loopback (``SamplingSpec.paced``), with a random tiny Llama.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from helix import wire
from helix.domain import Stage
from node_agent.agent import AgentConfig, NodeAgent
from node_agent.engine import StageEngine
from node_agent.sampling import SamplingParams
from tests.node_agent.conftest import BareCoordinator, make_tiny_llama

SECRET = b"paced-test-secret"
PROMPT = [5, 17, 3, 42, 8]
MAX_TOKENS = 10
ACCEPTED = 3  # tokens the "coordinator" takes before it stops the request


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("paced"), "gqa-tied-llama3")[0]


def test_the_engine_waits_for_a_paced_requests_token_and_loops_an_unpaced_one_back(model_dir: Path) -> None:
    engine = StageEngine(model_dir, kv_capacity_tokens=256)
    engine.add_request("paced", SamplingParams(max_tokens=MAX_TOKENS, paced=True), prompt_token_ids=PROMPT)
    tokens = []
    for _ in range(ACCEPTED):
        (out,) = engine.step().outputs
        assert out.request_id == "paced" and out.token is not None and out.finish_reason is None
        tokens.append(out.token)
        assert not engine.step().outputs  # nothing runs until the token comes back
        engine.push_token("paced", out.token)
    engine.cancel("paced")  # the caller stops it: the token pushed last never runs
    assert not engine.step().outputs and not engine.has_unfinished
    # unpaced, the same request feeds itself: the same tokens, with no push
    engine.add_request("unpaced", SamplingParams(max_tokens=ACCEPTED), prompt_token_ids=PROMPT)
    looped = [engine.step().outputs[0].token for _ in range(ACCEPTED)]
    assert looped == tokens and not engine.has_unfinished


@pytest.fixture
def agent(model_dir: Path) -> Iterator[NodeAgent]:
    ctx = zmq.Context()
    node = NodeAgent(AgentConfig("solo", secret=SECRET), StageEngine(model_dir, kv_capacity_tokens=256), ctx)
    thread = threading.Thread(target=node.run, name="agent-io", daemon=True)
    thread.start()
    try:
        yield node
    finally:
        node.stop()
        thread.join(timeout=15)
        ctx.destroy(linger=0)


def test_a_paced_one_stage_request_runs_one_step_per_token_the_coordinator_takes(agent: NodeAgent) -> None:
    ctx = zmq.Context()
    try:
        coordinator = BareCoordinator(ctx, agent.control_address, "solo", SECRET)
        spec = wire.SamplingSpec(paced=True)
        stage = wire.StageRef(Stage("solo", 0, agent.engine.layer_end), agent.data_address)
        coordinator.send(wire.Admit("r.1", tuple(PROMPT), MAX_TOKENS, spec, (stage,), coordinator.reply_to))
        taken = []
        while True:
            out = coordinator.token()
            assert out.request_id == "r.1" and out.step == len(taken) and not out.finished
            taken.append(out.token_id)
            if len(taken) == ACCEPTED:  # the coordinator stops it (a stop string, say)
                coordinator.send(wire.Cancel("r.1"))
                break
            coordinator.send(wire.Step("r.1", out.step, out.token_id))
        # the engine thread applies control messages in order: this answer comes after the CANCEL took effect
        coordinator.send(wire.UnloadTask("no-such-task"))
        status = coordinator.control_reply()
        assert isinstance(status, wire.TaskStatus) and status.ok
        assert not agent.engine.has_request("r.1")
        assert agent.stats.steps == agent.stats.tokens == ACCEPTED  # no step after the coordinator stopped it
    finally:
        ctx.destroy(linger=0)
