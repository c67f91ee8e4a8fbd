"""OpenAI-compatible request bodies of ``/v1/completions`` and ``/v1/chat/completions``.

What happens to each request field (nothing is silently ignored unless listed as ignored):

* **Honoured**: ``model``, ``prompt`` / ``messages``, ``max_tokens`` (``max_completion_tokens``),
  ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options.include_usage``,
  ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2], OpenAI's formula over the tokens
  generated so far: ``logits[t] -= presence * (count[t] > 0) + frequency * count[t]``), and
  ``logit_bias`` (token id as a decimal string -> bias in [-100, 100], at most
  :data:`MAX_LOGIT_BIAS_ENTRIES` entries, every id inside the vocabulary, passed as validation
  context ``{"vocab_size": N}``). Types and ranges are validated; ``max_tokens`` is capped by
  the server (context ``{"max_tokens_cap": N}``).
* **Honoured, chat only**: ``response_format`` (:class:`ResponseFormat`): ``{"type": "text"}``
  (free text, the default), ``{"type": "json_object"}`` (JSON mode: the output is one JSON
  object) or ``{"type": "json_schema", "json_schema": {"name", "description", "schema",
  "strict"}}`` (structured outputs: JSON matching ``schema``, enforced whatever ``strict``
  says; no ``schema`` means any JSON object). The schema is compiled and checked here
  (:mod:`router.structured_output`): one llguidance cannot enforce, an unknown ``type`` or a
  misplaced ``json_schema`` is a 400 naming the sub-field. The output stops when the JSON is
  complete, or at ``max_tokens`` (cut short: ``finish_reason`` ``"length"``).
* **Accepted only at their no-op value**: ``n`` (1), ``logprobs`` (off), ``top_logprobs`` (0),
  ``echo`` (false), ``best_of`` (1), ``suffix`` (empty), ``modalities`` (``["text"]``),
  ``tools`` / ``functions`` (empty), ``tool_choice`` / ``function_call`` (``"none"`` or
  ``"auto"``, which with no tools change nothing). Any other value is a 400.
* **Accepted and ignored** (:data:`IGNORED_FIELDS`): fields stock OpenAI clients may send that
  do not change the output: ``user``, ``metadata``, ``store``, ``service_tier``,
  ``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_retention``,
  ``prompt_cache_options``, ``parallel_tool_calls`` (meaningless without tools).
* **Anything else** (``audio``, ``prediction``, ``reasoning_effort``, ``top_k``, typos ...) is a
  400 naming the field: DESIGN.md's ``extra="forbid"`` for HTTP bodies, with the allow-list
  above. Unknown fields inside a message or a content part are rejected the same way.

(The ``openai`` Python client sends only the fields its caller passes.) A body that fails these
checks is described by :func:`describe_validation_errors` (``param`` names the field). Responses,
streaming chunks and error bodies are :mod:`router.openai_responses`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from helix.wire import MAX_LOGIT_BIAS, MAX_PENALTY
from router.structured_output import json_object_grammar, json_schema_grammar

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4
MAX_LOGIT_BIAS_ENTRIES = 1024
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "parallel_tool_calls",
})  # fmt: skip
"""Request fields accepted and dropped: they never change the generated text."""

Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: Any = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Bias] | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k not in IGNORED_FIELDS}
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("max_tokens")
    @classmethod
    def _cap(cls, v: int | None, info: ValidationInfo) -> int | None:
        cap = (info.context or {}).get("max_tokens_cap")
        if v is not None and cap is not None and v > cap:
            raise ValueError(f"max_tokens={v} exceeds this server's limit of {cap}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, v: dict[str, float] | None, info: ValidationInfo) -> dict[str, float] | None:
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(v)}")
        vocab = (info.context or {}).get("vocab_size")
        for key in v:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"key {key!r} is not a token id (a non-negative integer as a string)")
            if vocab is not None and int(key) >= vocab:
                raise ValueError(f"token id {int(key)} is outside the vocabulary [0, {vocab})")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    @property
    def grammar(self) -> str:
        """The llguidance grammar the output must follow (``response_format``); empty for free text."""
        return ""

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs in id order (zero biases dropped)."""
        return tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items() if b))


class CompletionRequest(_Request):
    """Body of ``POST /v1/completions``. One prompt: a string or a list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of > 1 is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


NO_FUNCTION_CALLING = "Helix does not implement function calling"


class JsonSchemaSpec(BaseModel):
    """``response_format.json_schema``: OpenAI's fields. The schema is enforced whether or not
    ``strict`` is set; no schema means any JSON object."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _enforceable(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            json_schema_grammar(v)  # a SchemaError (a ValueError) says what cannot be enforced; the grammar is cached
        return v

    @property
    def grammar(self) -> str:
        """The llguidance grammar of ``schema`` (any JSON object without one)."""
        return json_object_grammar() if self.schema_ is None else json_schema_grammar(self.schema_)


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (free text), ``json_object`` (JSON mode: any JSON object) or
    ``json_schema`` (structured outputs: JSON matching ``json_schema.schema``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a "json_schema" object with a "name" and a "schema"')
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f'"json_schema" is only read with type "json_schema", not {self.type!r}')
        return self

    @property
    def grammar(self) -> str:
        """The llguidance grammar the output must follow (empty for free text)."""
        if self.type == "json_object":
            return json_object_grammar()
        if self.json_schema is not None:
            return self.json_schema.grammar
        return ""


class ChatCompletionRequest(_Request):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    function_call: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, v: list[str] | None) -> list[str] | None:
        if v not in (None, ["text"]):
            raise ValueError('only ["text"] is supported')
        return v

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError(f"not supported: {NO_FUNCTION_CALLING}")
        return v

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, v: Any) -> Any:
        if v not in (None, "none", "auto"):
            raise ValueError(f"not supported: {NO_FUNCTION_CALLING} (only 'none' or 'auto' with no tools)")
        return v

    @property
    def grammar(self) -> str:
        return self.response_format.grammar if self.response_format is not None else ""

    @model_validator(mode="after")
    def _merge_max(self, info: ValidationInfo) -> ChatCompletionRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            cap = (info.context or {}).get("max_tokens_cap")
            if cap is not None and self.max_completion_tokens > cap:
                raise ValueError(f"max_completion_tokens={self.max_completion_tokens} exceeds this server's limit of {cap}")
            self.max_tokens = self.max_completion_tokens
        return self


def describe_validation_errors(errors: list[Any]) -> tuple[str, str | None]:
    """One readable message (and the first offending parameter) from pydantic's error list."""
    parts: list[str] = []
    param: str | None = None
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = ("unknown field: Helix rejects fields it does not implement rather than ignore them "
                   f"(accepted and ignored: {', '.join(sorted(IGNORED_FIELDS))})")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request body", param
