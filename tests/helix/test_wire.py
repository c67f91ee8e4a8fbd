"""helix.wire: every message round-trips; every class of bad message is a ProtocolError."""

from __future__ import annotations

import random
import struct

import msgspec
import pytest

from helix import wire
from helix.domain import ErrorCode, FinishReason, Stage
from helix.errors import ProtocolError

PIPE = (wire.StageRef(Stage("a", 0, 10), "tcp://127.0.0.1:5001"),
        wire.StageRef(Stage("b", 10, 30), "tcp://127.0.0.1:5002"))
SAMPLING = wire.SamplingSpec(temperature=0.7, top_k=40, top_p=0.9, seed=7, stop_token_ids=(2, 49152),
                             presence_penalty=-0.5, frequency_penalty=1.25, logit_bias=((3, -100.0), (77, 2.5)),
                             prior_output_ids=(9, 9, 4), grammar='{"grammars": [{"json_schema": {"type": "object"}}]}')
HIDDEN = struct.pack("<6f", *range(6))


def _dist(bounds: tuple[float, ...], values: list[float]) -> wire.Distribution:
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[next((i for i, b in enumerate(bounds) if v <= b), len(bounds))] += 1
    return wire.Distribution(tuple(counts), float(sum(values)))


STEPS = wire.StepStats(_dist(wire.STEP_SECONDS_BUCKETS, [0.0004, 0.012, 30.0]),
                       _dist(wire.BATCH_SEQUENCES_BUCKETS, [1, 3, 600]),
                       _dist(wire.BATCH_TOKENS_BUCKETS, [1, 257, 9000]))

MESSAGES: list[wire.Message] = [
    wire.Hello("coordinator", wire.make_nonce()),
    wire.Challenge("a", wire.make_nonce(), b"p" * 32),
    wire.Auth(b"q" * 32),
    wire.Welcome("a", 0, 10, 65536, "tcp://127.0.0.1:5001"),
    wire.Admit("r1", (1, 2, 3), 16, SAMPLING, PIPE, "tcp://127.0.0.1:6000"),
    wire.Admit("r2", (5,), 1, wire.SamplingSpec(), PIPE[:1]),
    wire.Step("r1", 3, 42),
    wire.Cancel("r1", "finished"),
    wire.Heartbeat("a", 9, 100, 300, 65536, 2, 5),
    wire.Heartbeat("a", 10, 100, 300, 65536, 2, 5, STEPS),
    wire.Refused("r1", "b", ErrorCode.CAPACITY, "needs 9000 KV tokens, holds 4096"),
    wire.Error("protocol", "bad header"),
    wire.Activations("r1", 0, 0, "float32", (2, 3), HIDDEN),
    wire.Activations("r1", 0, 16, "bfloat16", (3, 2), b"\x01\x02" * 6,
                     wire.AdmitInfo(1, 19, 16, SAMPLING, PIPE, "tcp://127.0.0.1:6000")),
    wire.Tokens("b", (wire.TokenOut("r1", 0, 17), wire.TokenOut("r2", 4, 2, FinishReason.STOP))),
    wire.Admit("r3", (5,), 1, wire.SamplingSpec(), PIPE, task="sql-lora"),
    wire.Activations("r3", 0, 0, "float32", (2, 3), HIDDEN, wire.AdmitInfo(1, 2, 1, SAMPLING, PIPE, task="sql-lora")),
    wire.LoadTask("sql-lora", "/srv/tasks/sql-lora", 16),
    wire.UnloadTask("sql-lora"),
    wire.TaskStatus("a", "sql-lora", "load", False, "adapter_model.safetensors: model.layers.3...: shape"),
    wire.TaskStatus("a", "sql-lora", "unload", True, nbytes=4096),
    wire.Welcome("j", 0, 0, 65536, "tcp://127.0.0.1:5003"),  # a joining node: no layers yet
    wire.Welcome("a", 0, 15, 65536, "tcp://127.0.0.1:5001", 3, (wire.LayerSpan(0, 15), wire.LayerSpan(20, 30))),
    wire.SetLayers(4, 0, 30),
    wire.ReleaseLayers(4),
    wire.ReleaseLayers(4, 0.0),
    wire.Layers("a", 4, "load", 0, 30, (wire.LayerSpan(0, 30),), 540_000_000, seconds=1.25),
    wire.Layers("a", 5, "load", 0, 15, (wire.LayerSpan(0, 15),), 270_000_000, "not enough memory: ... 1,234 bytes"),
    wire.Layers("a", 4, "release", 15, 30, (wire.LayerSpan(15, 30),), 270_000_000),
    wire.Leaving("a", 30.0, 7),
]


def _same(a: wire.Message, b: wire.Message) -> bool:
    if isinstance(a, wire.Activations) and isinstance(b, wire.Activations):
        return bytes(a.data) == bytes(b.data) and {**_fields(a), "data": 0} == {**_fields(b), "data": 0}
    return a == b


def _fields(m: wire.Message) -> dict[str, object]:
    return msgspec.structs.asdict(m)


def _frames(header: dict[str, object], *payload: bytes) -> list[bytes]:
    return [msgspec.msgpack.encode([wire.PROTOCOL_VERSION, header]), *payload]


def _stage(node: str, start: int, end: int, address: str = "t") -> list[object]:
    return [{"node": node, "layer_start": start, "layer_end": end}, address]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: wire.Message) -> None:
    frames = wire.encode(msg)
    assert _same(wire.decode(frames), msg)
    assert _same(wire.decode([bytes(f) for f in frames]), msg)  # bytes or buffers, same result


def test_tensor_travels_as_raw_bytes_not_msgpack_lists() -> None:
    data = b"\xab\xcd" * 576 * 4
    frames = wire.encode(wire.Activations("r", 0, 0, "bfloat16", (4, 576), data))
    assert len(frames) == 2 and bytes(frames[1]) == data
    assert len(frames[0]) < 100  # the header holds dtype + shape, not the values
    version, header = msgspec.msgpack.decode(frames[0])
    assert version == wire.PROTOCOL_VERSION and header["shape"] == [4, 576] and "data" not in header


def test_heartbeat_carries_step_counts_per_bucket() -> None:
    version, header = msgspec.msgpack.decode(wire.encode(wire.Heartbeat("a", 10, 1, 2, 3, 4, 5, STEPS))[0])
    assert header["steps"]["seconds"] == [[1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1], pytest.approx(30.0124)]
    assert header["steps"]["sequences"][0][-1] == 1 and header["steps"]["tokens"][0][-1] == 1  # above the top bound
    assert STEPS.steps == 3 and wire.Heartbeat("a", 1, 0, 0, 0, 0, 0).steps.steps == 0
    no_steps = {k: v for k, v in header.items() if k != "steps"}  # an agent that sends none: no steps yet
    assert wire.decode(_frames(no_steps)).steps == wire.StepStats()  # type: ignore[union-attr]


def _heartbeat_with(steps: object) -> list[bytes]:
    return _frames({"k": "HEARTBEAT", "node_id": "a", "seq": 1, "kv_used_tokens": 0, "kv_reserved_tokens": 0,
                    "kv_capacity_tokens": 1, "waiting": 0, "running": 0, "steps": steps})


def _steps_header(**change: object) -> dict[str, object]:
    steps: dict[str, object] = {n: [list(d.counts), d.total] for n, d in
                                (("seconds", STEPS.seconds), ("sequences", STEPS.sequences), ("tokens", STEPS.tokens))}
    return {**steps, **change}


def test_handshake_proofs() -> None:
    c, a = wire.make_nonce(), wire.make_nonce()
    proof = wire.prove(b"s3cret", "coordinator", a, c)
    assert wire.verify(b"s3cret", proof, "coordinator", a, c)
    assert not wire.verify(b"wrong", proof, "coordinator", a, c)
    assert not wire.verify(b"s3cret", proof, "agent", a, c)  # no reflection of the agent's own proof
    assert not wire.verify(b"s3cret", proof, "coordinator", c, a)


BAD: dict[str, tuple[list[bytes], str]] = {
    "empty": ([], "no header frame"),
    "not msgpack": ([b"\xc1\xc1garbage"], "not valid msgpack"),
    "truncated": ([wire.encode(MESSAGES[4])[0][:-3]], "not valid msgpack"),
    "trailing bytes": ([wire.encode(MESSAGES[6])[0] + b"\x00"], "not valid msgpack"),
    "not an envelope": ([msgspec.msgpack.encode([1, 2, 3])], "must be [version, message]"),
    "body not a map": ([msgspec.msgpack.encode([wire.PROTOCOL_VERSION, [1]])], "the message must be a map"),
    "no version": ([msgspec.msgpack.encode({"k": "CANCEL", "request_id": "r"})], "protocol version None"),
    "wrong version": ([msgspec.msgpack.encode([99, {"k": "CANCEL", "request_id": "r"}])], "protocol version 99"),
    "protocol 5 map": ([msgspec.msgpack.encode({"v": 5, "k": "CANCEL", "request_id": "r"})], "protocol version 5 is not"),
    "no kind": (_frames({"request_id": "r"}), "no message kind"),
    "unknown kind": (_frames({"k": "LAUNCH", "request_id": "r"}), "unknown message kind 'LAUNCH'"),
    "unknown field": (_frames({"k": "CANCEL", "request_id": "r", "force": True}), "CANCEL: unknown field `force`"),
    "missing field": (_frames({"k": "STEP", "request_id": "r", "step": 1}), "STEP.token_id: missing"),
    "bool as int": (_frames({"k": "STEP", "request_id": "r", "step": True, "token_id": 1}), "STEP.step"),
    "negative": (_frames({"k": "STEP", "request_id": "r", "step": -1, "token_id": 1}), "STEP.step"),
    "string as int": (_frames({"k": "STEP", "request_id": "r", "step": "1", "token_id": 1}), "STEP.step"),
    "empty id": (_frames({"k": "CANCEL", "request_id": ""}), "CANCEL.request_id"),
    "short nonce": (_frames({"k": "HELLO", "sender": "c", "nonce": b"123"}), "HELLO.nonce"),
    "empty prompt": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [], "max_tokens": 1, "sampling": {},
                              "pipeline": [_stage("a", 0, 30, "tcp://x:1")]}), "ADMIT.prompt: expected `array` of length >= 1"),
    "token id out of range": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1, 2**40], "max_tokens": 1,
                                       "sampling": {}, "pipeline": [_stage("a", 0, 30)]}), "ADMIT.prompt[1]"),
    "nan temperature": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1], "max_tokens": 1,
                                 "sampling": {"temperature": float("nan")}, "pipeline": [_stage("a", 0, 30)]}),
                        "ADMIT.sampling.temperature"),
    "unknown sampling field": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1], "max_tokens": 1,
                                        "sampling": {"beams": 4}, "pipeline": [_stage("a", 0, 30)]}), "beams"),
    "penalty out of range": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1], "max_tokens": 1,
                                      "sampling": {"frequency_penalty": 2.5}, "pipeline": [_stage("a", 0, 30)]}),
                             "ADMIT.sampling.frequency_penalty: expected `float` <= 2.0"),
    "logit bias as a map": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1], "max_tokens": 1,
                                     "sampling": {"logit_bias": {"5": 1.0}}, "pipeline": [_stage("a", 0, 30)]}),
                            "ADMIT.sampling.logit_bias: expected `array`"),
    "logit bias not a pair": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1], "max_tokens": 1,
                                       "sampling": {"logit_bias": [[5]]}, "pipeline": [_stage("a", 0, 30)]}),
                              "ADMIT.sampling.logit_bias[0]: expected `array` of length 2"),
    "logit bias too large": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1], "max_tokens": 1,
                                      "sampling": {"logit_bias": [[5, 101]]}, "pipeline": [_stage("a", 0, 30)]}),
                             "ADMIT.sampling.logit_bias[0].bias"),
    "logit bias negative id": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1], "max_tokens": 1,
                                        "sampling": {"logit_bias": [[-5, 1]]}, "pipeline": [_stage("a", 0, 30)]}),
                               "ADMIT.sampling.logit_bias[0].token_id"),
    "logit bias repeated id": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1], "max_tokens": 1,
                                        "sampling": {"logit_bias": [[5, 1], [5, 2]]},
                                        "pipeline": [_stage("a", 0, 30)]}),
                               "more than once"),
    "prior output id out of range": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1], "max_tokens": 1,
                                              "sampling": {"prior_output_ids": [1, 2**40]},
                                              "pipeline": [_stage("a", 0, 30)]}),
                                     "ADMIT.sampling.prior_output_ids[1]"),
    "grammar not a string": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1], "max_tokens": 1,
                                      "sampling": {"grammar": {"type": "object"}}, "pipeline": [_stage("a", 0, 30)]}),
                             "ADMIT.sampling.grammar: expected `str`"),
    "gap in pipeline": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1], "max_tokens": 1, "sampling": {},
                                 "pipeline": [_stage("a", 0, 10), _stage("b", 12, 30)]}), "previous stage ends at 10"),
    "empty layer range": (_frames({"k": "ADMIT", "request_id": "r", "prompt": [1], "max_tokens": 1, "sampling": {},
                                   "pipeline": [_stage("a", 5, 5)]}), "layer_end"),
    "tensor size mismatch": (_frames({"k": "ACTIVATIONS", "request_id": "r", "step": 0, "position": 0,
                                      "dtype": "float32", "shape": [2, 3]}, b"\x00" * 23), "need 24"),
    "unknown dtype": (_frames({"k": "ACTIVATIONS", "request_id": "r", "step": 0, "position": 0,
                               "dtype": "int64", "shape": [1, 1]}, b"\x00" * 8), "unsupported 'int64'"),
    "3-d shape": (_frames({"k": "ACTIVATIONS", "request_id": "r", "step": 0, "position": 0,
                           "dtype": "float32", "shape": [1, 1, 1]}, b"\x00" * 4), "ACTIVATIONS.shape"),
    "no tensor frame": (_frames({"k": "ACTIVATIONS", "request_id": "r", "step": 0, "position": 0,
                                 "dtype": "float32", "shape": [1, 1]}), "expected 1 tensor frame"),
    "tensor as msgpack list": (_frames({"k": "ACTIVATIONS", "request_id": "r", "step": 0, "position": 0,
                                        "dtype": "float32", "shape": [1, 2], "data": [0.0, 1.0]}, b"\x00" * 8),
                               "ACTIVATIONS: unknown field `data`"),
    "extra frame": (_frames({"k": "CANCEL", "request_id": "r"}, b"junk"), "single header frame"),
    "bad hop": (_frames({"k": "ACTIVATIONS", "request_id": "r", "step": 0, "position": 0, "dtype": "float32",
                         "shape": [1, 1], "admit": {"hop": 5, "prompt_tokens": 1, "max_tokens": 1, "sampling": {},
                                                    "pipeline": [_stage("a", 0, 30)]}}, b"\x00" * 4),
                "ACTIVATIONS.admit.hop"),
    "steps not a map": (_heartbeat_with([1, 2]), "HEARTBEAT.steps: expected `object`"),
    "steps missing a part": (_heartbeat_with({k: v for k, v in _steps_header().items() if k != "tokens"}),
                             "HEARTBEAT.steps: seconds, sequences and tokens must count the same"),
    "steps unknown part": (_heartbeat_with(_steps_header(latency=[[0], 0.0])), "HEARTBEAT.steps: unknown field `latency`"),
    "steps wrong bucket count": (_heartbeat_with(_steps_header(seconds=[[1, 2], 0.5])),
                                 "HEARTBEAT.steps.seconds.counts: expected 15 bucket counts, got 2"),
    "steps negative count": (_heartbeat_with(_steps_header(sequences=[[-1] + [0] * 9 + [4], 600.0])),
                             "HEARTBEAT.steps.sequences.counts[0]"),
    "steps nan sum": (_heartbeat_with(_steps_header(tokens=[list(STEPS.tokens.counts), float("nan")])),
                      "HEARTBEAT.steps.tokens.total"),
    "steps counts disagree": (_heartbeat_with(_steps_header(tokens=[[0] * 15, 0.0])), "same number of steps"),
    "bad token entry": (_frames({"k": "TOKENS", "node_id": "b", "tokens": [["r", 0, 1, "yes", ""]]}), "tokens[0]"),
    "welcome empty range": (_frames({"k": "WELCOME", "node_id": "a", "layer_start": 4, "layer_end": 4,
                                     "kv_capacity_tokens": 1, "data_address": "t"}),
                            "WELCOME.layer_end: expected more than layer_start 4 (or layer_start = layer_end = 0"),
    "welcome overlapping spans": (_frames({"k": "WELCOME", "node_id": "a", "layer_start": 0, "layer_end": 4,
                                           "kv_capacity_tokens": 1, "data_address": "t", "held": [[0, 4], [3, 8]]}),
                                  "WELCOME.held[1]: starts at layer 3, not past the previous span's end 4"),
    "held misses the range": (_frames({"k": "LAYERS", "node_id": "a", "version": 1, "op": "load", "layer_start": 0,
                                       "layer_end": 8, "held": [[0, 4], [6, 9]]}),
                              "LAYERS.held: no span holds the range [0, 8) (held: [0, 4) [6, 9))"),
    "set layers empty": (_frames({"k": "SET_LAYERS", "version": 1, "layer_start": 5, "layer_end": 5}),
                         "SET_LAYERS.layer_end: expected more than layer_start 5, got 5"),
    "set layers backwards": (_frames({"k": "SET_LAYERS", "version": 1, "layer_start": 9, "layer_end": 2}),
                             "SET_LAYERS.layer_end: expected more than layer_start 9, got 2"),
    "set layers version 0": (_frames({"k": "SET_LAYERS", "version": 0, "layer_start": 0, "layer_end": 2}),
                             "SET_LAYERS.version: expected `int` >= 1"),
    "set layers missing end": (_frames({"k": "SET_LAYERS", "version": 1, "layer_start": 0}), "SET_LAYERS.layer_end: missing"),
    "release negative drain": (_frames({"k": "RELEASE_LAYERS", "version": 1, "drain_s": -1.0}),
                               "RELEASE_LAYERS.drain_s: expected `float` >= 0.0"),
    "layers unknown op": (_frames({"k": "LAYERS", "node_id": "a", "version": 1, "op": "swap", "layer_start": 0,
                                   "layer_end": 2}), "LAYERS.op"),
    "layers empty span": (_frames({"k": "LAYERS", "node_id": "a", "version": 1, "op": "load", "layer_start": 0,
                                   "layer_end": 2, "held": [[2, 2]]}), "LAYERS.held[0].end: expected more than start 2"),
    "leaving without drain": (_frames({"k": "LEAVING", "node_id": "a"}), "LEAVING.drain_s: missing"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_messages_are_protocol_errors(name: str) -> None:
    frames, fragment = BAD[name]
    with pytest.raises(ProtocolError) as info:
        wire.decode(frames)
    assert fragment in info.value.message


def test_oversized_frames_are_refused_before_parsing() -> None:
    msg = wire.Activations("r", 0, 0, "float32", (256, 576), bytes(256 * 576 * 4))
    frames = wire.encode(msg)
    assert wire.decode(frames, max_frame_bytes=1 << 20).num_tokens == 256
    with pytest.raises(ProtocolError, match="over the limit of 1000 bytes"):
        wire.decode(frames, max_frame_bytes=1000)


def test_encode_refuses_inconsistent_tensors() -> None:
    with pytest.raises(ProtocolError, match="need 24"):
        wire.encode(wire.Activations("r", 0, 0, "float32", (2, 3), b"\x00" * 10))


def test_fuzz_mutations_only_ever_raise_protocol_error() -> None:
    rng = random.Random(1234)
    seeds = [wire.encode(m) for m in MESSAGES]
    for _ in range(4000):
        frames = [bytearray(bytes(f)) for f in rng.choice(seeds)]
        target = frames[0] if rng.random() < 0.8 else frames[-1]
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.5 and target:
                target[rng.randrange(len(target))] = rng.randrange(256)
            elif op < 0.75:
                target.insert(rng.randrange(len(target) + 1), rng.randrange(256))
            elif target:
                del target[rng.randrange(len(target))]
        try:
            msg = wire.decode([bytes(f) for f in frames])
        except ProtocolError:
            continue
        assert type(msg) in wire.KINDS  # a mutation may still be a valid message
        wire.encode(msg)  # and then it re-encodes


def test_fuzz_random_headers_only_ever_raise_protocol_error() -> None:
    rng = random.Random(99)
    values: list[object] = [None, True, -1, 0, 7, 2**63, 1.5, float("inf"), "", "x", b"\x00" * 32, [], [1], {}, {"a": 1},
                            [_stage("a", 0, 30)], ["a", 0], [[{"node": "a", "layer_start": 0}, "t"]],
                            [["r", 0, 1, "stop"]],
                            {"logit_bias": [[1, 2.0]]}, {"presence_penalty": 3}, {"prior_output_ids": [1, -1]},
                            {"logit_bias": [[1, "x"]]}, _steps_header(), [[0, 4], [6, 9]], [[3, 1]], "load",
                            _steps_header(seconds=[[0] * 15, -1.0]), _steps_header(tokens=[[1] * 15, 1e30])]
    keys = ["request_id", "step", "token_id", "prompt", "max_tokens", "sampling", "pipeline", "dtype", "shape",
            "position", "admit", "node_id", "tokens", "nonce", "proof", "sender", "seq", "reason", "code", "steps",
            "kv_used_tokens", "kv_reserved_tokens", "kv_capacity_tokens", "waiting", "running", "version",
            "layer_start", "layer_end", "held", "drain_s", "op", "error", "weight_bytes", "seconds", "data_address"]
    for _ in range(3000):
        header: dict[str, object] = {"k": rng.choice(list(wire.KINDS.values()))}
        for key in rng.sample(keys, rng.randint(0, 8)):
            header[key] = rng.choice(values)
        frames = _frames(header, *([b"\x00" * 4] if rng.random() < 0.3 else []))
        try:
            wire.decode(frames)
        except ProtocolError:
            pass
