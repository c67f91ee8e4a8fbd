"""The coordinator's HTTP face: an OpenAI-compatible FastAPI app.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (server-sent events when
``stream`` is true; ``model`` names the base model or a fine-tuned task), ``GET /v1/models`` (the
base model and every task, with its ``parent``), ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (:mod:`router.task_routes`), ``GET /v1/cluster`` and ``POST
/v1/cluster/join`` (:mod:`router.cluster_routes`), ``GET /health`` (200 only while a complete pipeline
exists, else 503), ``GET /metrics`` (Prometheus text). Optional Bearer API keys guard ``/v1``.
Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` with
the status of the :class:`~helix.errors.HelixError` behind it. The app is a thin wrapper: the
request lifecycle lives in :class:`router.coordinator.Coordinator`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from helix.domain import Pipeline
from helix.errors import HelixError, OverloadedError, RequestError
from router.cluster_routes import add_cluster_routes
from router.coordinator import Coordinator, RequestHandle
from router.metrics import ServingMetrics
from router.openai_requests import (
    DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    describe_validation_errors,
)
from router.openai_responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    HelixInfo,
    ModelCard,
    ModelList,
    StageInfo,
    Usage,
    error_body,
    now_s,
)
from router.request import Finish, GenerationRequest
from router.task_routes import add_task_routes

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024


class HTTPError(Exception):
    """An error with an HTTP status and OpenAI error fields, raised inside handlers."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status, headers=headers)


class _Guard:
    """API keys on ``/v1`` and the body-size limit, before anything reads the body, and every
    response counted by route and status code (``helix_http_responses_total``; a path that is
    no route counts as ``other``, so clients cannot grow the label set). A plain ASGI
    middleware, because the handlers talk to ``receive`` directly (a waiting non-streaming
    request watches it for ``http.disconnect``) and starlette's ``BaseHTTPMiddleware``
    (``@app.middleware("http")``) wraps every ``receive`` in a task group of its own; with it and
    the old 4-per-second ``is_disconnected`` polls the coordinator (with the bench's load
    generator) used 2.30 CPU-s for 32 requests of 96 tokens, 1.4-1.7 without."""

    def __init__(self, app: ASGIApp, keys: Sequence[bytes], metrics: ServingMetrics, routes: frozenset[str]) -> None:
        self.app, self.keys, self.metrics, self.routes = app, list(keys), metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in self.routes else "other"

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.metrics.response(route, message["status"])
            await send(message)

        refusal = self._refusal(Headers(scope=scope), path)
        await (refusal or self.app)(scope, receive, counted)

    def _refusal(self, headers: Headers, path: str) -> Response | None:
        if path.startswith("/v1/") and self.keys:
            auth = headers.get("authorization", "")
            token = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
            if not any(hmac.compare_digest(token, k) for k in self.keys):
                return _error(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                              code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return _error(413, f"request body of {length} bytes is over the limit of {MAX_BODY_BYTES} bytes")
        return None


def create_app(coordinator: Coordinator, *, api_keys: Sequence[str] = (), lifespan: Any = None,
               task_admin_without_key: bool = True) -> FastAPI:
    """The FastAPI app serving ``coordinator``; ``api_keys`` (if any) are required on ``/v1``. Without
    keys, loading and unloading tasks is refused unless ``task_admin_without_key`` (a loopback server)."""
    app = FastAPI(title="Helix coordinator", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.coordinator = coordinator

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, exc: HTTPError) -> JSONResponse:
        return _error(exc.status, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(HelixError)
    async def _helix_error(_: Request, exc: HelixError) -> JSONResponse:
        return _helix_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return _error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = coordinator.ready
        body = {"status": "ready" if ready else "not ready", **coordinator.health_details()}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        coordinator.refresh_metrics()
        return Response(coordinator.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> ModelList:
        base = [ModelCard(id=name, created=coordinator.started_s) for name in coordinator.model_names]
        tasks = [ModelCard(id=t.name, created=t.created_s, parent=coordinator.model_names[0])
                 for t in coordinator.tasks.ready()]  # fmt: skip
        return ModelList(data=base + tasks)

    add_task_routes(app, coordinator, open_without_key=task_admin_without_key or bool(api_keys))
    add_cluster_routes(app, coordinator, open_without_key=task_admin_without_key or bool(api_keys))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest, coordinator)
        if isinstance(body.prompt, str):
            prompt_ids = coordinator.tokenizer.encode(body.prompt)
        else:
            prompt_ids = _checked_ids(body.prompt, coordinator.tokenizer.vocab_size)
        gen = _generation(coordinator, body, prompt_ids, default_max=DEFAULT_MAX_TOKENS, prompt_param="prompt")
        return await _serve(request, coordinator, gen, body, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest, coordinator)
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        try:
            prompt_ids = coordinator.tokenizer.encode_chat(messages)
        except Exception as exc:  # jinja2 TemplateError from the model's own template
            raise HTTPError(400, f"messages do not fit the model's chat template: {exc}", param="messages") from exc
        gen = _generation(coordinator, body, prompt_ids, default_max=None, prompt_param="messages")
        return await _serve(request, coordinator, gen, body, "chat")

    routes = frozenset(path for route in app.routes if isinstance(path := getattr(route, "path", None), str))
    app.add_middleware(_Guard, keys=[k.encode() for k in api_keys], metrics=coordinator.metrics, routes=routes)
    return app


def _helix_response(exc: HelixError) -> JSONResponse:
    headers = None
    if isinstance(exc, OverloadedError):
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    elif exc.http_status == 503:
        headers = {"Retry-After": "1"}
    param = exc.param if isinstance(exc, RequestError) else None
    code = type(exc).__name__.removesuffix("Error").lower() or None
    return _error(exc.http_status, exc.message, param=param, code=code, headers=headers)


async def _parse(request: Request, model: type[BaseModel], coordinator: Coordinator) -> Any:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise HTTPError(413, f"request body is over the limit of {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise HTTPError(400, "request body must be a JSON object")
    try:
        body = model.model_validate(data, context={"max_tokens_cap": coordinator.max_tokens_cap,
                                                   "vocab_size": coordinator.tokenizer.vocab_size})
    except ValidationError as exc:
        message, param = describe_validation_errors(list(exc.errors()))
        raise HTTPError(400, message, param=param) from exc
    name = body.model  # type: ignore[attr-defined]
    if name not in coordinator.model_names and coordinator.tasks.servable(name) is None:
        tasks = len(coordinator.tasks.ready())
        raise HTTPError(404, f"the model '{name}' does not exist here; this server serves "
                        f"{', '.join(coordinator.model_names)}" + (f" and {tasks} fine-tuned tasks (GET /v1/models)"
                                                                   if tasks else ""),
                        param="model", code="model_not_found")  # fmt: skip
    return body


def _checked_ids(ids: list[int], vocab_size: int) -> list[int]:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise HTTPError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="prompt")
    return list(ids)


def _generation(coordinator: Coordinator, body: Any, prompt_ids: list[int], *, default_max: int | None,
                prompt_param: str) -> GenerationRequest:
    context = coordinator.max_context_tokens
    room = context - len(prompt_ids)
    if room < 1:
        raise HTTPError(400, f"the prompt is {len(prompt_ids)} tokens but this model's context is {context} tokens",
                        param=prompt_param, code="context_length_exceeded")
    max_tokens = body.max_tokens if body.max_tokens is not None else min(default_max or room, coordinator.max_tokens_cap)
    if max_tokens > room:
        if body.max_tokens is not None:
            raise HTTPError(400, f"this model's context is {context} tokens, but {len(prompt_ids) + max_tokens} were "
                            f"requested ({len(prompt_ids)} in the prompt, {max_tokens} to generate)",
                            param="max_tokens", code="context_length_exceeded")
        max_tokens = room
    return GenerationRequest(prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=body.temperature,
                             top_p=body.top_p, seed=body.seed, stop=tuple(body.stop_strings),
                             presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                             logit_bias=body.logit_bias_pairs, grammar=body.grammar,
                             task="" if body.model in coordinator.model_names else body.model)


def _helix_info(pipelines: Sequence[Pipeline]) -> HelixInfo:
    return HelixInfo(pipelines=[[StageInfo(node=s.node, layers=(s.layer_start, s.layer_end)) for s in p.stages]
                                for p in pipelines], reroutes=max(0, len(pipelines) - 1))


def _usage(finish: Finish) -> Usage:
    return Usage(prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens,
                 total_tokens=finish.prompt_tokens + finish.completion_tokens)


async def _serve(request: Request, coordinator: Coordinator, gen: GenerationRequest, body: Any, kind: str) -> Response:
    try:
        handle = await coordinator.admit(gen)
    except HelixError:
        coordinator.metrics.requests.labels(kind, "rejected").inc()
        raise
    if body.stream:
        return StreamingResponse(_sse(handle, coordinator, body, kind), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    collect = asyncio.ensure_future(_collect(handle))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait([collect, gone], return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():
            collect.cancel()
            coordinator.metrics.requests.labels(kind, "disconnected").inc()
            handle.cancel("client disconnected")
            return Response(status_code=499)
        text, finish = collect.result()
    except HelixError:
        coordinator.metrics.requests.labels(kind, "error").inc()
        raise
    finally:
        gone.cancel()
        handle.cancel("done")
    coordinator.metrics.requests.labels(kind, "ok").inc()
    created, model = now_s(), body.model
    if kind == "chat":
        return JSONResponse(ChatCompletionResponse(
            id=handle.response_id("chatcmpl"), created=created, model=model,
            choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=finish.reason)],
            usage=_usage(finish), helix=_helix_info(finish.pipelines)).model_dump(exclude_none=True))
    return JSONResponse(CompletionResponse(
        id=handle.response_id("cmpl"), created=created, model=model,
        choices=[CompletionChoice(text=text, finish_reason=finish.reason)],
        usage=_usage(finish), helix=_helix_info(finish.pipelines)).model_dump(exclude_none=True))


async def _client_gone(request: Request) -> None:
    """Return when the client closes its connection. The body was read already, so the server's
    next ASGI message is ``http.disconnect`` (no polling: ``is_disconnected`` 4 times a second
    cost ~0.1 ms each, per waiting request)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(handle: RequestHandle) -> tuple[str, Finish]:
    parts: list[str] = []
    async for event in handle.events():
        if isinstance(event, Finish):
            return "".join(parts), event
        parts.append(event)
    raise AssertionError("event stream ended without a Finish")


def _sse_data(obj: BaseModel | dict[str, Any]) -> bytes:
    payload = obj.model_dump(exclude_none=True) if isinstance(obj, BaseModel) else obj
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _sse(handle: RequestHandle, coordinator: Coordinator, body: Any, kind: str) -> AsyncIterator[bytes]:
    rid = handle.response_id("chatcmpl" if kind == "chat" else "cmpl")
    created, model = now_s(), body.model
    status = "disconnected"  # if the client goes away, the generator is closed at a yield

    def chunk(text: str | None, finish: Finish | None = None, *, first: bool = False) -> BaseModel:
        reason = finish.reason if finish else None
        info = _helix_info(finish.pipelines) if finish else _helix_info(handle.pipelines) if first else None
        if kind == "chat":
            delta = ChatDelta(role="assistant" if first else None, content=text)
            return ChatCompletionChunk(id=rid, created=created, model=model, helix=info,
                                       choices=[ChatChunkChoice(delta=delta, finish_reason=reason)])
        return CompletionResponse(id=rid, created=created, model=model, helix=info,
                                  choices=[CompletionChoice(text=text or "", finish_reason=reason)])

    try:
        yield _sse_data(chunk("", first=True))  # carries the pipeline the request starts on
        async for event in handle.events():
            if isinstance(event, Finish):
                yield _sse_data(chunk(None if kind == "chat" else "", event))
                if body.include_usage:
                    usage_chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if kind == "chat"
                                                   else "text_completion", "created": created, "model": model,
                                                   "choices": [], "usage": _usage(event).model_dump()}
                    yield _sse_data(usage_chunk)
                break
            yield _sse_data(chunk(event))
        yield b"data: [DONE]\n\n"
        status = "ok"
    except HelixError as exc:
        status = "error"
        payload = error_body(exc.http_status, exc.message)
        yield _sse_data(payload)
    finally:
        handle.cancel("stream closed")
        coordinator.metrics.requests.labels(kind, status).inc()
