"""The records inside the wire protocol's messages, and what a field accepts.

The messages themselves are :mod:`helix.wire_messages`; this module holds what they are made of:
the protocol's limits, the field types (``Annotated`` constraints: lengths and ranges, checked
when decoding) and the records that travel inside messages — a pipeline's stages
(:class:`StageRef`), sampling parameters, a downstream stage's admission, an agent's step
statistics, a sampled token and the layer spans an agent holds (:class:`LayerSpan`). A rule
across fields is the record's ``__post_init__``, whose ``ValueError`` starts with the field's
path below the record (``".pipeline[1]: ..."``) so the decoder can name kind and field. Pure data.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, field

from helix.domain import FinishReason, Stage

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


def check_pipeline(pipeline: tuple[StageRef, ...]) -> None:
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
        check_pipeline(self.pipeline)
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


class LayerSpan(_Record, array_like=True, frozen=True):
    """Layers ``[start, end)`` an agent holds, on the wire as ``[start, end]`` (never empty)."""

    start: Annotated[int, Meta(ge=0, lt=MAX_LAYER)]
    end: Annotated[int, Meta(ge=1, le=MAX_LAYER)]

    def __post_init__(self) -> None:
        if self.end <= self.start:
            raise ValueError(f".end: expected more than start {self.start}, got {self.end}")


LayerSpans = Annotated[tuple[LayerSpan, ...], Meta(max_length=MAX_STAGES)]


def check_spans(spans: tuple[LayerSpan, ...], name: str, start: int, end: int) -> None:
    """``spans`` ascend, neither overlap nor touch (each is as long as it can be) and, when there are
    any, one holds the range ``[start, end)`` (if not empty); ``.name...: why`` else."""
    for i in range(1, len(spans)):
        if spans[i].start <= spans[i - 1].end:
            raise ValueError(f".{name}[{i}]: starts at layer {spans[i].start}, not past the previous span's end "
                             f"{spans[i - 1].end} (spans ascend, apart)")  # fmt: skip
    if spans and start < end and not any(s.start <= start and end <= s.end for s in spans):
        raise ValueError(f".{name}: no span holds the range [{start}, {end}) (held: "
                         f"{' '.join(f'[{s.start}, {s.end})' for s in spans)})")  # fmt: skip
