"""The wire protocol's messages and limits (the dataclasses :mod:`helix.wire` encodes and decodes).

Pure data: no I/O, no msgpack. See :mod:`helix.wire` for the protocol and the life of a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# 2: SamplingSpec carries penalties, logit_bias and prior_output_ids; 3: HEARTBEAT.steps; 4: SamplingSpec.grammar;
# 5: ADMIT.task / ACTIVATIONS.admit.task, LOAD_TASK / UNLOAD_TASK / TASK_STATUS
PROTOCOL_VERSION = 5
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
NONCE_BYTES = 32
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
MAX_TOKEN_ID = 2**31 - 1
MAX_ID_CHARS = 256
MAX_LIST = 1 << 20
MAX_PENALTY = 2.0  # presence/frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]
MAX_GRAMMAR_CHARS = 1 << 24  # the longest SamplingSpec.grammar: more than a schema in any request body compiles to

Buffer = bytes | bytearray | memoryview

# upper bounds of the buckets an agent counts its engine steps in (HEARTBEAT.steps); values above
# the last bound fall in one more bucket
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SEQUENCES_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


# -- messages --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageRef:
    """One hop of a pipeline: which node runs which layers ``[layer_start, layer_end)``, and where
    its data plane listens (``address``)."""

    node_id: str
    layer_start: int
    layer_end: int
    address: str


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Sampling parameters applied by a pipeline's last stage.

    Penalties follow OpenAI: over the tokens this request generated, ``logits[t] -=
    presence_penalty * (count[t] > 0) + frequency_penalty * count[t]``; ``logit_bias`` adds
    ``bias`` to ``logits[token_id]`` for each ``(token_id, bias)`` pair. ``prior_output_ids`` are
    the tokens the request generated before this admission (on a pipeline that failed; they are
    the tail of the re-prefilled prompt): the penalties count them as if sampled here.
    ``grammar`` (empty: none) is an llguidance grammar, a JSON string the coordinator compiled
    from ``response_format``: the output must follow it, ``prior_output_ids`` included.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prior_output_ids: tuple[int, ...] = ()
    grammar: str = ""


@dataclass(frozen=True, slots=True)
class Hello:
    """Coordinator -> agent, first message on a control connection."""

    sender: str
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Challenge:
    """Agent -> coordinator: the agent's nonce, and its proof of the secret over both nonces."""

    node_id: str
    nonce: bytes
    proof: bytes


@dataclass(frozen=True, slots=True)
class Auth:
    """Coordinator -> agent: proof of the shared secret over the agent's nonce."""

    proof: bytes


@dataclass(frozen=True, slots=True)
class Welcome:
    """Agent -> coordinator: the handshake succeeded; what this agent holds."""

    node_id: str
    layer_start: int
    layer_end: int
    kv_capacity_tokens: int
    data_address: str


@dataclass(frozen=True, slots=True)
class Admit:
    """Coordinator -> first stage: a new request with its whole pipeline."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingSpec
    pipeline: tuple[StageRef, ...]
    reply_to: str = ""  # the coordinator's data-plane address for TOKENS ("" = control socket)
    task: str = ""  # the fine-tuned task (PET) the request runs ("" = the base model)


@dataclass(frozen=True, slots=True)
class Step:
    """Coordinator -> first stage: the token sampled at ``step`` (only what changed)."""

    request_id: str
    step: int
    token_id: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Coordinator -> any stage: drop a request and free its KV."""

    request_id: str
    reason: str = "cancelled"


@dataclass(frozen=True, slots=True)
class Distribution:
    """Values observed since an agent started, counted in fixed buckets: ``counts[i]`` values in
    ``(bounds[i-1], bounds[i]]`` and ``counts[-1]`` those above the last bound (so there is one
    count more than bounds); ``total`` is their sum. Cumulative, so a lost heartbeat loses nothing."""

    counts: tuple[int, ...]
    total: float = 0.0

    @property
    def observations(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True, slots=True)
class StepStats:
    """An agent's engine steps that ran something, since it started: each step's wall time
    (``seconds``, bounds :data:`STEP_SECONDS_BUCKETS`), the requests it batched (``sequences``,
    :data:`BATCH_SEQUENCES_BUCKETS`) and their tokens (``tokens``, :data:`BATCH_TOKENS_BUCKETS`)."""

    seconds: Distribution = Distribution((0,) * (len(STEP_SECONDS_BUCKETS) + 1))
    sequences: Distribution = Distribution((0,) * (len(BATCH_SEQUENCES_BUCKETS) + 1))
    tokens: Distribution = Distribution((0,) * (len(BATCH_TOKENS_BUCKETS) + 1))

    @property
    def steps(self) -> int:
        return self.seconds.observations


STEP_STATS_BOUNDS: dict[str, tuple[float, ...]] = {
    "seconds": STEP_SECONDS_BUCKETS, "sequences": BATCH_SEQUENCES_BUCKETS, "tokens": BATCH_TOKENS_BUCKETS,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Agent -> coordinator, every ~250 ms: KV use (tokens), queue lengths (requests waiting for
    admission to the agent's scheduler, requests running in it) and its engine steps so far."""

    node_id: str
    seq: int
    kv_used_tokens: int
    kv_reserved_tokens: int
    kv_capacity_tokens: int
    waiting: int
    running: int
    steps: StepStats = StepStats()


@dataclass(frozen=True, slots=True)
class Refused:
    """Agent -> coordinator: a request was refused (``code``: capacity, protocol, busy, ...)."""

    request_id: str
    node_id: str
    code: str
    reason: str


@dataclass(frozen=True, slots=True)
class Error:
    """Either direction: a message was rejected or the peer is refused (not request-specific)."""

    code: str
    reason: str


@dataclass(frozen=True, slots=True)
class AdmitInfo:
    """What a downstream stage learns about a request with its first ACTIVATIONS."""

    hop: int
    prompt_tokens: int
    max_tokens: int
    sampling: SamplingSpec
    pipeline: tuple[StageRef, ...]
    reply_to: str = ""
    task: str = ""


@dataclass(frozen=True, slots=True)
class LoadTask:
    """Coordinator -> agent: bind task ``task_id`` whose PET files are in ``path`` (a directory the
    agent reads: PEFT's LoRA layout or ours, see docs/pets.md); the agent reads only the tensors of
    the layers it holds. ``max_lora_rank`` 0: no limit. Answered by TASK_STATUS."""

    task_id: str
    path: str
    max_lora_rank: int = 0


@dataclass(frozen=True, slots=True)
class UnloadTask:
    """Coordinator -> agent: unbind task ``task_id`` (requests running it finish first). Answered by TASK_STATUS."""

    task_id: str


@dataclass(frozen=True, slots=True)
class TaskStatus:
    """Agent -> the coordinator that asked: the outcome of LOAD_TASK (``op`` "load") or UNLOAD_TASK
    ("unload"); ``error`` names the file and tensor when a PET does not fit; ``nbytes``: what the
    agent holds of the task."""

    node_id: str
    task_id: str
    op: str
    ok: bool
    error: str = ""
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class Activations:
    """Stage -> next stage: hidden states of ``num_tokens`` tokens starting at ``position``."""

    request_id: str
    step: int
    position: int
    dtype: str
    shape: tuple[int, ...]
    data: Buffer = field(repr=False)
    admit: AdmitInfo | None = None

    @property
    def num_tokens(self) -> int:
        return self.shape[0]


@dataclass(frozen=True, slots=True)
class TokenOut:
    """One sampled token of one request."""

    request_id: str
    step: int
    token_id: int
    finished: bool = False
    finish_reason: str = ""


@dataclass(frozen=True, slots=True)
class Tokens:
    """Last stage -> coordinator: the tokens sampled in one engine step."""

    node_id: str
    tokens: tuple[TokenOut, ...]


Message = (
    Hello | Challenge | Auth | Welcome | Admit | Step | Cancel | Heartbeat | Refused | Error | Activations | Tokens
    | LoadTask | UnloadTask | TaskStatus
)

KINDS: dict[type, str] = {
    Hello: "HELLO", Challenge: "CHALLENGE", Auth: "AUTH", Welcome: "WELCOME", Admit: "ADMIT", Step: "STEP",
    Cancel: "CANCEL", Heartbeat: "HEARTBEAT", Refused: "REFUSED", Error: "ERROR",
    Activations: "ACTIVATIONS", Tokens: "TOKENS", LoadTask: "LOAD_TASK", UnloadTask: "UNLOAD_TASK",
    TaskStatus: "TASK_STATUS",
}  # fmt: skip
