"""HTTP routes of live membership (issue 18): the cluster's versioned view, and nodes asking to join.

``GET /v1/cluster`` answers the coordinator's view (:meth:`router.membership.Membership.view`):
the plan ``version`` it routes by, every member with its state (joining, serving, standby,
leaving, dead), its layers in the plan and the spans its agent holds, the placement, the
reconfiguration in progress (its phase, reasons, the nodes it waits for, the new placement), why
the model cannot be served if so, the policy and the latest membership events. On a fixed plan
(``helix serve --no-replan``) it shows the plan's nodes.

``POST /v1/cluster/join`` ``{"node_id", "gpu", "control_address", "region"?}`` is what ``helix agent
--join`` sends once its agent is up holding no layers: the coordinator dials ``control_address``,
and the shared-secret handshake authenticates the agent as for any node; once it completed, the
membership re-plans with the node. Answers 202 at once (the re-plan follows). It needs the API key
where ``/v1`` does, and, like loading tasks, is refused on a server bound beyond loopback without one.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from helix.errors import RequestError
from router.coordinator import Coordinator
from router.task_routes import admin_body


class JoinRequest(BaseModel):
    """What a joining agent says about itself."""

    model_config = ConfigDict(extra="forbid")

    node_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    gpu: str = Field(min_length=1, max_length=128)
    control_address: str = Field(pattern=r"^tcp://[^\s]+:[0-9]+$", max_length=256)
    region: str | None = Field(default=None, max_length=128)


def add_cluster_routes(app: FastAPI, coordinator: Coordinator, *, open_without_key: bool) -> None:
    """Add the two routes; ``open_without_key`` False refuses joins (403): the server is bound beyond
    loopback and no API key is configured."""

    @app.get("/v1/cluster")
    async def cluster() -> JSONResponse:
        return JSONResponse(coordinator.cluster_view())

    @app.post("/v1/cluster/join")
    async def join(request: Request) -> JSONResponse:
        if not open_without_key:
            raise HTTPException(403, "joining a coordinator bound beyond loopback needs an API key "
                                     "(helix serve --api-key)")  # fmt: skip
        body = await admin_body(request, JoinRequest)
        assert isinstance(body, JoinRequest)
        if coordinator.membership is None:
            raise RequestError("this coordinator serves a fixed plan (helix serve --no-replan): nodes cannot join",
                               param="node_id")  # fmt: skip
        coordinator.membership.join(body.node_id, body.gpu, body.control_address, body.region)
        return JSONResponse({"node_id": body.node_id, "status": "dialing",
                             "version": coordinator.membership.membership.version}, status_code=202)
