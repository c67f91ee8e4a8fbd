"""The cluster's CURVE keys and peer policy (helix.keys) and ``helix keys``, without agents.

Certificates are the ones ``zmq.auth`` writes; the policy decides which hosts results may go to,
which keys each plane lets in (KeyGuard, the ZAP callback) and which nodes may precede which.
The same rules with real agents and sockets: tests/node_agent/test_curve.py.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest
import yaml
import zmq.auth

from helix.addresses import LOOPBACK_HOSTS
from helix.cli import main
from helix.errors import ConfigError, ProtocolError
from helix.keys import (
    CONTROL,
    DATA,
    KeyGuard,
    RefusalLog,
    coordinator_keys,
    peer_policy,
    predecessors,
    read_certificate,
)
from helix.spec import load_cluster

NODES = ["a", "b"]


def write_cluster(root: Path, **extra: object) -> Path:
    raw = {"name": "k", "model": "m", "profiles": "p.yaml",
           "nodes": [{"id": n, "gpu": "G"} for n in NODES],
           "defaults": {"intra_region": {"bandwidth_gbps": 10}}, **extra}  # fmt: skip
    path = root / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_certificates_read_as_zmq_auth_reads_them(tmp_path: Path) -> None:
    public_file, secret_file = zmq.auth.create_certificates(tmp_path, "x")
    assert read_certificate(public_file) == (zmq.auth.load_certificate(public_file)[0], None)
    assert read_certificate(secret_file) == zmq.auth.load_certificate(secret_file)
    bad = tmp_path / "bad.key"
    bad.write_text('curve\n    public-key = "short"\n')
    with pytest.raises(ConfigError, match="bad.key: public-key is not a 40-character Z85 key"):
        read_certificate(bad)
    with pytest.raises(ConfigError, match="missing.key: cannot read the key certificate"):
        read_certificate(tmp_path / "missing.key")


def test_keys_dir_and_public_key_name_every_vertex(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    for name in ["coordinator", *NODES]:
        zmq.auth.create_certificates(tmp_path / "keys", name)
    override = zmq.curve_keypair()[0].decode()
    raw_nodes = [{"id": "a", "gpu": "G", "public_key": override}, {"id": "b", "gpu": "G"}]
    cluster = load_cluster(write_cluster(tmp_path, keys_dir="keys", nodes=raw_nodes))
    policy = peer_policy(cluster)
    assert policy.curve and policy.key_of("a") == override.encode()  # public_key wins over keys_dir
    assert policy.key_of("b") == read_certificate(tmp_path / "keys" / "b.key")[0]
    curve = coordinator_keys(cluster)
    assert curve is not None and curve.own.public == policy.key_of("coordinator") and set(curve.peers) == set(NODES)

    (tmp_path / "keys" / "b.key").unlink()
    with pytest.raises(ConfigError, match=r"names CURVE keys, but not for 'b'"):
        peer_policy(load_cluster(write_cluster(tmp_path, keys_dir="keys")))
    with pytest.raises(ConfigError, match="keys_dir: .*nowhere is not a directory"):
        peer_policy(load_cluster(write_cluster(tmp_path, keys_dir="nowhere")))
    with pytest.raises(ConfigError, match=r"nodes\[0\]\.public_key: 'not-a-key' is not a CURVE public key"):
        load_cluster(write_cluster(tmp_path, nodes=[{"id": "a", "gpu": "G", "public_key": "not-a-key"}]))


def test_results_go_only_to_hosts_the_cluster_file_gives(tmp_path: Path) -> None:
    unkeyed = peer_policy(load_cluster(write_cluster(tmp_path, coordinator={"address": "tcp://127.0.0.1:5550"})))
    assert not unkeyed.curve and unkeyed.hosts["a"] is None  # no address, no keys: not checked (hand-started agents)
    unkeyed.check_address("a", "tcp://10.9.9.9:4000", "stage")
    unkeyed.check_address("coordinator", "tcp://localhost:6000", "reply_to")
    with pytest.raises(ProtocolError, match="reply_to 'tcp://192.0.2.7:1' is not where 'coordinator' runs"):
        unkeyed.check_address("coordinator", "tcp://192.0.2.7:1", "reply_to")
    with pytest.raises(ProtocolError, match="names node 'evil', which is not in the cluster file"):
        unkeyed.check_address("evil", "tcp://127.0.0.1:1", "stage")

    (tmp_path / "keys").mkdir()
    for name in ["coordinator", *NODES]:
        zmq.auth.create_certificates(tmp_path / "keys", name)
    nodes = [{"id": "a", "gpu": "G", "address": "tcp://10.0.0.5:5555"}, {"id": "b", "gpu": "G"}]
    keyed = peer_policy(load_cluster(write_cluster(tmp_path, keys_dir="keys", nodes=nodes)))
    keyed.check_address("a", "tcp://10.0.0.5:41000", "stage")  # any port on its host: the data socket's
    assert keyed.hosts["b"] == LOOPBACK_HOSTS  # keyed, no address: loopback only
    for vertex, address in [("a", "tcp://127.0.0.1:41000"), ("b", "tcp://10.0.0.5:1"), ("coordinator", "tcp://10.0.0.5:1"),
                            ("b", "ipc:///tmp/x")]:  # fmt: skip
        with pytest.raises(ProtocolError, match="refused|not a tcp://"):
            keyed.check_address(vertex, address, "stage")


def test_predecessors_are_the_nodes_that_can_hand_off() -> None:
    placement = {"a": (0, 10), "b": (5, 20), "c": (20, 30)}
    assert {n: predecessors(placement, n) for n in placement} == {"a": set(), "b": {"a"}, "c": {"b"}}
    demo = {"cpu-0": (0, 30), "cpu-1": (0, 15), "cpu-2": (14, 30)}  # the demo's plan: cpu-1 -> cpu-2 or cpu-0
    assert {n: predecessors(demo, n) for n in demo} == {"cpu-0": {"cpu-1"}, "cpu-1": set(), "cpu-2": {"cpu-1"}}
    assert predecessors(demo, "cpu-2", partial_handoffs=False) == set()
    assert predecessors(placement, "c", links={("a", "c")}) == set()  # no link b -> c


def test_key_guard_lets_in_each_planes_keys_and_logs_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    coordinator, node, stranger = (zmq.curve_keypair()[0] for _ in range(3))
    guard = KeyGuard("b", {CONTROL: {"coordinator": coordinator}, DATA: {"coordinator": coordinator, "a": node}},
                     {"coordinator": coordinator, "a": node})  # fmt: skip
    assert guard.callback(CONTROL, coordinator) and guard.callback(DATA, node)
    with caplog.at_level(logging.WARNING):
        assert not guard.callback(CONTROL, node)
        assert not guard.callback(DATA, stranger)
    assert guard.refusals.refused == 2
    assert "refused a peer on the control plane of b: 'a''s key, which may not send on this plane" in caplog.text
    assert "refused a peer on the data plane of b: a key not in the cluster file" in caplog.text


def test_a_peer_that_keeps_reconnecting_cannot_flood_the_log(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    refusals = RefusalLog("cpu-1", every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        for _ in range(50):  # ZeroMQ retries every 100 ms: 5 s of a refused peer
            refusals.refuse("data", "the peer does not speak CURVE")
            now[0] += 0.1
        refusals.refuse("control", "the peer does not speak CURVE")  # another plane: its own line
        now[0] = 12.0
        refusals.refuse("data", "the peer does not speak CURVE")
    lines = [r.getMessage() for r in caplog.records]
    assert refusals.refused == 52 and lines == [
        "refused a peer on the data plane of cpu-1: the peer does not speak CURVE",
        "refused a peer on the control plane of cpu-1: the peer does not speak CURVE",
        "refused a peer on the data plane of cpu-1: the peer does not speak CURVE (49 more like it in the last 12 s)",
    ]


def test_helix_keys_writes_certificates_and_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = write_cluster(tmp_path)
    assert main(["keys", str(tmp_path / "keys"), "--cluster", str(cluster)]) == 0
    out = capsys.readouterr().out
    for name in ["coordinator", *NODES]:
        public, secret = read_certificate(tmp_path / "keys" / f"{name}.key_secret")
        assert secret is not None and read_certificate(tmp_path / "keys" / f"{name}.key")[0] == public
        assert public.decode() in out  # printed whole (a Z85 key may hold "[", which is not markup here)
        assert stat.S_IMODE((tmp_path / "keys" / f"{name}.key_secret").stat().st_mode) == 0o600
    assert "keys_dir: keys" in out
    assert main(["keys", str(tmp_path / "keys"), "a"]) == 2
    assert "key files exist already" in capsys.readouterr().err
    assert main(["keys", str(tmp_path / "keys")]) == 2
    assert "name the key pairs to make" in capsys.readouterr().err
