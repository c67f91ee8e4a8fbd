"""OpenAI-compatible HTTP answers: completion and chat responses, streaming chunks, the model list, error bodies.

They follow OpenAI's shapes, plus one extension field ``helix`` (:class:`HelixInfo`) carrying the
pipeline(s) the request took. Errors use OpenAI's ``{"error": {...}}`` body (:func:`error_body`);
``param`` names the offending field. The request bodies are :mod:`router.openai_requests`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel


def now_s() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class StageInfo(BaseModel):
    node: str
    layers: tuple[int, int]


class HelixInfo(BaseModel):
    """Extension field: the pipeline(s) the request ran on (more than one after a failover)."""

    pipelines: list[list[StageInfo]]
    reroutes: int = 0


class _Answer(BaseModel):
    """What every completion answer holds, a whole response or a streaming chunk; each kind names its
    ``object`` and its choices (the fields keep this order in the JSON)."""

    id: str
    object: str
    created: int
    model: str
    choices: Sequence[BaseModel]
    usage: Usage | None = None
    helix: HelixInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionResponse(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "helix"
    parent: str | None = None  # a fine-tuned task: the base model it runs on (vLLM's field); the base: null


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ----------------------------------------------------------------------------- errors

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body for HTTP ``status``."""
    detail = ErrorDetail(message=message, type=ERROR_TYPES.get(status, "server_error"), param=param, code=code)
    return ErrorBody(error=detail).model_dump()
