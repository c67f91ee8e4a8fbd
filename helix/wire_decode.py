"""Decoding wire frames with strict validation: every problem is a :class:`~helix.errors.ProtocolError`
naming the message kind and field (unknown kinds or fields, wrong types, wrong version,
oversized frames, tensor sizes that do not match dtype x shape)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack

from helix.errors import ProtocolError
from helix.wire_messages import (
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
    STEP_STATS_BOUNDS,
    Activations,
    Admit,
    AdmitInfo,
    Auth,
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

# -- decoding: strict validation --------------------------------------------------------------


class _Fields:
    """Typed access to a header map; every problem is a ProtocolError naming kind and field."""

    def __init__(self, kind: str, raw: dict[Any, Any]) -> None:
        self.kind, self.raw, self.used = kind, raw, {"v", "k"}

    def fail(self, name: str, what: str) -> ProtocolError:
        return ProtocolError(f"{self.kind}.{name}: {what}")

    def get(self, name: str, default: Any = ...) -> Any:
        self.used.add(name)
        if name not in self.raw:
            if default is ...:
                raise self.fail(name, "missing")
            return default
        return self.raw[name]

    def str_(self, name: str, default: Any = ..., *, empty: bool = False) -> str:
        v = self.get(name, default)
        if not isinstance(v, str) or len(v) > MAX_ID_CHARS * 16 or (not v and not empty):
            raise self.fail(name, f"expected a {'' if empty else 'non-empty '}string, got {_show(v)}")
        return v

    def int_(self, name: str, default: Any = ..., *, lo: int = 0, hi: int = 2**62) -> int:
        return _int(self.get(name, default), lo, hi, self, name)

    def bytes_(self, name: str, size: int | None = None) -> bytes:
        v = self.get(name)
        if not isinstance(v, bytes) or (size is not None and len(v) != size) or len(v) > 1024:
            raise self.fail(name, f"expected {size or 'some'} bytes, got {_show(v)}")
        return v

    def done(self) -> None:
        extra = sorted(str(k) for k in self.raw if k not in self.used)
        if extra:
            raise ProtocolError(f"{self.kind}: unknown field(s) {', '.join(extra)}")


def _show(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _int(v: Any, lo: int, hi: int, f: _Fields, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise f.fail(name, f"expected an integer in [{lo}, {hi}], got {_show(v)}")
    return v


def _list(f: _Fields, name: str, v: Any, max_len: int = MAX_LIST) -> list[Any]:
    if not isinstance(v, list) or len(v) > max_len:
        raise f.fail(name, f"expected a list of at most {max_len} items, got {_show(v)}")
    return v


def _token_ids(f: _Fields, name: str, v: Any, *, non_empty: bool = False) -> tuple[int, ...]:
    items = _list(f, name, v)
    if non_empty and not items:
        raise f.fail(name, "must not be empty")
    return tuple(_int(t, 0, MAX_TOKEN_ID, f, f"{name}[{i}]") for i, t in enumerate(items))


def _float(f: _Fields, name: str, v: Any, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not (lo <= v <= hi):  # NaN fails here too
        raise f.fail(name, f"expected a number in [{lo}, {hi}], got {_show(v)}")
    return float(v)


def _logit_bias(f: _Fields, name: str, v: Any) -> tuple[tuple[int, float], ...]:
    pairs: list[tuple[int, float]] = []
    for i, item in enumerate(_list(f, name, v)):
        where = f"{name}[{i}]"
        if not isinstance(item, list) or len(item) != 2:
            raise f.fail(where, f"expected [token_id, bias], got {_show(item)}")
        pairs.append((_int(item[0], 0, MAX_TOKEN_ID, f, f"{where}.token_id"),
                      _float(f, f"{where}.bias", item[1], -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)))
    if len({t for t, _ in pairs}) != len(pairs):
        raise f.fail(name, "a token id appears more than once")
    return tuple(pairs)


def _grammar(f: _Fields, name: str, v: Any) -> str:
    if not isinstance(v, str) or len(v) > MAX_GRAMMAR_CHARS:
        raise f.fail(name, f"expected a string of at most {MAX_GRAMMAR_CHARS} characters, got {_show(v)}")
    return v


def _decode_sampling(f: _Fields, name: str, v: Any) -> SamplingSpec:
    if not isinstance(v, dict):
        raise f.fail(name, f"expected a map, got {_show(v)}")
    s = _Fields(f"{f.kind}.{name}", v)
    s.used.clear()
    seed = s.get("seed", None)
    if seed is not None:
        seed = _int(seed, 0, 2**63 - 1, s, "seed")
    out = SamplingSpec(
        temperature=_float(s, "temperature", s.get("temperature", 0.0), 0.0, 100.0),
        top_k=s.int_("top_k", 0, hi=MAX_TOKEN_ID),
        top_p=_float(s, "top_p", s.get("top_p", 1.0), 0.0, 1.0),
        seed=seed,
        stop_token_ids=_token_ids(s, "stop_token_ids", s.get("stop_token_ids", [])),
        presence_penalty=_float(s, "presence_penalty", s.get("presence_penalty", 0.0), -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_float(s, "frequency_penalty", s.get("frequency_penalty", 0.0), -MAX_PENALTY, MAX_PENALTY),
        logit_bias=_logit_bias(s, "logit_bias", s.get("logit_bias", [])),
        prior_output_ids=_token_ids(s, "prior_output_ids", s.get("prior_output_ids", [])),
        grammar=_grammar(s, "grammar", s.get("grammar", "")),
    )
    s.done()
    return out


def _decode_step_stats(f: _Fields, name: str, v: Any) -> StepStats:
    """``{"seconds"|"sequences"|"tokens": [[count per bucket], sum]}``, each with one count per
    bound of :data:`STEP_STATS_BOUNDS` plus one, and the same number of observations (one per step)."""
    if not isinstance(v, dict):
        raise f.fail(name, f"expected a map, got {_show(v)}")
    s = _Fields(f"{f.kind}.{name}", v)
    s.used.clear()
    parts: dict[str, Distribution] = {}
    for part, bounds in STEP_STATS_BOUNDS.items():
        item = s.get(part)
        if not isinstance(item, list) or len(item) != 2:
            raise s.fail(part, f"expected [counts, sum], got {_show(item)}")
        counts = _list(s, f"{part}.counts", item[0], max_len=len(bounds) + 1)
        if len(counts) != len(bounds) + 1:
            raise s.fail(f"{part}.counts", f"expected {len(bounds) + 1} bucket counts, got {len(counts)}")
        parts[part] = Distribution(tuple(_int(c, 0, 2**62, s, f"{part}.counts[{i}]") for i, c in enumerate(counts)),
                                   _float(s, f"{part}.sum", item[1], 0.0, 1e18))
    s.done()
    if len({d.observations for d in parts.values()}) != 1:
        raise f.fail(name, "seconds, sequences and tokens must count the same number of steps")
    return StepStats(**parts)


def _decode_pipeline(f: _Fields, name: str, v: Any) -> tuple[StageRef, ...]:
    items = _list(f, name, v, max_len=4096)
    if not items:
        raise f.fail(name, "a pipeline needs at least one stage")
    stages: list[StageRef] = []
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        if not isinstance(item, list) or len(item) != 4:
            raise f.fail(where, f"expected [node_id, layer_start, layer_end, address], got {_show(item)}")
        node, start, end, address = item
        if not isinstance(node, str) or not node or len(node) > MAX_ID_CHARS or not isinstance(address, str):
            raise f.fail(where, "node_id must be a non-empty string and address a string")
        start = _int(start, 0, 1 << 20, f, f"{where}.layer_start")
        end = _int(end, start + 1, 1 << 20, f, f"{where}.layer_end")
        if stages and start != stages[-1].layer_end:
            raise f.fail(where, f"starts at layer {start} but the previous stage ends at {stages[-1].layer_end}")
        stages.append(StageRef(node, start, end, address))
    return tuple(stages)


def _task_id(f: _Fields, name: str, v: Any, *, empty: bool = True) -> str:
    if not isinstance(v, str) or len(v) > MAX_ID_CHARS or (not v and not empty):
        raise f.fail(name, f"expected a task name of at most {MAX_ID_CHARS} characters, got {_show(v)}")
    return v


def _check_tensor(dtype: str, shape: Sequence[int], nbytes: int) -> None:
    if dtype not in DTYPE_BYTES:
        raise ProtocolError(f"ACTIVATIONS.dtype: unsupported {dtype!r} (supported: {', '.join(DTYPE_BYTES)})")
    if len(shape) != 2 or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
        raise ProtocolError(f"ACTIVATIONS.shape: expected [num_tokens, hidden_size] of positive ints, got {shape!r}")
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if nbytes != expected:
        raise ProtocolError(
            f"ACTIVATIONS: tensor frame has {nbytes} bytes but dtype {dtype} and shape {list(shape)} need {expected}"
        )


def _decode_admit_info(f: _Fields, v: Any) -> AdmitInfo:
    if not isinstance(v, dict):
        raise f.fail("admit", f"expected a map, got {_show(v)}")
    a = _Fields(f"{f.kind}.admit", v)
    a.used.clear()
    pipeline = _decode_pipeline(a, "pipeline", a.get("pipeline"))
    info = AdmitInfo(
        hop=a.int_("hop", hi=len(pipeline) - 1),
        prompt_tokens=a.int_("prompt_tokens", lo=1),
        max_tokens=a.int_("max_tokens", lo=1),
        sampling=_decode_sampling(a, "sampling", a.get("sampling")),
        pipeline=pipeline,
        reply_to=a.str_("reply_to", "", empty=True),
        task=_task_id(a, "task", a.get("task", "")),
    )
    a.done()
    return info


def _decode_body(f: _Fields, payload: Sequence[memoryview]) -> Message:
    k = f.kind
    if k == "HELLO":
        return Hello(f.str_("sender"), f.bytes_("nonce", NONCE_BYTES))
    if k == "CHALLENGE":
        return Challenge(f.str_("node_id"), f.bytes_("nonce", NONCE_BYTES), f.bytes_("proof", 32))
    if k == "AUTH":
        return Auth(f.bytes_("proof", 32))
    if k == "WELCOME":
        start = f.int_("layer_start")
        return Welcome(f.str_("node_id"), start, f.int_("layer_end", lo=start + 1),
                       f.int_("kv_capacity_tokens"), f.str_("data_address"))  # fmt: skip
    if k == "ADMIT":
        return Admit(
            request_id=f.str_("request_id"),
            prompt=_token_ids(f, "prompt", f.get("prompt"), non_empty=True),
            max_tokens=f.int_("max_tokens", lo=1),
            sampling=_decode_sampling(f, "sampling", f.get("sampling")),
            pipeline=_decode_pipeline(f, "pipeline", f.get("pipeline")),
            reply_to=f.str_("reply_to", "", empty=True),
            task=_task_id(f, "task", f.get("task", "")),
        )
    if k == "LOAD_TASK":
        return LoadTask(_task_id(f, "task_id", f.get("task_id"), empty=False), f.str_("path"),
                        f.int_("max_lora_rank", 0, hi=1 << 20))
    if k == "UNLOAD_TASK":
        return UnloadTask(_task_id(f, "task_id", f.get("task_id"), empty=False))
    if k == "TASK_STATUS":
        op = f.str_("op")
        if op not in ("load", "unload"):
            raise f.fail("op", f"expected 'load' or 'unload', got {_show(op)}")
        ok = f.get("ok")
        if not isinstance(ok, bool):
            raise f.fail("ok", f"expected a bool, got {_show(ok)}")
        return TaskStatus(f.str_("node_id"), _task_id(f, "task_id", f.get("task_id"), empty=False), op, ok,
                          f.str_("error", "", empty=True), f.int_("nbytes", 0))
    if k == "STEP":
        return Step(f.str_("request_id"), f.int_("step"), f.int_("token_id", hi=MAX_TOKEN_ID))
    if k == "CANCEL":
        return Cancel(f.str_("request_id"), f.str_("reason", "cancelled"))
    if k == "HEARTBEAT":
        steps = f.get("steps", None)
        return Heartbeat(f.str_("node_id"), f.int_("seq"), f.int_("kv_used_tokens"), f.int_("kv_reserved_tokens"),
                         f.int_("kv_capacity_tokens"), f.int_("waiting"), f.int_("running"),
                         StepStats() if steps is None else _decode_step_stats(f, "steps", steps))  # fmt: skip
    if k == "REFUSED":
        return Refused(f.str_("request_id"), f.str_("node_id"), f.str_("code"), f.str_("reason", empty=True))
    if k == "ERROR":
        return Error(f.str_("code"), f.str_("reason", empty=True))
    if k == "ACTIVATIONS":
        shape = tuple(_list(f, "shape", f.get("shape"), max_len=8))
        dtype = f.str_("dtype")
        if len(payload) != 1:
            raise ProtocolError(f"ACTIVATIONS: expected 1 tensor frame after the header, got {len(payload)}")
        _check_tensor(dtype, shape, payload[0].nbytes)
        admit = f.get("admit", None)
        return Activations(
            request_id=f.str_("request_id"), step=f.int_("step"), position=f.int_("position"),
            dtype=dtype, shape=shape, data=payload[0],
            admit=None if admit is None else _decode_admit_info(f, admit),
        )  # fmt: skip
    if k == "TOKENS":
        outs = []
        for i, t in enumerate(_list(f, "tokens", f.get("tokens"), max_len=65536)):
            where = f"tokens[{i}]"
            if not isinstance(t, list) or len(t) != 5:
                raise f.fail(where, f"expected [request_id, step, token_id, finished, finish_reason], got {_show(t)}")
            rid, step, tok, fin, why = t
            if not isinstance(rid, str) or not rid or not isinstance(fin, bool) or not isinstance(why, str):
                raise f.fail(where, "request_id must be a non-empty string, finished a bool, finish_reason a string")
            outs.append(TokenOut(rid, _int(step, 0, 2**62, f, f"{where}.step"),
                                 _int(tok, 0, MAX_TOKEN_ID, f, f"{where}.token_id"), fin, why))  # fmt: skip
        return Tokens(f.str_("node_id"), tuple(outs))
    raise ProtocolError(f"unknown message kind {k!r} (known: {', '.join(KINDS.values())})")


def decode(frames: Sequence[Any], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """Parse and validate one multipart message (frames: bytes, memoryviews or zmq Frames)."""
    if not frames:
        raise ProtocolError("empty message: no header frame")
    views = []
    for i, fr in enumerate(frames):
        try:
            view = memoryview(fr.buffer if hasattr(fr, "buffer") else fr).cast("B")
        except TypeError as exc:
            raise ProtocolError(f"frame {i} is not a byte buffer ({type(fr).__name__})") from exc
        if view.nbytes > max_frame_bytes:
            raise ProtocolError(f"frame {i} is {view.nbytes} bytes, over the limit of {max_frame_bytes} bytes")
        views.append(view)
    try:
        header = msgpack.unpackb(views[0], raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ProtocolError(f"header frame is not valid msgpack ({type(exc).__name__}: {exc})") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"header frame must be a map, got {_show(header)}")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    kind = header.get("k")
    if not isinstance(kind, str):
        raise ProtocolError(f"header has no message kind 'k' (got {_show(kind)})")
    if kind != "ACTIVATIONS" and len(views) != 1:
        raise ProtocolError(f"{kind}: expected a single header frame, got {len(views)} frames")
    f = _Fields(kind, header)
    msg = _decode_body(f, views[1:])
    f.done()
    return msg
