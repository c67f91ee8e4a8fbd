"""The wire protocol between the coordinator and node agents, and between agents.

Every message is a ZeroMQ multipart message: one msgpack *header frame*, the array ``[version,
message]`` (the message a map: its kind ``k`` and the kind's fields, see :mod:`helix.wire_messages`),
followed, for ``ACTIVATIONS`` only, by one raw *tensor frame* (hidden states as bytes; dtype and
shape in the header; bf16 travels as its raw 2 bytes per value, never as msgpack lists). This
module is pure and numpy-free: tensors are ``bytes``/``memoryview`` plus a dtype name and a shape;
the agent converts to and from torch.

Planes (as in Orca): the *control plane* (coordinator <-> agent, authenticated on connect)
carries HELLO/CHALLENGE/AUTH/WELCOME, ADMIT, STEP, CANCEL, HEARTBEAT, REFUSED and ERROR, and
LOAD_TASK / UNLOAD_TASK answered by TASK_STATUS (fine-tuned tasks, docs/pets.md), and live
membership: SET_LAYERS / RELEASE_LAYERS answered by LAYERS, LEAVING from a draining agent
(docs/node_agent.md); the *data plane* carries ACTIVATIONS node to node and TOKENS from a pipeline's last stage to the
coordinator.

Life of a request: the coordinator sends ADMIT (prompt ids, sampling, max tokens, pipeline) to
the first stage (``task`` names the fine-tuned task it runs, "" the base model); each stage
forwards ACTIVATIONS to its next stage, the first ACTIVATIONS of a request carrying the admission
(pipeline, sampling, hop index); the last stage sends TOKENS to the coordinator, which sends STEP
(only the new token) to the first stage for the next step. CANCEL (to every stage) frees a
request's KV when it finishes or is abandoned.

:func:`encode` and :func:`decode` are msgspec's, driven by the message Structs. :func:`decode`
validates strictly: unknown kinds or fields, wrong types, wrong version, oversized frames,
inconsistent tensor sizes all raise :class:`~helix.errors.ProtocolError` naming the message kind
and the field (``ADMIT.sampling.logit_bias[0].bias: ...``).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import operator
import os
import re
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
from msgspec import inspect as mi

from helix.errors import ProtocolError
from helix.wire_messages import (
    KINDS,
    PROTOCOL_VERSION,
    Activations,
    ActivationsHeader,
    Admit,
    Auth,
    Cancel,
    Challenge,
    Error,
    Heartbeat,
    Hello,
    Layers,
    Leaving,
    LoadTask,
    Message,
    Refused,
    ReleaseLayers,
    SetLayers,
    Step,
    TaskStatus,
    Tokens,
    UnloadTask,
    Welcome,
)
from helix.wire_records import (
    BATCH_SEQUENCES_BUCKETS,
    BATCH_TOKENS_BUCKETS,
    DEFAULT_MAX_FRAME_BYTES,
    DTYPE_BYTES,
    MAX_GRAMMAR_CHARS,
    MAX_ID_CHARS,
    MAX_LIST,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_TOKEN_ID,
    NONCE_BYTES,
    STEP_SECONDS_BUCKETS,
    STEP_STATS_BOUNDS,
    AdmitInfo,
    Buffer,
    Distribution,
    LayerSpan,
    SamplingSpec,
    StageRef,
    StepStats,
    TokenOut,
)

__all__ = [  # the protocol: messages (helix.wire_messages), records and limits (helix.wire_records), codec, handshake
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
    "LayerSpan",
    "Layers",
    "Leaving",
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
    "ReleaseLayers",
    "STEP_SECONDS_BUCKETS",
    "STEP_STATS_BOUNDS",
    "SamplingSpec",
    "SetLayers",
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


# -- encoding and decoding -------------------------------------------------------------------

_ENCODER = msgspec.msgpack.Encoder()

_header_of = operator.attrgetter(*ActivationsHeader.__struct_fields__)

_Version = Annotated[int, msgspec.Meta(ge=PROTOCOL_VERSION, le=PROTOCOL_VERSION)]
_DECODED = {kind: ActivationsHeader if cls is Activations else cls for cls, kind in KINDS.items()}  # kind -> type
_Body: Any = functools.reduce(operator.or_, _DECODED.values())
_DECODER = msgspec.msgpack.Decoder(tuple[_Version, _Body])


def encode(msg: Message) -> list[Buffer]:
    """The frames of ``msg``: ``[header]`` or ``[header, tensor bytes]`` for ACTIVATIONS."""
    if isinstance(msg, Activations):
        return [_ENCODER.encode((PROTOCOL_VERSION, ActivationsHeader(*_header_of(msg)))), msg.data]
    if type(msg) not in KINDS:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: not a wire message")
    return [_ENCODER.encode((PROTOCOL_VERSION, msg))]


def decode(frames: Sequence[Any], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """Parse and validate one multipart message (frames: bytes, memoryviews or zmq Frames)."""
    if not frames:
        raise ProtocolError("empty message: no header frame")
    views = [_view(i, frame, max_frame_bytes) for i, frame in enumerate(frames)]
    try:
        msg = _DECODER.decode(views[0])[1]
    except msgspec.DecodeError as exc:
        raise _explain(views[0], exc) from exc
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"header frame is not valid msgpack (a string is not UTF-8: {exc})") from exc
    except RecursionError as exc:
        raise ProtocolError("header frame nests too deeply") from exc
    if isinstance(msg, ActivationsHeader):
        if len(views) != 2:
            raise ProtocolError(f"ACTIVATIONS: expected 1 tensor frame after the header, got {len(views) - 1}")
        return Activations(data=views[1], **msgspec.structs.asdict(msg))
    if len(views) != 1:
        raise ProtocolError(f"{KINDS[type(msg)]}: expected a single header frame, got {len(views)} frames")
    return msg  # type: ignore[no-any-return]


def _view(i: int, frame: Any, max_frame_bytes: int) -> memoryview:
    try:
        view = memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")
    except TypeError as exc:
        raise ProtocolError(f"frame {i} is not a byte buffer ({type(frame).__name__})") from exc
    if view.nbytes > max_frame_bytes:
        raise ProtocolError(f"frame {i} is {view.nbytes} bytes, over the limit of {max_frame_bytes} bytes")
    return view


# -- naming what was wrong -------------------------------------------------------------------


def _explain(header: memoryview, exc: msgspec.DecodeError) -> ProtocolError:
    """Why ``header`` is not a message of this protocol (``exc``: msgspec's complaint), naming the
    message kind and field where there is one."""
    if not isinstance(exc, msgspec.ValidationError):
        return ProtocolError(f"header frame is not valid msgpack ({exc})")
    try:
        raw = msgspec.msgpack.decode(header)
    except RecursionError:
        return ProtocolError("header frame nests too deeply")
    except (msgspec.DecodeError, TypeError, ValueError) as again:  # e.g. trailing bytes after an invalid message
        return ProtocolError(f"header frame is not valid msgpack ({again})")
    if isinstance(raw, dict):  # a peer of protocol 5 or older: one map carrying its version "v"
        version = raw.get("v")
    elif isinstance(raw, list) and len(raw) == 2:
        version = raw[0]
    else:
        return ProtocolError(f"header frame must be [version, message], got {_show(raw)}")
    if version != PROTOCOL_VERSION or isinstance(version, bool | float):
        return ProtocolError(f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    if isinstance(raw, dict):
        return ProtocolError("header frame must be [version, message], got a map")
    body = raw[1]
    if not isinstance(body, dict):
        return ProtocolError(f"the message must be a map, got {_show(body)}")
    kind = body.get("k")
    if not isinstance(kind, str):
        return ProtocolError(f"header has no message kind 'k' (got {_show(kind)})")
    if kind not in _DECODED:
        return ProtocolError(f"unknown message kind {kind!r} (known: {', '.join(KINDS.values())})")
    text, _, path = str(exc).partition(" - at `$[1]")
    path = _field_names(_DECODED[kind], path.rstrip("`"))
    if found := re.fullmatch(r"Object (missing required|contains unknown) field `(.*)`", text):
        missing, name = found[1] == "missing required", found[2]
        path, text = (f"{path}.{name}", "missing") if missing else (path, f"unknown field `{name}`")
    elif text[:1] in ".[":  # a __post_init__ names the field below the record it checks
        below, _, text = text.partition(": ")
        path += below
    else:
        text = text[:1].lower() + text[1:]
    return ProtocolError(f"{kind}{path}: {text}")


def _show(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _field_names(cls: type, path: str) -> str:
    """msgspec's ``path`` (``.name`` and ``[index]`` steps) inside a ``cls`` message, with the positions
    of array-like records and of titled tuple items replaced by their field names."""
    t: Any = mi.type_info(cls)
    out: list[str] = []
    for name, index in _STEP.findall(path):
        t = _bare(t)
        at = int(index) if index else -1
        if isinstance(t, mi.StructType | mi.DataclassType):
            fields = [f for i, f in enumerate(t.fields) if i == at or f.encode_name == name]
            t = fields[0].type if fields else mi.AnyType()
            out.append(f".{fields[0].name}" if fields else f".{name}" if name else f"[{index}]")
        elif isinstance(t, mi.TupleType) and 0 <= at < len(t.item_types):
            t = t.item_types[at]
            title = (t.extra_json_schema or {}).get("title") if isinstance(t, mi.Metadata) else None
            out.append(f".{title}" if title else f"[{index}]")
        elif isinstance(t, mi.ListType | mi.VarTupleType) and at >= 0:
            t = t.item_type
            out.append(f"[{index}]")
        else:
            t = mi.AnyType()
            out.append(f".{name}" if name else f"[{index}]")
    return "".join(out)


def _bare(t: Any) -> Any:
    """``t`` without its metadata, and without ``None`` where it is optional."""
    while True:
        if isinstance(t, mi.Metadata):
            t = t.type
        elif isinstance(t, mi.UnionType) and len(inner := [u for u in t.types if not isinstance(u, mi.NoneType)]) == 1:
            t = inner[0]
        else:
            return t
