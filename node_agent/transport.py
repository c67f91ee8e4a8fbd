"""The agent's side of the wire: torch tensors <-> tensor frames, and ZeroMQ socket helpers.

:mod:`helix.wire` is numpy- and torch-free; this module turns a ``[n, hidden]`` torch tensor into
the raw bytes of an ACTIVATIONS frame and back (bf16 travels as its raw 2-byte values), converts
wire sampling parameters to the engine's, and keeps one non-blocking PUSH socket per peer
address (:class:`PushPool`) so a dead peer can never block the agent's iteration loop. With
the cluster's CURVE keys (:mod:`helix.keys`), :class:`CurveSockets` makes the bound sockets CURVE
servers behind a ZAP authenticator (one plane each) and logs every refused handshake, and the
pool dials each peer as a CURVE client that expects that peer's own public key.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import zmq

from helix import wire
from helix.errors import ProtocolError
from helix.keys import HANDSHAKE_FAILED, HANDSHAKE_FAILED_AUTH, KeyGuard, KeyPair, handshake_failure
from node_agent.sampling import SamplingParams

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                        "float32": torch.float32}  # fmt: skip
SEND_HWM = 1_000  # messages queued per peer before sends fail (a dead peer costs bounded memory)


def tensor_frame(hidden: torch.Tensor, dtype: str) -> tuple[tuple[int, ...], memoryview]:
    """``hidden`` as ``(shape, raw bytes)`` in wire dtype ``dtype`` (no msgpack lists, no copy when possible)."""
    t = hidden.detach().to(TORCH_DTYPES[dtype]).contiguous()
    raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    array: Any = raw.numpy()  # numpy arrays are buffers; numpy's stubs do not say so
    return tuple(t.shape), memoryview(array).cast("B")


def frame_tensor(msg: wire.Activations) -> torch.Tensor:
    """The float32 tensor an ACTIVATIONS message carries."""
    with warnings.catch_warnings():  # zmq frames are read-only; we copy right away with .to()
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(msg.data, dtype=TORCH_DTYPES[msg.dtype])
    return flat.reshape(msg.shape).to(torch.float32, copy=True)


def sampling_params(spec: wire.SamplingSpec, max_tokens: int) -> SamplingParams:
    """The engine's sampling parameters for a wire ``SamplingSpec``."""
    return SamplingParams(max_tokens=max_tokens, temperature=spec.temperature, top_k=spec.top_k,
                          top_p=spec.top_p if spec.top_p > 0 else 1.0, seed=spec.seed,
                          stop_token_ids=spec.stop_token_ids, presence_penalty=spec.presence_penalty,
                          frequency_penalty=spec.frequency_penalty, logit_bias=spec.logit_bias,
                          prior_output_ids=spec.prior_output_ids, grammar=spec.grammar)  # fmt: skip


def configure(sock: zmq.Socket[Any]) -> None:
    """Common options: never linger on close, bounded queues."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, SEND_HWM)


class CurveSockets:
    """CURVE on one process's sockets: a ZAP authenticator asking ``guard`` which keys each plane lets in, bound
    sockets made CURVE servers of one plane each (with a monitor whose failed handshakes are logged), and
    outgoing sockets made CURVE clients of the peer they dial."""

    def __init__(self, ctx: zmq.Context[Any], keys: KeyPair, guard: KeyGuard) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.keys, self.guard = keys, guard
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("zmq.auth"))
        self.auth.start()  # before any bind: a CURVE server without a ZAP handler would let every key in
        for plane in guard.domains:
            self.auth.configure_curve_callback(plane, guard)
        self.monitors: dict[zmq.Socket[Any], str] = {}  # monitor socket -> its plane

    def serve(self, sock: zmq.Socket[Any], plane: str) -> zmq.Socket[Any]:
        """Make ``sock`` (before it binds) a CURVE server of ``plane``; returns its monitor socket (poll it,
        then :meth:`drain_monitor`)."""
        sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
        sock.curve_server = True
        sock.zap_domain = plane.encode()
        monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        self.monitors[monitor] = plane
        return monitor

    def dial(self, sock: zmq.Socket[Any], server_key: bytes) -> None:
        """Make ``sock`` (before it connects) a CURVE client that talks only to the holder of ``server_key``."""
        sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
        sock.curve_serverkey = server_key

    def drain_monitor(self, monitor: zmq.Socket[Any]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        plane = self.monitors[monitor]
        while True:
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            why = handshake_failure(int(event["event"]), int(event["value"]))
            if why is not None and int(event["event"]) != HANDSHAKE_FAILED_AUTH:  # a refused key: KeyGuard logged it
                self.guard.refusals.refuse(plane, why)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close(linger=0)
        self.monitors.clear()
        self.auth.stop()


class PushPool:
    """One PUSH socket per destination address, created on first use, sending without blocking (with
    ``curve``: a CURVE client of the key the caller expects at that address)."""

    def __init__(self, ctx: zmq.Context[Any], curve: CurveSockets | None = None) -> None:
        self._ctx = ctx
        self._curve = curve
        self._socks: dict[tuple[str, bytes | None], zmq.Socket[Any]] = {}

    def send(self, address: str, msg: wire.Message, server_key: bytes | None = None) -> bool:
        """Send ``msg`` to ``address`` (whose CURVE public key is ``server_key`` when the pool runs CURVE);
        False (and logged) when the peer cannot take it now."""
        sock = self._socks.get((address, server_key))
        if sock is None:
            if not address.startswith(("tcp://", "ipc://", "inproc://")):
                raise ProtocolError(f"peer address {address!r} is not a ZeroMQ endpoint")
            sock = self._ctx.socket(zmq.PUSH)
            configure(sock)
            if self._curve is not None:
                if server_key is None:
                    raise ProtocolError(f"no CURVE key for peer {address!r}: not sent")
                self._curve.dial(sock, server_key)
            sock.connect(address)
            self._socks[(address, server_key)] = sock
        try:
            sock.send_multipart(wire.encode(msg), flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            log.warning("peer %s is not reachable (or full): dropped %s", address, type(msg).__name__)
            return False

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
