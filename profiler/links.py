"""Measuring links through ZeroMQ: one probe process per vertex, ping and bulk transfer per pair.

Every vertex of the cluster (coordinator and nodes) whose address is on this machine gets a
*probe*: a process (``python -m profiler.links --bind ENDPOINT``, started and stopped by
:mod:`helix.processes`) with a ZeroMQ ROUTER socket on the vertex's host (an ephemeral port, so
running agents are not disturbed). For each
directed link ``src -> dst`` the profiler asks ``src``'s probe to measure toward ``dst``'s:

* **latency**: ``pings`` round trips of a tiny message; ``latency_ms`` = median RTT / 2;
* **bandwidth**: ``bulk_bytes`` in ``chunk_bytes`` frames, pipelined, then one ack;
  ``bandwidth_gbps`` = bits / (elapsed - one RTT) / 10^9.

So the numbers include ZeroMQ, TCP and the kernel, as the agents' activations see them.
Vertices on other machines are not probed (their declared links stay as they are).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from helix.addresses import LOOPBACK, LOOPBACK_HOSTS
from helix.processes import READY, Supervisor

DEFAULT_PINGS = 30
DEFAULT_BULK_BYTES = 16 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 1024 * 1024
REPLY_TIMEOUT_MS = 30_000


@dataclass(frozen=True, slots=True)
class LinkMeasurement:
    src: str
    dst: str
    bandwidth_gbps: float
    latency_ms: float

    def as_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "bandwidth_gbps": self.bandwidth_gbps, "latency_ms": self.latency_ms}


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, its hostname, or one of its addresses)."""
    if host in LOOPBACK_HOSTS or host in ("0.0.0.0", "*") or host.startswith("127."):
        return True
    try:
        mine = {socket.gethostname(), socket.getfqdn()}
        mine |= {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)}
        return host in mine or socket.gethostbyname(host) in mine
    except OSError:
        return False


# -- the probe process -------------------------------------------------------------------------


def _measure_to(ctx: zmq.Context[Any], endpoint: str, pings: int, bulk_bytes: int, chunk_bytes: int) -> dict[str, float]:
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVTIMEO, REPLY_TIMEOUT_MS)
    peer.connect(endpoint)
    try:
        peer.send_multipart([b"ping"])  # connection set-up, not timed
        peer.recv_multipart()
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            peer.send_multipart([b"ping"])
            peer.recv_multipart()
            rtts.append(time.perf_counter() - t0)
        rtt = statistics.median(rtts)
        chunk = b"\0" * chunk_bytes
        chunks = max(1, bulk_bytes // chunk_bytes)
        t0 = time.perf_counter()
        for _ in range(chunks):
            peer.send_multipart([b"bulk", chunk], copy=False)
        peer.send_multipart([b"done"])
        reply = peer.recv_multipart()
        elapsed = time.perf_counter() - t0
        sent = int(reply[1])
        transfer = max(elapsed - rtt, 1e-9)
        return {"rtt_s": rtt, "bytes": sent, "bandwidth_gbps": sent * 8 / transfer / 1e9}
    finally:
        peer.close()


def serve_probe(bind: str) -> None:
    """Run a probe: print ``READY endpoint=<the bound endpoint>``, then answer ping / bulk / measure until killed."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    print(f"{READY} endpoint={sock.getsockopt_string(zmq.LAST_ENDPOINT)}", flush=True)
    received: dict[bytes, int] = {}
    while True:
        ident, cmd, *rest = sock.recv_multipart(copy=True)
        if cmd == b"ping":
            sock.send_multipart([ident, b"pong"])
        elif cmd == b"bulk":
            received[ident] = received.get(ident, 0) + len(rest[0])
        elif cmd == b"done":
            sock.send_multipart([ident, b"got", str(received.pop(ident, 0)).encode()])
        elif cmd == b"measure":
            params = json.loads(rest[0])
            result: dict[str, Any]
            try:
                result = _measure_to(ctx, params["endpoint"], params["pings"], params["bulk_bytes"], params["chunk_bytes"])
            except zmq.ZMQError as exc:
                result = {"error": str(exc)}
            sock.send_multipart([ident, b"result", json.dumps(result).encode()])


# -- the measurer ------------------------------------------------------------------------------


class ProbeSet:
    """Probe processes for the local vertices; a context manager that stops them on exit."""

    def __init__(self, hosts: dict[str, str]) -> None:
        self.hosts = hosts
        self.endpoints: dict[str, str] = {}
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._logs = tempfile.TemporaryDirectory(prefix="helix-probes-")
        self._probes = Supervisor(Path(self._logs.name), label="link probe")

    def __enter__(self) -> ProbeSet:
        try:
            for vertex, host in self.hosts.items():
                bind_host = LOOPBACK if host in ("localhost", "0.0.0.0", "*") else host
                self._probes.start(vertex, [sys.executable, "-m", "profiler.links", "--bind", f"tcp://{bind_host}:*"])
            self._probes.wait_ready(timeout_s=60)
        except BaseException:
            self.__exit__()
            raise
        self.endpoints = {vertex: p.ready["endpoint"] for vertex, p in self._probes.processes.items() if p.ready}
        return self

    def __exit__(self, *exc: object) -> None:
        self._probes.stop()
        self._logs.cleanup()

    def _request(self, vertex: str, frames: list[bytes]) -> list[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoints[vertex])
        try:
            sock.send_multipart(frames)
            if not sock.poll(REPLY_TIMEOUT_MS):
                raise TimeoutError(f"probe of {vertex} did not answer within {REPLY_TIMEOUT_MS} ms")
            return sock.recv_multipart()
        finally:
            sock.close()

    def measure(
        self, src: str, dst: str, *, pings: int = DEFAULT_PINGS, bulk_bytes: int = DEFAULT_BULK_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> LinkMeasurement:
        params = {"endpoint": self.endpoints[dst], "pings": pings, "bulk_bytes": bulk_bytes, "chunk_bytes": chunk_bytes}
        reply = self._request(src, [b"measure", json.dumps(params).encode()])
        result = json.loads(reply[1])
        if "error" in result:
            raise RuntimeError(f"link {src} -> {dst}: {result['error']}")
        return LinkMeasurement(
            src=src, dst=dst, bandwidth_gbps=round(result["bandwidth_gbps"], 3), latency_ms=round(result["rtt_s"] * 500, 4)
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A ZeroMQ link probe (started by `helix profile`).")
    parser.add_argument("--bind", required=True, help="ZeroMQ endpoint to bind, e.g. tcp://127.0.0.1:*")
    serve_probe(parser.parse_args(argv).bind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
