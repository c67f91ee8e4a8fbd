"""CURVE on every socket, with real agents over real ZeroMQ on loopback (issue 17 part 2).

Two ``helix agent`` subprocesses serve SmolLM2-135M split ``a: [0, 16)``, ``b: [16, 30)`` on a
cluster file whose ``keys_dir`` holds the key pairs ``helix keys`` wrote; the coordinator is an
in-process :class:`~router.pinned.PinnedClient` (the core over :class:`AgentsIO`) with the
coordinator's keys. Checked: the greedy tokens are ``transformers``' (as without CURVE); peers
without a key, with an unknown key, or with a known key on a plane it may not use are refused on
the control plane, on the data plane and at the coordinator's result sink, each refusal logged,
and the agents keep serving; a stolen coordinator key (with the shared secret) cannot send results
outside the cluster file's hosts, and an address on an allowed host gets nothing unless the
coordinator's key answers there.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from helix import wire
from helix.domain import FinishReason, Stage
from helix.keys import CurveKeys, coordinator_keys, read_certificate
from helix.spec import load_cluster
from router.launch import AgentProcesses
from router.pinned import PinnedClient

SECRET = "curve-test-secret"
PLACEMENT = {"a": (0, 16), "b": (16, 30)}
PIPELINE = [Stage("a", 0, 16), Stage("b", 16, 30)]
OUTSIDE = "tcp://192.0.2.7:5555"  # TEST-NET-1: in no cluster file
NEW_TOKENS = 10  # conftest.SMOLLM2_NEW_TOKENS


def write_keyed_cluster(root: Path) -> tuple[Path, Path]:
    from helix.cli import main

    assert main(["keys", str(root / "keys"), "coordinator", *PLACEMENT]) == 0
    nodes = "\n".join(f"  - {{id: {n}, gpu: CPU}}" for n in PLACEMENT)
    cluster = root / "cluster.yaml"
    cluster.write_text(f"name: keyed\nmodel: test\nprofiles: p.yaml\nkeys_dir: keys\nnodes:\n{nodes}\n"
                       "defaults:\n  intra_region: {bandwidth_gbps: 10, latency_ms: 0.1}\n")
    plan = root / "plan.json"
    plan.write_text(json.dumps({"cluster": "keyed", "model": "test", "method": "manual", "max_flow_tok_s": 0,
                                "placement": {n: list(r) for n, r in PLACEMENT.items()}}))
    return cluster, plan


class Keyed:
    def __init__(self, root: Path, agents: AgentProcesses, curve: CurveKeys) -> None:
        self.root, self.agents, self.curve = root, agents, curve
        self.data: dict[str, str] = {}

    def log(self, node: str) -> str:
        return self.agents.agents[node].log_path.read_text(errors="replace")

    def keys(self, name: str) -> tuple[bytes, bytes]:
        public, secret = read_certificate(self.root / "keys" / f"{name}.key_secret")
        assert secret is not None
        return public, secret


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Keyed]:
    root = tmp_path_factory.mktemp("curve")
    cluster, plan = write_keyed_cluster(root)
    agents = AgentProcesses(cluster, plan, root, secret=SECRET, model_dir=str(smollm2_dir),
                            extra_args=("--chunk-size", "16", "--token-budget", "40", "--max-batch-size", "6"))
    try:
        agents.start(PLACEMENT)
        agents.wait_ready(timeout_s=240)
        curve = coordinator_keys(load_cluster(cluster))
        assert curve is not None
        yield Keyed(root, agents, curve)
    finally:
        agents.stop()
    codes = {n: a.returncode for n, a in agents.agents.items()}
    assert codes == {"a": 0, "b": 0}, "keyed agents must exit cleanly on SIGTERM (ZAP authenticator stopped)"


@pytest.fixture
def coordinator(keyed: Keyed) -> Iterator[PinnedClient]:
    with PinnedClient(keyed.agents.addresses(), secret=SECRET.encode(), curve=keyed.curve) as client:
        keyed.data = {n: a.welcome.data_address for n, a in client.io.agents().items() if a.welcome is not None}
        yield client


def generate(client: PinnedClient, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy tokens of ``prompts`` on ``PIPELINE``, all submitted at once."""
    ids = [f"req-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        client.submit(request_id, prompt, PIPELINE, max_tokens=max_tokens, temperature=0.0)
    got: dict[str, list[int]] = {r: [] for r in ids}
    finished = 0
    while finished < len(prompts):
        out = client.outputs.get(timeout=120)
        assert out.error is None, out
        got[out.request_id].extend(out.token_ids)
        finished += out.finished
    return [got[r] for r in ids]


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def socket_as(ctx: zmq.Context[Any], kind: int, keys: tuple[bytes, bytes] | None, server_key: bytes | None) -> Any:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None and server_key is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = server_key
    return sock


def test_curve_cluster_gives_the_greedy_tokens_of_transformers(
        coordinator: PinnedClient, smollm2_prompts: list[list[int]], hf_greedy: list[list[int]]) -> None:  # fmt: skip
    # hf_greedy is what the same split gives without CURVE (test_agent.py checks that)
    assert generate(coordinator, smollm2_prompts[:3]) == hf_greedy[:3]


def test_peers_without_the_right_key_are_refused_on_every_plane_and_logged(
        keyed: Keyed, coordinator: PinnedClient, smollm2_prompts: list[list[int]], hf_greedy: list[list[int]],
        caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    caplog.set_level(logging.WARNING)
    control_a = keyed.agents.addresses()["a"]
    public_a, public_b = keyed.curve.peers["a"], keyed.curve.peers["b"]
    stranger = zmq.curve_keypair()
    ctx = zmq.Context()
    pushes = []  # kept open until the refusals are seen (a collected socket would close mid-handshake)
    try:
        # control plane of a: no CURVE, an unknown key, a node's key (only the coordinator's may control)
        for keys in (None, stranger, keyed.keys("b")):
            dealer = socket_as(ctx, zmq.DEALER, keys, public_a)
            dealer.setsockopt(zmq.RCVTIMEO, 1500)
            dealer.connect(control_a)
            dealer.send_multipart(wire.encode(wire.Hello("intruder", wire.make_nonce())), flags=zmq.NOBLOCK)
            with pytest.raises(zmq.Again):
                dealer.recv_multipart()  # never welcomed: no CHALLENGE comes back
            dealer.close()
        # data plane: no CURVE and an unknown key at b; b's own key at a (b never precedes a)
        activations = wire.encode(wire.Activations("ghost", 0, 0, "float32", (1, 576), b"\x00" * 576 * 4))
        for node, keys, server_key in (("b", None, public_b), ("b", stranger, public_b), ("a", keyed.keys("b"), public_a)):
            push = socket_as(ctx, zmq.PUSH, keys, server_key)
            push.connect(keyed.data[node])
            push.send_multipart(activations, flags=zmq.NOBLOCK)  # queued, never delivered
            pushes.append(push)
        # the coordinator's result sink: no CURVE, an unknown key
        for keys in (None, stranger):
            push = socket_as(ctx, zmq.PUSH, keys, keyed.curve.own.public)
            push.connect(coordinator.io.reply_to)
            push.send_multipart(wire.encode(wire.Tokens("a", (wire.TokenOut("ghost", 0, 1, FinishReason.STOP),))),
                                flags=zmq.NOBLOCK)  # fmt: skip
            pushes.append(push)
        wait_for(lambda: keyed.log("a").count("refused a peer on the control plane of a") >= 3, "a's control refusals")
        wait_for(lambda: "data plane of a: 'b''s key" in keyed.log("a"), "a's data refusal")
        wait_for(lambda: keyed.log("b").count("refused a peer on the data plane of b") >= 2, "b's data refusals")
        wait_for(lambda: caplog.text.count("refused a peer on the results plane") >= 2, "the sink's refusals")
    finally:
        ctx.destroy(linger=0)
    # (a peer without CURVE is logged as "does not speak CURVE" or as a broken-off handshake: who notices first)
    log_a, log_b = keyed.log("a"), keyed.log("b")
    assert "control plane of a: a key not in the cluster file" in log_a
    assert "control plane of a: 'b''s key, which may not send on this plane" in log_a
    assert "data plane of b: a key not in the cluster file" in log_b
    assert "results plane of coordinator: a key not in the cluster file" in caplog.text
    assert coordinator.io.rejected == 0  # nothing the refused peers sent reached the coordinator's decoder
    # the agents keep serving
    assert generate(coordinator, smollm2_prompts[3:5]) == hf_greedy[3:5]


def test_a_stolen_coordinator_key_cannot_send_results_outside_the_cluster(
        keyed: Keyed, coordinator: PinnedClient, smollm2_prompts: list[list[int]], hf_greedy: list[list[int]]) -> None:
    stolen = keyed.keys("coordinator")
    prompt = tuple(smollm2_prompts[0])
    ctx = zmq.Context()
    try:
        dealer = socket_as(ctx, zmq.DEALER, stolen, keyed.curve.peers["a"])
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(keyed.agents.addresses()["a"])

        def reply() -> wire.Message:
            while True:
                msg = wire.decode(dealer.recv_multipart())
                if not isinstance(msg, wire.Heartbeat):
                    return msg

        nonce = wire.make_nonce()
        dealer.send_multipart(wire.encode(wire.Hello("thief", nonce)))
        challenge = reply()
        assert isinstance(challenge, wire.Challenge)
        dealer.send_multipart(wire.encode(wire.Auth(wire.prove(SECRET.encode(), "coordinator", challenge.nonce, nonce))))
        assert isinstance(reply(), wire.Welcome)  # the thief is a coordinator now

        stages = tuple(wire.StageRef(s, keyed.data[s.node]) for s in PIPELINE)
        sink = coordinator.io.reply_to
        redirected = {
            "reply_to": (stages, OUTSIDE),
            "stage address": ((stages[0], wire.StageRef(Stage("b", 16, 30), OUTSIDE)), sink),
            "not in the cluster file": ((stages[0], wire.StageRef(Stage("evil", 16, 30), OUTSIDE)), sink),
        }
        for i, (fragment, (pipeline, reply_to)) in enumerate(redirected.items()):
            dealer.send_multipart(wire.encode(wire.Admit(f"steal-{i}", prompt, 4, wire.SamplingSpec(), pipeline,
                                                         reply_to)))  # fmt: skip
            refusal = reply()
            assert isinstance(refusal, wire.Error) and fragment in refusal.reason and "refused" in refusal.reason, refusal

        # an address on an allowed host (loopback) where no one holds the coordinator's key gets nothing
        catcher = ctx.socket(zmq.PULL)
        catcher.setsockopt(zmq.LINGER, 0)
        attempts = catcher.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        port = catcher.bind_to_random_port("tcp://127.0.0.1")
        dealer.send_multipart(wire.encode(wire.Admit("steal-3", prompt, 4, wire.SamplingSpec(), stages,
                                                     f"tcp://127.0.0.1:{port}")))  # fmt: skip
        assert attempts.poll(60_000), "b never dialled the reply_to address"
        # b dialled it as a CURVE client expecting the coordinator's key: the handshake failed, no tokens came
        assert catcher.poll(1000) == 0
    finally:
        ctx.destroy(linger=0)
    assert "reply_to 'tcp://192.0.2.7:5555' is not where 'coordinator' runs" in keyed.log("a")
    # the agents keep serving the real coordinator
    assert generate(coordinator, [smollm2_prompts[0]]) == [hf_greedy[0]]


def test_agent_key_errors_are_named_before_anything_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from helix.cli import main

    cluster, plan = write_keyed_cluster(tmp_path)
    base = ["agent", "--cluster", str(cluster), "--plan", str(plan), "--node", "a", "--model-dir", str(tmp_path)]
    (tmp_path / "keys" / "a.key_secret").rename(tmp_path / "a.key_secret")
    assert main(base) == 2
    assert "give 'a' its secret certificate (--key FILE" in capsys.readouterr().err.replace("\n", "")
    assert main([*base, "--key", str(tmp_path / "keys" / "b.key_secret")]) == 2
    assert "this key pair is not 'a''s" in capsys.readouterr().err.replace("\n", "")
    assert main([*base, "--key", str(tmp_path / "keys" / "b.key")]) == 2
    assert "a public certificate" in capsys.readouterr().err.replace("\n", "")
    assert main([*base, "--key", str(tmp_path / "a.key_secret"), "--bind", "tcp://10.1.2.3:5555"]) == 2
    assert "would bind tcp://10.1.2.3:5555" in capsys.readouterr().err.replace("\n", "")
    zmq.auth.create_certificates(tmp_path, "loose")
    unkeyed = tmp_path / "unkeyed.yaml"
    unkeyed.write_text(cluster.read_text().replace("keys_dir: keys\n", ""))
    assert main(["agent", "--cluster", str(unkeyed), "--plan", str(plan), "--node", "a", "--key",
                 str(tmp_path / "loose.key_secret")]) == 2  # fmt: skip
    assert "names no CURVE keys" in capsys.readouterr().err.replace("\n", "")
