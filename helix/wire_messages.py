"""The wire protocol's messages and limits, each message declared once: the msgspec Structs below
drive both :func:`helix.wire.encode` and :func:`helix.wire.decode`.

A field's type says what the wire accepts (``Annotated`` constraints: lengths and ranges, checked
when decoding); a rule across fields (a pipeline's layers follow each other, a tensor's bytes match
its dtype and shape) is the message's ``__post_init__``, which runs on construction and on decoding
alike. A ``__post_init__`` names what it rejects by starting its ``ValueError`` with the field's
path below the struct (``".pipeline[1]: ..."``), so the decoder's error can name kind and field.

Messages are maps tagged with their kind (``k``); the records that repeat inside them (a pipeline's
stages, a step's tokens, a histogram) travel as arrays. A stage on the wire is a
:class:`helix.domain.Stage` plus its data-plane address; finish reasons and refusal codes are
:class:`helix.domain.FinishReason` and :class:`helix.domain.ErrorCode`, whose values are the strings
on the wire. Pure data: no I/O. See :mod:`helix.wire` for the framing and the life of a request.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, get_args

import msgspec
from msgspec import Meta, field

from helix.domain import ErrorCode, FinishReason, Stage
from helix.errors import ProtocolError

# 2: SamplingSpec carries penalties, logit_bias and prior_output_ids; 3: HEARTBEAT.steps; 4: SamplingSpec.grammar;
# 5: ADMIT.task / ACTIVATIONS.admit.task, LOAD_TASK / UNLOAD_TASK / TASK_STATUS; 6: msgspec Structs - the header
# is [version, message], a stage is [{node, layer_start, layer_end}, address], a token [id, step, token, reason|nil],
# and SamplingSpec.paced (defaulted; added in the same redesign, issue 14, so 6 stays)
PROTOCOL_VERSION = 6
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
MAX_TOKEN_ID = 2**31 - 1
MAX_ID_CHARS = 256  # node ids in a pipeline, task names
MAX_TEXT_CHARS = MAX_ID_CHARS * 16  # request ids, addresses, reasons
MAX_LIST = 1 << 20
MAX_LAYER = 1 << 20
MAX_STAGES = 4096
MAX_TOKENS_PER_MESSAGE = 65536
MAX_COUNT = 2**62
MAX_PENALTY = 2.0  # presence/frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]
MAX_GRAMMAR_CHARS = 1 << 24  # the longest SamplingSpec.grammar: more than a schema in any request body compiles to

Buffer = bytes | bytearray | memoryview

# upper bounds of the buckets an agent counts its engine steps in (HEARTBEAT.steps); values above
# the last bound fall in one more bucket
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SEQUENCES_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
STEP_STATS_BOUNDS: dict[str, tuple[float, ...]] = {
    "seconds": STEP_SECONDS_BUCKETS, "sequences": BATCH_SEQUENCES_BUCKETS, "tokens": BATCH_TOKENS_BUCKETS,
}  # fmt: skip

# -- what a field accepts --------------------------------------------------------------------

Name = Annotated[str, Meta(min_length=1, max_length=MAX_TEXT_CHARS)]  # ids and addresses: never empty
Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
TaskName = Annotated[str, Meta(max_length=MAX_ID_CHARS)]  # "" = the base model
TaskId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Positive = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[tuple[TokenId, ...], Meta(max_length=MAX_LIST)]
Nonce = Annotated[bytes, Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
Proof = Annotated[bytes, Meta(min_length=PROOF_BYTES, max_length=PROOF_BYTES)]
Penalty = Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)]
# a logit bias is [token_id, bias]; the titles name the pair's items in errors
LogitBias = tuple[Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID, title="token_id")],
                  Annotated[float, Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, title="bias")]]  # fmt: skip


class _Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A record of the wire: immutable, strict about unknown fields, free of reference cycles."""


class _Message(_Record, tag_field="k", frozen=True):
    """A wire message: a map whose ``k`` is the message kind."""


# -- records inside messages -----------------------------------------------------------------


class StageRef(_Record, array_like=True, frozen=True):
    """One hop of a request's pipeline on the wire: the :class:`~helix.domain.Stage` and where that
    node's data plane listens (``address``)."""

    stage: Stage
    address: Text

    def __post_init__(self) -> None:
        node, start, end = self.stage.node, self.stage.layer_start, self.stage.layer_end
        if not node or len(node) > MAX_ID_CHARS:
            raise ValueError(f".stage.node: expected 1 to {MAX_ID_CHARS} characters, got {len(node)}")
        if not 0 <= start < MAX_LAYER:
            raise ValueError(f".stage.layer_start: expected an integer in [0, {MAX_LAYER}), got {start}")
        if not start < end <= MAX_LAYER:
            raise ValueError(f".stage.layer_end: expected an integer in [{start + 1}, {MAX_LAYER}], got {end}")


StageRefs = Annotated[tuple[StageRef, ...], Meta(min_length=1, max_length=MAX_STAGES)]


def _check_pipeline(pipeline: tuple[StageRef, ...]) -> None:
    for i in range(1, len(pipeline)):
        start, previous_end = pipeline[i].stage.layer_start, pipeline[i - 1].stage.layer_end
        if start != previous_end:
            raise ValueError(f".pipeline[{i}]: starts at layer {start} but the previous stage ends at {previous_end}")


class SamplingSpec(_Record, frozen=True):
    """Sampling parameters applied by a pipeline's last stage.

    Penalties follow OpenAI: over the tokens this request generated, ``logits[t] -=
    presence_penalty * (count[t] > 0) + frequency_penalty * count[t]``; ``logit_bias`` adds
    ``bias`` to ``logits[token_id]`` for each ``(token_id, bias)`` pair. ``prior_output_ids`` are
    the tokens the request generated before this admission (on a pipeline that failed; they are
    the tail of the re-prefilled prompt): the penalties count them as if sampled here.
    ``grammar`` (empty: none) is an llguidance grammar, a JSON string the coordinator compiled
    from ``response_format``: the output must follow it, ``prior_output_ids`` included. ``paced``:
    a one-stage pipeline waits for the coordinator's STEP instead of feeding its own token back.
    """

    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 0.0
    top_k: Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)] = 0
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop_token_ids: TokenIds = ()
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: Annotated[tuple[LogitBias, ...], Meta(max_length=MAX_LIST)] = ()
    prior_output_ids: TokenIds = ()
    grammar: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] = ""
    paced: bool = False

    def __post_init__(self) -> None:
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError(".logit_bias: a token id appears more than once")


class AdmitInfo(_Record, frozen=True):
    """What a downstream stage learns about a request with its first ACTIVATIONS."""

    hop: Count
    prompt_tokens: Positive
    max_tokens: Positive
    sampling: SamplingSpec
    pipeline: StageRefs
    reply_to: Text = ""
    task: TaskName = ""

    def __post_init__(self) -> None:
        _check_pipeline(self.pipeline)
        if self.hop >= len(self.pipeline):
            raise ValueError(f".hop: expected an integer in [0, {len(self.pipeline) - 1}] (a stage of the pipeline), "
                             f"got {self.hop}")  # fmt: skip


class Distribution(_Record, array_like=True, frozen=True):
    """Values observed since an agent started, counted in fixed buckets: ``counts[i]`` values in
    ``(bounds[i-1], bounds[i]]`` and ``counts[-1]`` those above the last bound (so there is one
    count more than bounds); ``total`` is their sum. Cumulative, so a lost heartbeat loses nothing."""

    counts: Annotated[tuple[Count, ...], Meta(max_length=64)]
    total: Annotated[float, Meta(ge=0.0, le=1e18)] = 0.0

    @property
    def observations(self) -> int:
        return sum(self.counts)


def _no_steps(bounds: tuple[float, ...]) -> Distribution:
    return Distribution((0,) * (len(bounds) + 1))


class StepStats(_Record, frozen=True):
    """An agent's engine steps that ran something, since it started: each step's wall time
    (``seconds``, bounds :data:`STEP_SECONDS_BUCKETS`), the requests it batched (``sequences``,
    :data:`BATCH_SEQUENCES_BUCKETS`) and their tokens (``tokens``, :data:`BATCH_TOKENS_BUCKETS`):
    one count per bound plus one each, and the same number of observations (one per step)."""

    seconds: Distribution = field(default_factory=lambda: _no_steps(STEP_SECONDS_BUCKETS))
    sequences: Distribution = field(default_factory=lambda: _no_steps(BATCH_SEQUENCES_BUCKETS))
    tokens: Distribution = field(default_factory=lambda: _no_steps(BATCH_TOKENS_BUCKETS))

    def __post_init__(self) -> None:
        for name, bounds in STEP_STATS_BOUNDS.items():
            counts = getattr(self, name).counts
            if len(counts) != len(bounds) + 1:
                raise ValueError(f".{name}.counts: expected {len(bounds) + 1} bucket counts, got {len(counts)}")
        if not self.seconds.observations == self.sequences.observations == self.tokens.observations:
            raise ValueError("seconds, sequences and tokens must count the same number of steps")

    @property
    def steps(self) -> int:
        return self.seconds.observations


class TokenOut(_Record, array_like=True, frozen=True):
    """One sampled token of one request; ``finish_reason`` (None: more follow) ends the request on its stage."""

    request_id: Name
    step: Count
    token_id: TokenId
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# -- messages --------------------------------------------------------------------------------


class Hello(_Message, tag="HELLO", frozen=True):
    """Coordinator -> agent, first message on a control connection."""

    sender: Name
    nonce: Nonce


class Challenge(_Message, tag="CHALLENGE", frozen=True):
    """Agent -> coordinator: the agent's nonce, and its proof of the secret over both nonces."""

    node_id: Name
    nonce: Nonce
    proof: Proof


class Auth(_Message, tag="AUTH", frozen=True):
    """Coordinator -> agent: proof of the shared secret over the agent's nonce."""

    proof: Proof


class Welcome(_Message, tag="WELCOME", frozen=True):
    """Agent -> coordinator: the handshake succeeded; what this agent holds."""

    node_id: Name
    layer_start: Count
    layer_end: Count
    kv_capacity_tokens: Count
    data_address: Name

    def __post_init__(self) -> None:
        if self.layer_end <= self.layer_start:
            raise ValueError(f".layer_end: expected more than layer_start {self.layer_start}, got {self.layer_end}")


class Admit(_Message, tag="ADMIT", frozen=True):
    """Coordinator -> first stage: a new request with its whole pipeline."""

    request_id: Name
    prompt: Annotated[tuple[TokenId, ...], Meta(min_length=1, max_length=MAX_LIST)]
    max_tokens: Positive
    sampling: SamplingSpec
    pipeline: StageRefs
    reply_to: Text = ""  # the coordinator's data-plane address for TOKENS ("" = control socket)
    task: TaskName = ""  # the fine-tuned task (PET) the request runs ("" = the base model)

    def __post_init__(self) -> None:
        _check_pipeline(self.pipeline)


class Step(_Message, tag="STEP", frozen=True):
    """Coordinator -> first stage: the token sampled at ``step`` (only what changed)."""

    request_id: Name
    step: Count
    token_id: TokenId


class Cancel(_Message, tag="CANCEL", frozen=True):
    """Coordinator -> any stage: drop a request and free its KV."""

    request_id: Name
    reason: Name = "cancelled"


class Heartbeat(_Message, tag="HEARTBEAT", frozen=True):
    """Agent -> coordinator, every ~250 ms: KV use (tokens), queue lengths (requests waiting for
    admission to the agent's scheduler, requests running in it) and its engine steps so far."""

    node_id: Name
    seq: Count
    kv_used_tokens: Count
    kv_reserved_tokens: Count
    kv_capacity_tokens: Count
    waiting: Count
    running: Count
    steps: StepStats = field(default_factory=StepStats)


class Refused(_Message, tag="REFUSED", frozen=True):
    """Agent -> coordinator: a stage refused or failed a request (``code``: why, see ErrorCode)."""

    request_id: Name
    node_id: Name
    code: ErrorCode
    reason: Text


class Error(_Message, tag="ERROR", frozen=True):
    """Either direction: a message was rejected or the peer is refused (not request-specific;
    ``code``: "protocol" or "auth")."""

    code: Name
    reason: Text


class LoadTask(_Message, tag="LOAD_TASK", frozen=True):
    """Coordinator -> agent: bind task ``task_id`` whose PET files are in ``path`` (a directory the
    agent reads: PEFT's LoRA layout or ours, see docs/pets.md); the agent reads only the tensors of
    the layers it holds. ``max_lora_rank`` 0: no limit. Answered by TASK_STATUS."""

    task_id: TaskId
    path: Name
    max_lora_rank: Annotated[int, Meta(ge=0, le=MAX_LAYER)] = 0


class UnloadTask(_Message, tag="UNLOAD_TASK", frozen=True):
    """Coordinator -> agent: unbind task ``task_id`` (requests running it finish first). Answered by TASK_STATUS."""

    task_id: TaskId


class TaskStatus(_Message, tag="TASK_STATUS", frozen=True):
    """Agent -> the coordinator that asked: the outcome of LOAD_TASK (``op`` "load") or UNLOAD_TASK
    ("unload"); ``error`` names the file and tensor when a PET does not fit; ``nbytes``: what the
    agent holds of the task."""

    node_id: Name
    task_id: TaskId
    op: Annotated[str, Meta(pattern="^(load|unload)$")]
    ok: bool
    error: Text = ""
    nbytes: Count = 0


class Activations(_Message, tag="ACTIVATIONS", frozen=True):
    """Stage -> next stage: hidden states of ``num_tokens`` tokens starting at ``position``. ``data``
    is not in the header: it travels as its own raw frame, ``dtype`` x ``shape`` bytes."""

    request_id: Name
    step: Count
    position: Count
    dtype: Name
    shape: Annotated[tuple[int, ...], Meta(max_length=8)]
    data: Buffer
    admit: AdmitInfo | None = None

    def __post_init__(self) -> None:
        _check_tensor(self.dtype, self.shape, memoryview(self.data).nbytes)

    def __repr__(self) -> str:
        return (f"Activations(request_id={self.request_id!r}, step={self.step}, position={self.position}, "
                f"dtype={self.dtype!r}, shape={self.shape}, admit={self.admit!r})")  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return self.shape[0]


def _check_tensor(dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    if dtype not in DTYPE_BYTES:
        raise ProtocolError(f"ACTIVATIONS.dtype: unsupported {dtype!r} (supported: {', '.join(DTYPE_BYTES)})")
    if len(shape) != 2 or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
        raise ProtocolError(f"ACTIVATIONS.shape: expected [num_tokens, hidden_size] of positive ints, got {shape!r}")
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if nbytes != expected:
        raise ProtocolError(
            f"ACTIVATIONS: tensor frame has {nbytes} bytes but dtype {dtype} and shape {list(shape)} need {expected}"
        )


class Tokens(_Message, tag="TOKENS", frozen=True):
    """Last stage -> coordinator: the tokens sampled in one engine step."""

    node_id: Name
    tokens: Annotated[tuple[TokenOut, ...], Meta(max_length=MAX_TOKENS_PER_MESSAGE)]


Message = (
    Hello | Challenge | Auth | Welcome | Admit | Step | Cancel | Heartbeat | Refused | Error | Activations | Tokens
    | LoadTask | UnloadTask | TaskStatus
)

KINDS: dict[type, str] = {cls: str(cls.__struct_config__.tag) for cls in get_args(Message)}
"""Message class -> its kind (the tag ``k`` on the wire)."""

ActivationsHeader: Any = msgspec.defstruct(
    "ActivationsHeader",
    [(f.name, f.type) if f.required else (f.name, f.type, f.default)
     for f in msgspec.structs.fields(Activations) if f.name != "data"],
    bases=(_Message,), tag=KINDS[Activations], module=__name__,
)  # fmt: skip
"""What ACTIVATIONS' header frame carries: the message less its tensor, which is the next frame."""
