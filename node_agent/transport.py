"""The agent's side of the wire: torch tensors <-> tensor frames, and ZeroMQ socket helpers.

:mod:`helix.wire` is numpy- and torch-free; this module turns a ``[n, hidden]`` torch tensor into
the raw bytes of an ACTIVATIONS frame and back (bf16 travels as its raw 2-byte values), converts
wire sampling parameters to the engine's, and keeps one non-blocking PUSH socket per peer
address (:class:`PushPool`) so a dead peer can never block the agent's iteration loop. With
the cluster's CURVE keys (:mod:`helix.keys`), the pool dials each peer as a CURVE client that
expects that peer's own public key (:class:`helix.zmq_io.CurveSockets`, which also serves the
agent's bound sockets).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import zmq

from helix import wire
from helix.errors import ProtocolError
from helix.zmq_io import CurveSockets
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
                          prior_output_ids=spec.prior_output_ids, grammar=spec.grammar,
                          paced=spec.paced)  # fmt: skip


def configure(sock: zmq.Socket[Any]) -> None:
    """Common options: never linger on close, bounded queues."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, SEND_HWM)


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

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket; ``linger_ms``: how long messages still queued may take to leave."""
        for sock in self._socks.values():
            sock.close(linger=linger_ms)
        self._socks.clear()
