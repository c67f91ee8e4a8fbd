"""Who may talk to whom: the cluster's CURVE keys and the hosts results may be sent to (no zmq here).

A cluster *has keys* when its file names them: a ``public_key`` on the coordinator or a node, or a
``keys_dir`` of public certificates ``<id>.key`` as ``helix keys`` writes them (ZeroMQ's certificate
format: Z85 keys in a small text file). Then every socket of the cluster runs ZeroMQ CURVE
(encrypted, and every peer proves its key); the zmq side (helix/zmq_io.py, which the agent and
router/agents_io.py run) takes from here:

* :func:`peer_policy`: every vertex's public key and the hosts its addresses may name. Results
  (next-stage activations, tokens to ``reply_to``) go only to the host of the vertex's ``address``
  in the cluster file, or to loopback where the file gives the vertex none; a cluster without keys
  checks only the vertices whose ``address`` it gives (the local demo and hand-started agents keep
  working as before).
* :func:`predecessors`: the nodes whose activations an agent accepts (those that can hand off to
  it under the plan's placement).
* :class:`KeyGuard`: the ZAP credentials provider (``zmq.auth`` calls ``callback(domain, key)``):
  per plane, the keys let in; every refusal is logged with the plane and counted.
* :func:`read_certificate`: a certificate file's Z85 public (and secret) key.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from helix.addresses import LOOPBACK_HOSTS, host_of
from helix.errors import ConfigError, ProtocolError

if TYPE_CHECKING:
    from helix.spec import ClusterSpec

log = logging.getLogger(__name__)

Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
PUBLIC_SUFFIX, SECRET_SUFFIX = ".key", ".key_secret"  # the names zmq.auth.create_certificates writes
# ZAP domains: which plane a CURVE server socket belongs to
CONTROL, DATA, RESULTS = "control", "data", "results"


def check_z85_key(text: str) -> str:
    """``text`` if it is a 40-character Z85 CURVE key, else a ValueError saying so (pydantic adds the field)."""
    if not Z85_KEY.match(text):
        raise ValueError(f"{text!r} is not a CURVE public key (40 Z85 characters, as `helix keys` prints)")
    return text


def read_certificate(path: str | Path) -> tuple[bytes, bytes | None]:
    """The Z85 public key of a certificate file (``NAME.key`` or ``NAME.key_secret``) and its secret
    key (None in a public certificate). ConfigError naming the file when it is missing or malformed."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the key certificate ({exc.strerror})", source=str(path)) from None
    found: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and name.strip() in ("public-key", "secret-key"):
            found[name.strip()] = value.strip().strip('"')
    public, secret = found.get("public-key"), found.get("secret-key")
    for name, key in (("public-key", public), ("secret-key", secret)):
        if key is not None and not Z85_KEY.match(key):
            raise ConfigError(f"{name} is not a 40-character Z85 key", source=str(path))
    if public is None:
        raise ConfigError("no public-key in this file (write key pairs with `helix keys`)", source=str(path))
    return public.encode(), secret.encode() if secret is not None else None


@dataclass(frozen=True, slots=True)
class KeyPair:
    """One vertex's own CURVE keys (Z85), read from its secret certificate."""

    public: bytes
    secret: bytes

    @classmethod
    def load(cls, path: str | Path, *, owner: str, expected_public: bytes | None) -> KeyPair:
        """The key pair in secret certificate ``path`` of vertex ``owner``; it must match the public key the
        cluster file gives ``owner`` (else peers would refuse it: said now, not as a silent refusal)."""
        public, secret = read_certificate(path)
        if secret is None:
            raise ConfigError(f"a public certificate: {owner!r} needs its secret one (NAME{SECRET_SUFFIX})",
                              source=str(path))  # fmt: skip
        if expected_public is not None and public != expected_public:
            raise ConfigError(f"this key pair is not {owner!r}'s: the cluster file gives it public key "
                              f"{expected_public.decode()}, the file holds {public.decode()}", source=str(path))  # fmt: skip
        return cls(public, secret)


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """What a CURVE endpoint needs: its own key pair and the public keys of the peers it deals with (id -> Z85)."""

    own: KeyPair
    peers: Mapping[str, bytes]


def _host_names(address: str) -> frozenset[str]:
    """The host of ``address`` and the IP addresses it resolves to (a name in the cluster file, an IP on the wire)."""
    host = host_of(address)
    names = {host}
    if host in LOOPBACK_HOSTS:
        return LOOPBACK_HOSTS
    try:
        names |= {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        pass  # unresolvable here: only its literal name matches
    return frozenset(names)


@dataclass(frozen=True, slots=True)
class PeerPolicy:
    """The cluster's keys and where each vertex (coordinator or node) may be reached."""

    coordinator: str
    nodes: frozenset[str]
    hosts: Mapping[str, frozenset[str] | None]  # vertex -> hosts its addresses may name (None: not checked)
    public_keys: Mapping[str, bytes] = field(default_factory=dict)  # vertex -> Z85 public key; empty: CURVE off
    source: str = "<cluster>"

    @property
    def curve(self) -> bool:
        return bool(self.public_keys)

    def key_of(self, vertex: str) -> bytes | None:
        return self.public_keys.get(vertex)

    def check_address(self, vertex: str, address: str, what: str) -> None:
        """ProtocolError unless ``address`` may reach ``vertex`` (a node id or the coordinator's)."""
        if vertex != self.coordinator and vertex not in self.nodes:
            raise ProtocolError(f"{what} names node {vertex!r}, which is not in the cluster file {self.source}: refused")
        if not address.startswith("tcp://"):
            if address.startswith(("ipc://", "inproc://")) and not self.curve:
                return  # this machine only
            raise ProtocolError(f"{what} {address!r} is not a tcp:// address of {vertex!r}")
        allowed = self.hosts.get(vertex)
        if allowed is not None and host_of(address) not in allowed:
            raise ProtocolError(f"{what} {address!r} is not where {vertex!r} runs (the cluster file {self.source} "
                                f"allows {', '.join(sorted(allowed))}): refused")  # fmt: skip


def cluster_public_keys(cluster: ClusterSpec) -> dict[str, bytes]:
    """Every vertex's public key: its ``public_key`` in the file, else ``<keys_dir>/<id>.key``. Empty when the
    file names no keys; else the coordinator and every node must have one (ConfigError naming who has none)."""
    keys: dict[str, bytes] = {}
    keys_dir = Path(cluster.source).parent / cluster.keys_dir if cluster.keys_dir else None
    if keys_dir is not None and not keys_dir.is_dir():
        raise ConfigError(f"{keys_dir} is not a directory (write one with `helix keys`)", source=cluster.source,
                          field="keys_dir")  # fmt: skip
    vertices = [(cluster.coordinator.id, cluster.coordinator.public_key, "coordinator.public_key"),
                *((n.id, n.public_key, f"nodes[{i}].public_key") for i, n in enumerate(cluster.nodes))]  # fmt: skip
    for vertex, given, _ in vertices:
        if given is not None:
            keys[vertex] = given.encode()
        elif keys_dir is not None and (keys_dir / f"{vertex}{PUBLIC_SUFFIX}").is_file():
            keys[vertex] = read_certificate(keys_dir / f"{vertex}{PUBLIC_SUFFIX}")[0]
    if keys:
        missing = [(vertex, where) for vertex, _, where in vertices if vertex not in keys]
        if missing:
            names = ", ".join(repr(v) for v, _ in missing)
            hint = f"no {keys_dir}/<id>{PUBLIC_SUFFIX} either" if keys_dir else "give every vertex a public_key"
            raise ConfigError(f"the cluster names CURVE keys, but not for {names} ({hint}; `helix keys` writes them)",
                              source=cluster.source, field=missing[0][1])  # fmt: skip
    return keys


def peer_policy(cluster: ClusterSpec) -> PeerPolicy:
    """Keys and reachable hosts of every vertex of ``cluster`` (see the module doc)."""
    keys = cluster_public_keys(cluster)
    hosts: dict[str, frozenset[str] | None] = {}
    for vertex, address in [(cluster.coordinator.id, cluster.coordinator.address),
                            *((n.id, n.address) for n in cluster.nodes)]:  # fmt: skip
        if address:
            hosts[vertex] = _host_names(address)
        else:
            hosts[vertex] = LOOPBACK_HOSTS if keys else None
    return PeerPolicy(cluster.coordinator.id, frozenset(cluster.node_ids), hosts, keys, cluster.source)


def coordinator_keys(cluster: ClusterSpec, key_file: str | Path | None = None) -> CurveKeys | None:
    """The coordinator's CURVE keys (from ``key_file``, default ``<keys_dir>/<coordinator id>.key_secret``) and
    every node's public key; None when the cluster file names no keys (ConfigError when the file is missing)."""
    keys = cluster_public_keys(cluster)
    me = cluster.coordinator.id
    if not keys:
        if key_file is not None:
            raise ConfigError("the cluster file names no CURVE keys (`keys_dir` or `public_key`): nothing to use the "
                              "key for", source=cluster.source, field="--key")  # fmt: skip
        return None
    return CurveKeys(own_key_pair(cluster, me, key_file, keys), {n: k for n, k in keys.items() if n != me})


def own_key_pair(cluster: ClusterSpec, vertex: str, key_file: str | Path | None, keys: Mapping[str, bytes]) -> KeyPair:
    """``vertex``'s key pair from ``key_file`` (default ``<keys_dir>/<vertex>.key_secret``), checked against the
    public key ``keys`` gives it; ConfigError naming ``--key`` or the file."""
    if key_file is None:
        key_file = Path(cluster.source).parent / (cluster.keys_dir or ".") / f"{vertex}{SECRET_SUFFIX}"
        if not Path(key_file).is_file():
            raise ConfigError(f"the cluster has CURVE keys: give {vertex!r} its secret certificate (--key FILE; "
                              f"{key_file} does not exist)", field="--key")  # fmt: skip
    return KeyPair.load(key_file, owner=vertex, expected_public=keys[vertex])


def predecessors(placement: Mapping[str, tuple[int, int] | list[int]], node: str, *, partial_handoffs: bool = True,
                 links: Container[tuple[str, str]] | None = None) -> set[str]:  # fmt: skip
    """The nodes the router may send a request from straight to ``node`` (the max-flow graph's edges, as
    ``planner.graph.hands_off`` and ``router.pipeline.Topology`` define them): ``node`` holds the layer the
    other's range ends at (``start <= end_other < end``; with exact hand-offs only, ``end_other == start``),
    over a link of the cluster (``links``; None: any pair)."""
    start, end = placement[node]
    out = set()
    for other, (_, o_end) in placement.items():
        hands_off = start <= o_end < end if partial_handoffs else o_end == start
        if other != node and hands_off and (links is None or (other, node) in links):
            out.add(other)
    return out


REFUSAL_LOG_EVERY_S = 10.0


class RefusalLog:
    """The log of refused peers: each kind of refusal (plane and reason) at once the first time, then at
    most once every ``every_s`` with how many were refused meanwhile, so that a refused peer reconnecting
    every 100 ms (ZeroMQ's default) cannot flood the log. Thread-safe (the ZAP thread and the I/O thread)."""

    def __init__(self, owner: str, every_s: float = REFUSAL_LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.owner, self.every_s, self._clock = owner, every_s, clock
        self._kinds: dict[tuple[str, str], tuple[float, int]] = {}  # (plane, why) -> (last logged, refused since)
        self._lock = threading.Lock()
        self.refused = 0

    def refuse(self, plane: str, why: str) -> None:
        now = self._clock()
        with self._lock:
            self.refused += 1
            logged_at, since = self._kinds.get((plane, why), (-math.inf, 0))
            if now - logged_at < self.every_s:
                self._kinds[(plane, why)] = (logged_at, since + 1)
                return
            self._kinds[(plane, why)] = (now, 0)
        more = f" ({since} more like it in the last {now - logged_at:.0f} s)" if since else ""
        log.warning("refused a peer on the %s plane of %s: %s%s", plane, self.owner, why, more)


class KeyGuard:
    """The ZAP credentials provider of one process: per plane (ZAP domain), the keys let in by vertex.
    ``zmq.auth``'s authenticator calls :meth:`callback` from its thread for each CURVE handshake; refusals
    go to :attr:`refusals` (the socket monitors add the handshakes that never reach ZAP)."""

    def __init__(self, owner: str, planes: Mapping[str, Mapping[str, bytes]], known: Mapping[str, bytes],
                 refusals: RefusalLog | None = None) -> None:  # fmt: skip
        self.owner = owner
        self._planes = {plane: {key: vertex for vertex, key in allowed.items()} for plane, allowed in planes.items()}
        self._known = {key: vertex for vertex, key in known.items()}
        self.refusals = refusals or RefusalLog(owner)

    @property
    def domains(self) -> list[str]:
        return list(self._planes)

    def callback(self, domain: str, key: bytes) -> bool:
        vertex = self._planes.get(domain, {}).get(key)
        if vertex is not None:
            log.debug("%s plane of %s: %s's key accepted", domain, self.owner, vertex)
            return True
        who = self._known.get(key)
        why = f"{who!r}'s key, which may not send on this plane" if who else "a key not in the cluster file"
        self.refusals.refuse(domain, f"{why} ({key.decode(errors='replace')})")
        return False


# libzmq's socket-monitor events for a failed handshake, and its protocol error codes (zmq.h, libzmq >= 4.3)
HANDSHAKE_FAILED_NO_DETAIL, HANDSHAKE_FAILED_PROTOCOL, HANDSHAKE_FAILED_AUTH = 0x0800, 0x2000, 0x4000
HANDSHAKE_FAILED = HANDSHAKE_FAILED_NO_DETAIL | HANDSHAKE_FAILED_PROTOCOL | HANDSHAKE_FAILED_AUTH
_PROTOCOL_ERRORS = {
    0x11000002: "the peer does not speak CURVE",  # ZMTP_MECHANISM_MISMATCH
    0x11000001: "the peer's CURVE keys do not match (it dialled a wrong server key, or forged a message)",
    0x10000003: "the key exchange failed",  # ZMTP_KEY_EXCHANGE
}


def handshake_failure(event: int, value: int) -> str | None:
    """Why a peer's handshake failed, from a socket-monitor event (None: not a failed handshake)."""
    if event == HANDSHAKE_FAILED_AUTH:
        return f"its key was refused (ZAP status {value})"
    if event == HANDSHAKE_FAILED_PROTOCOL:
        return _PROTOCOL_ERRORS.get(value, f"protocol error {value:#x}")
    if event == HANDSHAKE_FAILED_NO_DETAIL:
        return f"the handshake broke off ({os.strerror(value)}; a peer without CURVE hangs up like this)"
    return None
