"""The wire protocol's messages, each declared once: the msgspec Structs below drive both
:func:`helix.wire.encode` and :func:`helix.wire.decode`.

A field's type says what the wire accepts (``Annotated`` constraints: lengths and ranges, checked
when decoding; the field types, limits and the records inside messages are :mod:`helix.wire_records`);
a rule across fields (a pipeline's layers follow each other, a tensor's bytes match
its dtype and shape) is the message's ``__post_init__``, which runs on construction and on decoding
alike. A ``__post_init__`` names what it rejects by starting its ``ValueError`` with the field's
path below the struct (``".pipeline[1]: ..."``), so the decoder's error can name kind and field.

Messages are maps tagged with their kind (``k``); the records that repeat inside them (a pipeline's
stages, a step's tokens, a histogram, held layer spans) travel as arrays. A stage on the wire is a
:class:`helix.domain.Stage` plus its data-plane address; finish reasons and refusal codes are
:class:`helix.domain.FinishReason` and :class:`helix.domain.ErrorCode`, whose values are the strings
on the wire. Pure data: no I/O. See :mod:`helix.wire` for the framing and the life of a request,
and docs/node_agent.md for live membership (SET_LAYERS, RELEASE_LAYERS, LAYERS, LEAVING).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, get_args

import msgspec
from msgspec import Meta, field

from helix.domain import ErrorCode
from helix.errors import ProtocolError
from helix.wire_records import (
    DTYPE_BYTES,
    MAX_LAYER,
    MAX_LIST,
    MAX_TOKENS_PER_MESSAGE,
    AdmitInfo,
    Buffer,
    Count,
    LayerSpans,
    Name,
    Nonce,
    Positive,
    Proof,
    SamplingSpec,
    StageRefs,
    StepStats,
    TaskId,
    TaskName,
    Text,
    TokenId,
    TokenOut,
    _Message,
    check_pipeline,
    check_spans,
)

# 2: SamplingSpec carries penalties, logit_bias and prior_output_ids; 3: HEARTBEAT.steps; 4: SamplingSpec.grammar;
# 5: ADMIT.task / ACTIVATIONS.admit.task, LOAD_TASK / UNLOAD_TASK / TASK_STATUS; 6: msgspec Structs - the header
# is [version, message], a stage is [{node, layer_start, layer_end}, address], a token [id, step, token, reason|nil],
# and SamplingSpec.paced (defaulted; added in the same redesign, issue 14, so 6 stays); 7: live membership -
# SET_LAYERS / RELEASE_LAYERS / LAYERS / LEAVING, WELCOME.version / .held and its 0:0 (no layers yet), REFUSED
# codes "leaving" and "layers_moved" (issue 18)
PROTOCOL_VERSION = 7

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
    """Agent -> coordinator: the handshake succeeded; what this agent holds.

    ``[layer_start, layer_end)`` is the range the agent serves as its own: the plan's at start-up,
    then that of the latest SET_LAYERS it finished loading (``version``; 0: none yet). A joining
    agent that holds no layers yet says ``layer_start == layer_end == 0``. ``held``: every layer
    it holds now (more than its range while a re-plan's old layers are not released yet); empty
    means exactly ``[layer_start, layer_end)``."""

    node_id: Name
    layer_start: Count
    layer_end: Count
    kv_capacity_tokens: Count
    data_address: Name
    version: Count = 0
    held: LayerSpans = ()

    def __post_init__(self) -> None:
        if self.layer_end <= self.layer_start and (self.layer_start, self.layer_end) != (0, 0):
            raise ValueError(f".layer_end: expected more than layer_start {self.layer_start} (or layer_start = "
                             f"layer_end = 0: no layers yet), got {self.layer_end}")  # fmt: skip
        check_spans(self.held, "held", self.layer_start, self.layer_end)


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
        check_pipeline(self.pipeline)


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


# -- live membership: an agent's layers change while it serves, an agent leaves (issue 18) ---------


class SetLayers(_Message, tag="SET_LAYERS", frozen=True):
    """Coordinator -> agent: from plan ``version`` on, hold layers ``[layer_start, layer_end)``.

    The agent loads the layers it lacks (new weights in before any old ones out: it then holds the
    union) while it keeps serving every request it admitted; nothing is dropped until
    RELEASE_LAYERS. Answered by LAYERS (``op`` "load") once the range is loaded, or at once with
    ``error`` when it cannot be (not enough memory, naming the bytes, checked before loading; a
    range past the model's layers; an older version). Versions only grow; a repeated version with
    the same range is answered again."""

    version: Positive
    layer_start: Annotated[int, Meta(ge=0, lt=MAX_LAYER)]
    layer_end: Annotated[int, Meta(ge=1, le=MAX_LAYER)]

    def __post_init__(self) -> None:
        if self.layer_end <= self.layer_start:
            raise ValueError(f".layer_end: expected more than layer_start {self.layer_start}, got {self.layer_end}")


class ReleaseLayers(_Message, tag="RELEASE_LAYERS", frozen=True):
    """Coordinator -> agent: drop the layers outside plan ``version``'s range (the latest SET_LAYERS,
    loaded), and their KV. A request that needs them and is not admitted yet is refused at once
    (REFUSED, :attr:`~helix.domain.ErrorCode.LAYERS_MOVED`: retryable, the coordinator re-prefills it
    elsewhere); the requests already running on them go on for up to ``drain_s`` seconds, then are
    refused the same way. Answered by LAYERS (``op`` "release") once the layers are dropped."""

    version: Positive
    drain_s: Annotated[float, Meta(ge=0.0, le=86400.0)] = 30.0


class Layers(_Message, tag="LAYERS", frozen=True):
    """Agent -> the coordinator that asked: how SET_LAYERS (``op`` "load") or RELEASE_LAYERS
    ("release") of ``version`` went. ``[layer_start, layer_end)``: the range the agent serves as its
    own now (that of ``version`` when it succeeded); ``held``: every layer it holds now, and their
    weights' bytes (``weight_bytes``); ``error`` (empty: done) says why not, naming the field or the
    bytes; ``seconds``: how long the load or the release took."""

    node_id: Name
    version: Count
    op: Annotated[str, Meta(pattern="^(load|release)$")]
    layer_start: Count
    layer_end: Count
    held: LayerSpans = ()
    weight_bytes: Count = 0
    error: Text = ""
    seconds: Annotated[float, Meta(ge=0.0, le=1e9)] = 0.0

    def __post_init__(self) -> None:
        check_spans(self.held, "held", self.layer_start, self.layer_end)

    @property
    def ok(self) -> bool:
        return not self.error


class Leaving(_Message, tag="LEAVING", frozen=True):
    """Agent -> every coordinator: the agent was asked to stop (SIGTERM) and drains. It refuses new
    requests (REFUSED, :attr:`~helix.domain.ErrorCode.LEAVING`, retryable), finishes those it runs
    within ``drain_s`` seconds, refuses what is left the same way, then exits."""

    node_id: Name
    drain_s: Annotated[float, Meta(ge=0.0, le=86400.0)]
    running: Count = 0  # requests it runs as it starts draining


Message = (
    Hello | Challenge | Auth | Welcome | Admit | Step | Cancel | Heartbeat | Refused | Error | Activations | Tokens
    | LoadTask | UnloadTask | TaskStatus | SetLayers | ReleaseLayers | Layers | Leaving
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
