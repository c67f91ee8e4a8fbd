"""Node agents over real ZeroMQ on loopback, driven by the coordinator core on chosen pipelines (PinnedClient).

Agents run as subprocesses (``helix agent`` started by ``router.launch``, one torch thread each) and are
always stopped (SIGTERM, then SIGKILL) by the fixtures. SmolLM2-135M split over three agents must
give exactly the greedy tokens of ``transformers``; bad input is rejected while the agents keep
serving; KV refusals, start-up errors and agent death are reported clearly.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq

from helix import wire
from helix.domain import ErrorCode, FinishReason, Stage
from node_agent.step_log import read_step_log
from router.agent_events import AgentDied, AgentJoined
from router.agents_io import AgentsIO
from router.launch import AgentProcesses
from router.pinned import PinnedClient
from router.request import RequestOutput

SECRET = "agent-test-secret"
NEW_TOKENS = 10  # conftest.SMOLLM2_NEW_TOKENS: hf_greedy continuations are this long
MAX_FRAME = 4 << 20
STOP_GRACE_S = 15  # SIGTERM, then SIGKILL after this long (the vLLM agents take a while to exit)


def write_cluster(root: Path, placement: dict[str, tuple[int, int]]) -> tuple[Path, Path]:
    nodes = "\n".join(f"  - {{id: {n}, gpu: CPU}}" for n in placement)
    cluster = root / "cluster.yaml"
    cluster.write_text(f"name: local\nmodel: test\nprofiles: p.yaml\nnodes:\n{nodes}\n"
                       "defaults:\n  intra_region: {bandwidth_gbps: 10, latency_ms: 0.1}\n")
    plan = root / "plan.json"
    plan.write_text(json.dumps({"cluster": "local", "model": "test", "method": "manual", "max_flow_tok_s": 0,
                                "placement": {n: list(r) for n, r in placement.items()}}))
    return cluster, plan


def start_agents(root: Path, model_dir: Path, placement: dict[str, tuple[int, int]],
                 extra: dict[str, list[str]] | None = None, timeout_s: float = 90) -> AgentProcesses:
    """``placement``'s agents (``extra``: per node, arguments after the common ones), ready."""
    cluster, plan = write_cluster(root, placement)
    agents = AgentProcesses(cluster, plan, root, secret=SECRET, model_dir=str(model_dir),
                            extra_args=("--chunk-size", "16", "--token-budget", "40", "--max-batch-size", "6",
                                        "--max-frame-bytes", str(MAX_FRAME)))  # fmt: skip
    try:
        for node in placement:
            agents.start_one(node, (extra or {}).get(node, ()))
        agents.wait_ready(timeout_s=timeout_s)
    except BaseException:
        agents.stop()
        raise
    return agents


@pytest.fixture(scope="module")
def smol_agents(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcesses]:
    """a holds [0, 10), b holds [5, 20) (overlapping), c holds [20, 30) with a small KV (600 tokens)."""
    agents = start_agents(tmp_path_factory.mktemp("smol"), smollm2_dir, {"a": (0, 10), "b": (5, 20), "c": (20, 30)},
                          extra={"c": ["--kv-capacity-tokens", "600"]})
    try:
        yield agents
    finally:
        codes = agents.stop(grace_s=STOP_GRACE_S)
    assert codes == {"a": 0, "b": 0, "c": 0}, "agents must exit cleanly on SIGTERM"


@pytest.fixture
def coordinator(smol_agents: AgentProcesses) -> Iterator[PinnedClient]:
    with PinnedClient(smol_agents.addresses(), secret=SECRET.encode(), ready_timeout_s=20) as client:
        yield client


REQUEST_IDS = itertools.count()  # ids never repeat in a session: the agents key requests by them


def run(client: PinnedClient, work: list[tuple[list[int], list[Stage]]], *, max_tokens: int = NEW_TOKENS,
        join_every_tokens: int = 3, timeout_s: float = 120) -> dict[int, list[RequestOutput]]:
    """Greedy requests; request i is submitted once ``i * join_every_tokens`` tokens came back, so
    requests join mid-flight. The outputs of request i, its last one finished."""
    index: dict[str, int] = {}
    got: dict[int, list[RequestOutput]] = {i: [] for i in range(len(work))}
    submitted = finished = received = 0
    deadline = time.monotonic() + timeout_s
    while finished < len(work):
        while submitted < len(work) and received >= submitted * join_every_tokens:
            prompt, pipeline = work[submitted]
            request_id = f"req-{next(REQUEST_IDS)}"
            index[request_id] = submitted
            client.submit(request_id, prompt, pipeline, max_tokens=max_tokens, temperature=0.0)
            submitted += 1
        out = client.outputs.get(timeout=max(0.1, deadline - time.monotonic()))
        got[index[out.request_id]].append(out)
        received += len(out.token_ids)
        finished += out.finished
    return got


def tokens_of(got: dict[int, list[RequestOutput]]) -> list[list[int]]:
    return [[t for out in got[i] for t in out.token_ids] for i in sorted(got)]


def finish_reason(outputs: list[RequestOutput]) -> FinishReason | None:
    return outputs[-1].finish.reason if outputs[-1].finish is not None else None


SUB_RANGE = [Stage("a", 0, 10), Stage("b", 10, 20), Stage("c", 20, 30)]  # b holds [5, 20), runs [10, 20)
OTHER_SPLIT = [Stage("a", 0, 5), Stage("b", 5, 20), Stage("c", 20, 30)]  # a runs half its layers


def test_three_agents_match_transformers_greedy(coordinator: PinnedClient, smollm2_prompts: list[list[int]],
                                                hf_greedy: list[list[int]]) -> None:
    got = run(coordinator, [(p, SUB_RANGE) for p in smollm2_prompts])
    assert tokens_of(got) == hf_greedy
    assert all(finish_reason(got[i]) == FinishReason.LENGTH and got[i][-1].node == "c" for i in got)


def test_partial_sub_ranges_on_both_overlapping_nodes(coordinator: PinnedClient, smollm2_prompts: list[list[int]],
                                                      hf_greedy: list[list[int]]) -> None:
    work = [(p, OTHER_SPLIT if i % 2 else SUB_RANGE) for i, p in enumerate(smollm2_prompts[:4])]
    assert tokens_of(run(coordinator, work, join_every_tokens=1)) == hf_greedy[:4]


def test_kv_is_freed_on_every_stage_after_requests_finish(coordinator: PinnedClient,
                                                         smollm2_prompts: list[list[int]]) -> None:
    run(coordinator, [(smollm2_prompts[1], SUB_RANGE)], max_tokens=3)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        reports = coordinator.io.kv_reports()
        if len(reports) == 3 and all(r.reserved_tokens == 0 and r.running == 0 for r in reports.values()):
            break
        time.sleep(0.05)
    assert {n: r.reserved_tokens for n, r in coordinator.io.kv_reports().items()} == {"a": 0, "b": 0, "c": 0}
    assert coordinator.io.kv_reports()["c"].capacity_tokens == 600


def test_request_that_can_never_fit_is_refused_by_the_stage_that_cannot_hold_it(
        coordinator: PinnedClient, smollm2_prompts: list[list[int]]) -> None:
    got = run(coordinator, [(smollm2_prompts[1], SUB_RANGE)], max_tokens=700)
    refusal = got[0][-1]
    assert tokens_of(got) == [[]] and refusal.code == ErrorCode.CAPACITY and refusal.node == "c"
    message = refusal.error.message if refusal.error is not None else ""
    assert "needs 741 KV tokens" in message and "holds only 600" in message
    got = run(coordinator, [(smollm2_prompts[1], SUB_RANGE)], max_tokens=100_000)
    assert tokens_of(got) == [[]] and got[0][-1].code == ErrorCode.CAPACITY and got[0][-1].node == "a"


def _raw_dealer(ctx: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(address)
    return sock


def _reply(sock: zmq.Socket[Any]) -> wire.Message:
    return wire.decode(sock.recv_multipart())


def test_bad_input_is_rejected_and_agents_keep_serving(smol_agents: AgentProcesses, coordinator: PinnedClient,
                                                       smollm2_prompts: list[list[int]],
                                                       hf_greedy: list[list[int]]) -> None:
    ctx = zmq.Context()
    try:
        sock = _raw_dealer(ctx, smol_agents.addresses()["a"])
        cancel = {"k": "CANCEL", "request_id": "x"}
        bad_control = {
            "not valid msgpack": [b"\xc1\xc1\xc1"],
            "protocol version 6": [msgspec.msgpack.encode([6, cancel])],
            "unknown message kind 'FLY'": [msgspec.msgpack.encode([wire.PROTOCOL_VERSION, {**cancel, "k": "FLY"}])],
            "over the limit": [b"\x00" * (MAX_FRAME + 10)],
            "CANCEL before the handshake": wire.encode(wire.Cancel("x")),
            "AUTH without a pending HELLO": wire.encode(wire.Auth(b"0" * 32)),
        }
        for fragment, frames in bad_control.items():
            sock.send_multipart(frames)
            reply = _reply(sock)
            assert isinstance(reply, wire.Error) and fragment in reply.reason, (fragment, reply)
        # a coordinator without the secret is never welcomed
        sock.send_multipart(wire.encode(wire.Hello("impostor", wire.make_nonce())))
        challenge = _reply(sock)
        assert isinstance(challenge, wire.Challenge)
        sock.send_multipart(wire.encode(wire.Auth(wire.prove(b"guess", "coordinator", challenge.nonce, b""))))
        reply = _reply(sock)
        assert isinstance(reply, wire.Error) and reply.code == "auth"
        # garbage on the data plane: logged, nothing to answer
        push = ctx.socket(zmq.PUSH)
        push.connect(smol_agents.agents["b"].ready["data"])
        push.send_multipart([b"garbage"])
        push.send_multipart(wire.encode(wire.Activations("ghost", 0, 0, "float32", (1, 3), b"\x00" * 12)))
        push.send_multipart([msgspec.msgpack.encode([0, cancel])])
        push.close(linger=5000)  # deliver before the context goes
    finally:
        ctx.destroy(linger=0)
    assert tokens_of(run(coordinator, [(p, SUB_RANGE) for p in smollm2_prompts[:3]])) == hf_greedy[:3]
    assert "rejected a data-plane message" in smol_agents.agents["b"].log_text()
    assert "rejected a control-plane message" in smol_agents.agents["a"].log_text()


def test_wrong_secret_coordinator_is_never_connected(smol_agents: AgentProcesses) -> None:
    with AgentsIO({"a": smol_agents.addresses()["a"]}, secret=b"not-the-secret") as io:
        assert not io.wait_ready(timeout_s=1.5)
        assert "shared secret" in (io.agents()["a"].auth_error or "")


def test_missing_weights_dir_is_reported_by_name(tmp_path: Path, smollm2_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from helix.cli import main

    cluster, plan = write_cluster(tmp_path, {"a": (0, 30)})
    base = ["agent", "--cluster", str(cluster), "--plan", str(plan), "--node", "a"]
    missing = tmp_path / "no-such-model"
    assert main([*base, "--model-dir", str(missing)]) == 5
    err = capsys.readouterr().err.replace("\n", "")
    assert str(missing) in err and "not found" in err
    empty = tmp_path / "empty-model"
    empty.mkdir()
    (empty / "config.json").write_text((smollm2_dir / "config.json").read_text())
    assert main([*base, "--model-dir", str(empty)]) == 5
    assert "no *.safetensors weights file" in capsys.readouterr().err.replace("\n", "")
    assert main([*base, "--gather-window-ms", "-1"]) != 0
    err = capsys.readouterr().err.replace("\n", "")
    assert "--gather-window-ms" in err and "0 or more" in err


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def next_event(client: PinnedClient, kind: type[AgentDied | AgentJoined], timeout_s: float) -> tuple[str, float]:
    """The node of the next ``kind`` event on ``client.events`` (other events skipped), and when it came."""
    deadline = time.monotonic() + timeout_s
    while True:
        event = client.events.get(timeout=max(0.01, deadline - time.monotonic()))
        if isinstance(event, kind):
            return event.node, time.monotonic()


def test_dead_agent_is_noticed_and_used_again_when_back(tmp_path: Path, tiny_model: Path) -> None:
    agents = start_agents(tmp_path, tiny_model, {"a": (0, 2), "b": (2, 4)})
    try:
        with PinnedClient(agents.addresses(), secret=SECRET.encode(), dead_after_s=1.0, ready_timeout_s=20) as client:
            pipeline = [Stage("a", 0, 2), Stage("b", 2, 4)]
            client.submit("long", [1, 2, 3], pipeline, max_tokens=400, temperature=0.0)
            assert client.outputs.get(timeout=20).started and client.outputs.get(timeout=20).token_ids  # in flight
            agents.kill("b")  # kill -9
            killed_at = time.monotonic()
            node, noticed_at = next_event(client, AgentDied, timeout_s=10)
            assert node == "b" and noticed_at - killed_at < 2.0
            last = client.outputs.get(timeout=5)
            while not last.finished:
                last = client.outputs.get(timeout=5)
            assert last.code == ErrorCode.AGENT_DEAD and last.node == "b" and last.request_id == "long"
            assert client.io.alive_nodes() == {"a"}
            # the same node comes back on the same address: the coordinator handshakes again
            steps = tmp_path / "steps-{node}.jsonl"  # the restarted agent also logs its steps
            agents.start_one("b", ["--step-log", str(steps)])  # on the control address it had
            agents.wait_ready(timeout_s=90)
            assert next_event(client, AgentJoined, timeout_s=20)[0] == "b"
            got = run(client, [([5, 6, 7], pipeline)], max_tokens=4)
            assert len(tokens_of(got)[0]) == 4
        assert agents.stop(grace_s=STOP_GRACE_S)["b"] == 0  # the log is written out when the agent stops
        records = read_step_log(tmp_path / "steps-b.jsonl")
        # b entered at layer 2 for every step: the 3-token prompt, then one decode per new token
        assert [r["by_start"] for r in records] == [{2: (3, 0, 0)}, {2: (0, 1, 4)}, {2: (0, 1, 5)}, {2: (0, 1, 6)}]
    finally:
        agents.stop()


# ---- the vLLM backend (these run in .venv-vllm: `make test` runs `pytest -m vllm` there) ----------------

VLLM = ["--backend", "vllm"]
VLLM_PIPELINE = [Stage("va", 0, 10), Stage("vb", 10, 20), Stage("vc", 20, 30)]
MIXED_PIPELINE = [Stage("ta", 0, 10), Stage("vb", 10, 20), Stage("tc", 20, 30)]  # torch -> vLLM -> torch


@pytest.fixture(scope="module")
def vllm_agents(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcesses]:
    """va, vb, vc split SmolLM2 in three on vLLM's layers; ta and tc hold the ends on the torch engine."""
    placement = {"va": (0, 10), "vb": (10, 20), "vc": (20, 30), "ta": (0, 10), "tc": (20, 30)}
    agents = start_agents(tmp_path_factory.mktemp("vllm"), smollm2_dir, placement,
                          extra={"va": VLLM, "vb": VLLM, "vc": VLLM}, timeout_s=240)  # fmt: skip
    try:
        yield agents
    finally:
        codes = agents.stop(grace_s=STOP_GRACE_S)
    assert codes == dict.fromkeys(placement, 0), "agents must exit cleanly on SIGTERM"


@pytest.mark.vllm
def test_three_vllm_agents_match_transformers_greedy(vllm_agents: AgentProcesses, smollm2_prompts: list[list[int]],
                                                     hf_greedy: list[list[int]]) -> None:
    """Requests join mid-flight, prefills are chunked (16 tokens, 40 per step): transformers' greedy tokens."""
    with PinnedClient(vllm_agents.addresses(), secret=SECRET.encode(), ready_timeout_s=20) as client:
        got = run(client, [(p, VLLM_PIPELINE) for p in smollm2_prompts])
    assert tokens_of(got) == hf_greedy
    assert all(finish_reason(got[i]) == FinishReason.LENGTH and got[i][-1].node == "vc" for i in got)


@pytest.mark.vllm
def test_mixed_torch_and_vllm_agents_match_transformers_greedy(vllm_agents: AgentProcesses,
                                                               smollm2_prompts: list[list[int]],
                                                               hf_greedy: list[list[int]]) -> None:
    """A torch agent feeds a vLLM agent which feeds a torch agent: one hidden stream on the wire."""
    with PinnedClient(vllm_agents.addresses(), secret=SECRET.encode(), ready_timeout_s=20) as client:
        got = run(client, [(p, MIXED_PIPELINE) for p in smollm2_prompts])
    assert tokens_of(got) == hf_greedy
    assert all(got[i][-1].node == "tc" for i in got)


def _agent_error(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    from helix.cli import main

    cluster, plan = write_cluster(tmp_path, {"gpu-7": (0, 30)})
    code = main(["agent", "--cluster", str(cluster), "--plan", str(plan), "--node", "gpu-7",
                 "--model-dir", str(model_dir), *flags])  # fmt: skip
    err = capsys.readouterr().err.replace("\n", "")
    assert code == 5, err
    return err


def test_missing_vllm_install_is_a_start_up_error_naming_node_and_backend(
        tmp_path: Path, smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The main venv never has vLLM (it lives in .venv-vllm): asking for it is a clear start-up error."""
    import importlib.util

    assert importlib.util.find_spec("vllm") is None, "this test runs where vLLM is not installed (.venv)"
    err = _agent_error(tmp_path, smollm2_dir, capsys, *VLLM)
    assert "'gpu-7'" in err and "backend 'vllm'" in err and "not installed" in err and "helix-serve[vllm" in err


@pytest.mark.vllm
def test_unsupported_architecture_is_a_start_up_error_naming_node_and_backend(
        tmp_path: Path, smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    raw = json.loads((smollm2_dir / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**raw, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    err = _agent_error(tmp_path, qwen, capsys, *VLLM)
    assert "'gpu-7'" in err and "backend 'vllm'" in err and "unsupported model_type 'qwen2'" in err
