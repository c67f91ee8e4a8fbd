"""The wire protocol between the coordinator and node agents, and between agents.

Every message is a ZeroMQ multipart message: one msgpack *header frame* (a map with the
protocol version ``v``, the message kind ``k`` and the kind's fields) followed, for
``ACTIVATIONS`` only, by one raw *tensor frame* (hidden states as bytes; dtype and shape in the
header; bf16 travels as its raw 2 bytes per value, never as msgpack lists). This module is pure
and numpy-free: tensors are ``bytes``/``memoryview`` plus a dtype name and a shape; the agent
converts to and from torch.

Planes (as in Orca): the *control plane* (coordinator <-> agent, authenticated on connect)
carries HELLO/CHALLENGE/AUTH/WELCOME, ADMIT, STEP, CANCEL, HEARTBEAT, REFUSED and ERROR, and
LOAD_TASK / UNLOAD_TASK answered by TASK_STATUS (fine-tuned tasks, docs/pets.md); the
*data plane* carries ACTIVATIONS node to node and TOKENS from a pipeline's last stage to the
coordinator.

Life of a request: the coordinator sends ADMIT (prompt ids, sampling, max tokens, pipeline) to
the first stage (``task`` names the fine-tuned task it runs, "" the base model); each stage forwards ACTIVATIONS to its next stage, the first ACTIVATIONS of a
request carrying the admission (pipeline, sampling, hop index); the last stage sends TOKENS to
the coordinator, which sends STEP (only the new token) to the first stage for the next step.
CANCEL (to every stage) frees a request's KV when it finishes or is abandoned.

:func:`decode` validates strictly: unknown kinds or fields, wrong types, wrong version,
oversized frames, inconsistent tensor sizes all raise :class:`~helix.errors.ProtocolError`
naming what was wrong.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

import msgpack

from helix.errors import ProtocolError
from helix.wire_decode import _check_tensor, decode
from helix.wire_messages import (
    BATCH_SEQUENCES_BUCKETS,
    BATCH_TOKENS_BUCKETS,
    DEFAULT_MAX_FRAME_BYTES,
    DTYPE_BYTES,
    KINDS,
    MAX_GRAMMAR_CHARS,
    MAX_ID_CHARS,
    MAX_LIST,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_TOKEN_ID,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    STEP_SECONDS_BUCKETS,
    STEP_STATS_BOUNDS,
    Activations,
    Admit,
    AdmitInfo,
    Auth,
    Buffer,
    Cancel,
    Challenge,
    Distribution,
    Error,
    Heartbeat,
    Hello,
    LoadTask,
    Message,
    Refused,
    SamplingSpec,
    StageRef,
    Step,
    StepStats,
    TaskStatus,
    TokenOut,
    Tokens,
    UnloadTask,
    Welcome,
)

__all__ = [  # the protocol: messages and limits (helix.wire_messages), codec, handshake
    "Activations",
    "Admit",
    "AdmitInfo",
    "Auth",
    "BATCH_SEQUENCES_BUCKETS",
    "BATCH_TOKENS_BUCKETS",
    "Buffer",
    "Cancel",
    "Challenge",
    "DEFAULT_MAX_FRAME_BYTES",
    "DTYPE_BYTES",
    "Distribution",
    "Error",
    "Heartbeat",
    "Hello",
    "KINDS",
    "LoadTask",
    "MAX_GRAMMAR_CHARS",
    "MAX_ID_CHARS",
    "MAX_LIST",
    "MAX_LOGIT_BIAS",
    "MAX_PENALTY",
    "MAX_TOKEN_ID",
    "Message",
    "NONCE_BYTES",
    "PROTOCOL_VERSION",
    "Refused",
    "STEP_SECONDS_BUCKETS",
    "STEP_STATS_BOUNDS",
    "SamplingSpec",
    "StageRef",
    "Step",
    "StepStats",
    "TaskStatus",
    "TokenOut",
    "Tokens",
    "UnloadTask",
    "Welcome",
    "decode",
    "encode",
    "make_nonce",
    "prove",
    "verify",
]


# -- shared-secret handshake -----------------------------------------------------------------


def make_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def prove(secret: bytes, role: str, *nonces: bytes) -> bytes:
    """HMAC-SHA256 of the role and nonces under the shared secret (``role`` stops reflection)."""
    mac = hmac.new(secret, role.encode(), hashlib.sha256)
    for n in nonces:
        mac.update(len(n).to_bytes(2, "big") + n)
    return mac.digest()


def verify(secret: bytes, proof: bytes, role: str, *nonces: bytes) -> bool:
    return hmac.compare_digest(prove(secret, role, *nonces), proof)


# -- encoding --------------------------------------------------------------------------------


def _stage(s: StageRef) -> list[Any]:
    return [s.node_id, s.layer_start, s.layer_end, s.address]


def _sampling(s: SamplingSpec) -> dict[str, Any]:
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed,
            "stop_token_ids": list(s.stop_token_ids), "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty, "logit_bias": [[t, b] for t, b in s.logit_bias],
            "prior_output_ids": list(s.prior_output_ids), "grammar": s.grammar}  # fmt: skip


def _header(msg: Message) -> dict[str, Any]:
    if isinstance(msg, Admit):
        return {"request_id": msg.request_id, "prompt": list(msg.prompt), "max_tokens": msg.max_tokens,
                "sampling": _sampling(msg.sampling), "pipeline": [_stage(s) for s in msg.pipeline],
                "reply_to": msg.reply_to, "task": msg.task}  # fmt: skip
    if isinstance(msg, Activations):
        h: dict[str, Any] = {"request_id": msg.request_id, "step": msg.step, "position": msg.position,
                             "dtype": msg.dtype, "shape": list(msg.shape)}  # fmt: skip
        if msg.admit is not None:
            a = msg.admit
            h["admit"] = {"hop": a.hop, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
                          "sampling": _sampling(a.sampling), "pipeline": [_stage(s) for s in a.pipeline],
                          "reply_to": a.reply_to, "task": a.task}  # fmt: skip
        return h
    if isinstance(msg, Heartbeat):
        s = msg.steps
        return {**{name: getattr(msg, name) for name in msg.__slots__ if name != "steps"},
                "steps": {name: [list(d.counts), d.total] for name, d in
                          (("seconds", s.seconds), ("sequences", s.sequences), ("tokens", s.tokens))}}
    if isinstance(msg, Tokens):
        return {"node_id": msg.node_id,
                "tokens": [[t.request_id, t.step, t.token_id, t.finished, t.finish_reason] for t in msg.tokens]}
    return {name: getattr(msg, name) for name in msg.__slots__}  # type: ignore[union-attr]


def encode(msg: Message) -> list[Buffer]:
    """The frames of ``msg``: ``[header]`` or ``[header, tensor bytes]`` for ACTIVATIONS."""
    kind = KINDS.get(type(msg))
    if kind is None:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: not a wire message")
    header = {"v": PROTOCOL_VERSION, "k": kind, **_header(msg)}
    frames: list[Buffer] = [msgpack.packb(header, use_bin_type=True)]
    if isinstance(msg, Activations):
        _check_tensor(msg.dtype, msg.shape, len(memoryview(msg.data).cast("B")))
        frames.append(msg.data)
    return frames
