"""Measuring links through ZeroMQ: one probe process per vertex, ping and bulk transfer per pair.

Every vertex of the cluster (coordinator and nodes) whose address is on this machine gets a
*probe*: a process (``python -m profiler.links --bind ENDPOINT``) with a ZeroMQ ROUTER socket
on the vertex's host (an ephemeral port, so running agents are not disturbed). For each
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
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import zmq

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


def host_of(address: str | None) -> str:
    """The host part of ``tcp://host:port``; no address means this machine (loopback demo)."""
    if not address:
        return "127.0.0.1"
    parsed = urlparse(address)
    return parsed.hostname or "127.0.0.1"


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, its hostname, or one of its addresses)."""
    if host in ("localhost", "0.0.0.0", "*") or host.startswith("127."):
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
    """Run a probe: print the bound endpoint, then answer ping / bulk / measure / quit."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
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
        elif cmd == b"quit":
            sock.send_multipart([ident, b"bye"])
            break
    sock.close()


# -- the measurer ------------------------------------------------------------------------------


class ProbeSet:
    """Probe processes for the local vertices; a context manager that stops them on exit."""

    def __init__(self, hosts: dict[str, str]) -> None:
        self.hosts = hosts
        self.endpoints: dict[str, str] = {}
        self._procs: list[subprocess.Popen[str]] = []
        self._ctx: zmq.Context[Any] = zmq.Context.instance()

    def __enter__(self) -> ProbeSet:
        for vertex, host in self.hosts.items():
            bind_host = "127.0.0.1" if host in ("localhost", "0.0.0.0", "*") else host
            proc = subprocess.Popen(
                [sys.executable, "-m", "profiler.links", "--bind", f"tcp://{bind_host}:*"],
                stdout=subprocess.PIPE, text=True,
            )
            self._procs.append(proc)
            assert proc.stdout is not None
            self.endpoints[vertex] = proc.stdout.readline().strip()
        return self

    def __exit__(self, *exc: object) -> None:
        for vertex in self.endpoints:
            try:
                self._request(vertex, [b"quit"], timeout_ms=2000)
            except (zmq.ZMQError, TimeoutError):
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _request(self, vertex: str, frames: list[bytes], timeout_ms: int = REPLY_TIMEOUT_MS) -> list[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoints[vertex])
        try:
            sock.send_multipart(frames)
            if not sock.poll(timeout_ms):
                raise TimeoutError(f"probe of {vertex} did not answer within {timeout_ms} ms")
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
