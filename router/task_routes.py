"""HTTP routes that load and unload fine-tuned tasks at runtime, with vLLM's names and bodies.

``POST /v1/load_lora_adapter`` ``{"lora_name": NAME, "lora_path": DIR}`` registers a task of any
PET type (the directory says which: docs/pets.md) and answers once every agent to hold it holds it
(Helix's optional ``"nodes": [...]`` names them; default: every node, or as ``helix serve
--task-placement`` says);
``POST /v1/unload_lora_adapter`` ``{"lora_name": NAME}`` stops new requests for it at once and
answers once its requests in flight finished and the agents dropped it. Success is a plain-text
200 as vLLM's; errors are OpenAI-style bodies (400 for a task that does not fit its base, naming
the file and tensor; 404 for unloading an unknown task). On a server bound beyond loopback these
routes need an API key (the app's ``/v1`` guard checks it); without one configured they are refused.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException

from helix.errors import RequestError
from router.coordinator import Coordinator
from router.openai_requests import describe_validation_errors

MAX_ADMIN_BODY_BYTES = 64 * 1024


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body, for a task of any PET type."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    nodes: list[str] | None = None  # Helix's: the nodes to hold the task (default: as the placement policy says)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body (``lora_int_id`` is accepted and not needed: names are unique)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None


async def admin_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """An admin route's JSON body, validated by ``model`` (RequestError naming the field, or the size)."""
    raw = await request.body()
    if len(raw) > MAX_ADMIN_BODY_BYTES:
        raise RequestError(f"request body is over the limit of {MAX_ADMIN_BODY_BYTES} bytes")
    try:
        return model.model_validate(json.loads(raw))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    except ValidationError as exc:
        message, param = describe_validation_errors(list(exc.errors()))
        raise RequestError(message, param=param) from None


def add_task_routes(app: FastAPI, coordinator: Coordinator, *, open_without_key: bool) -> None:
    """Add the two routes; ``open_without_key`` False refuses them (403) — set when the server is
    bound beyond loopback and no API key is configured."""

    async def body_of(request: Request, model: type[BaseModel]) -> BaseModel:
        if not open_without_key:
            raise HTTPException(403, "loading and unloading tasks on a server bound beyond loopback needs an API "
                                     "key (helix serve --api-key)")  # fmt: skip
        return await admin_body(request, model)

    @app.post("/v1/load_lora_adapter")
    async def load_task(request: Request) -> PlainTextResponse:
        body = await body_of(request, LoadLoRAAdapterRequest)
        assert isinstance(body, LoadLoRAAdapterRequest)
        task = await coordinator.tasks.load(body.lora_name, body.lora_path, body.nodes)
        return PlainTextResponse(f"Success: task '{task.name}' ({task.pet_type}) loaded from {task.path}.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_task(request: Request) -> PlainTextResponse:
        body = await body_of(request, UnloadLoRAAdapterRequest)
        assert isinstance(body, UnloadLoRAAdapterRequest)
        task = await coordinator.tasks.unload(body.lora_name)
        return PlainTextResponse(f"Success: task '{task.name}' unloaded.")
