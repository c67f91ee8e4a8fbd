"""Assemble a running coordinator: plan + cluster + model dir -> Coordinator + FastAPI app + uvicorn.

:func:`build_coordinator` wires the pure router (:class:`router.policy.Router`), the tokenizer
and the metrics; :func:`create_server_app` adds the lifespan that connects to the agents
(:class:`router.agents_io.AgentsIO`) and starts the KV-report watcher; :func:`make_server`
returns a uvicorn server bound to loopback unless told otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from helix.errors import ConfigError
from helix.keys import CurveKeys
from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from router.agents_io import AgentsIO
from router.app import create_app
from router.coordinator import Coordinator
from router.membership_driver import MembershipDriver
from router.membership_types import MembershipPolicy
from router.pet_balancer import BalancePolicy
from router.pet_migration import PetMigrator
from router.policy import Router, plan_flows
from router.task_placement import PlacementPolicy
from router.tokenizer import ChatTokenizer, ensure_tokenizer_dir

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS_CAP = 2048
DEFAULT_CONTEXT_TOKENS = 2048


@dataclass(slots=True)
class ServeOptions:
    """Knobs of ``helix serve`` (and of the demo)."""

    model_dir: str | None = None
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    max_context_tokens: int | None = None  # default: the model's max_position_embeddings
    queue_bound: int = 256
    admission_timeout_s: float = 30.0
    watermark: float = 0.85
    served_model_names: Sequence[str] = ()
    max_lora_rank: int = 0  # a LoRA task of a higher rank is refused at registration; 0: no limit
    membership: MembershipPolicy | None = None  # re-plan as nodes join, leave and die (router.membership); None: a fixed plan
    task_placement: PlacementPolicy = PlacementPolicy.ALL  # which nodes a new task is loaded on (router.task_placement)
    pet_balance: BalancePolicy | None = None  # move tasks' PETs between nodes of the same layers (router.pet_migration)


def build_coordinator(cluster: ClusterSpec, plan: Plan, profiles: ProfileSet | None,
                      options: ServeOptions) -> Coordinator:
    """The coordinator for ``plan`` on ``cluster`` (not yet connected to agents)."""
    model_dir = ensure_tokenizer_dir(options.model_dir)
    tokenizer = ChatTokenizer.from_dir(model_dir)
    config_file = Path(model_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    num_layers = int(config.get("num_hidden_layers", 0)) or None
    if profiles is not None and cluster.model in profiles.models:
        num_layers = profiles.models[cluster.model].num_layers
    if num_layers is None:
        raise ConfigError("cannot tell the model's layer count: give profiles or a model dir with config.json")
    context = options.max_context_tokens or int(config.get("max_position_embeddings", DEFAULT_CONTEXT_TOKENS))
    router = Router.from_plan(plan, cluster, profiles, num_layers=num_layers, watermark=options.watermark)
    names = list(dict.fromkeys([*options.served_model_names, cluster.model, plan.model]))
    coordinator = Coordinator(router, tokenizer, model_names=names, max_context_tokens=context,
                              max_tokens_cap=min(options.max_tokens_cap, context),
                              planned_flows=plan_flows(plan, cluster, profiles), queue_bound=options.queue_bound,
                              admission_timeout_s=options.admission_timeout_s, max_lora_rank=options.max_lora_rank,
                              task_placement=options.task_placement)
    for name, path in cluster.task_paths():  # a bad directory or name stops the start, naming the file
        coordinator.tasks.check_new(name, path)
    coordinator.startup_tasks = cluster.task_paths()
    if options.pet_balance is not None:
        coordinator.migrator = PetMigrator(coordinator, options.pet_balance)
    if options.membership is not None:
        if profiles is None:
            raise ConfigError("re-planning as nodes come and go needs the cluster's profiles", field="profiles")
        coordinator.membership = MembershipDriver(coordinator, cluster, plan, profiles, options.membership,
                                                  num_layers=num_layers, watermark=options.watermark)  # fmt: skip
        coordinator.core.wait_for_replan = True  # with no route left, requests wait for the re-plan (not yet started)
    return coordinator


def agent_addresses(cluster: ClusterSpec, plan: Plan, overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """Control address of every placed node: ``overrides`` first, else the cluster's ``address``."""
    out: dict[str, str] = {}
    for node in plan.placement:
        address = (overrides or {}).get(node) or cluster.node(node).address
        if not address:
            raise ConfigError(f"node {node!r} has no address; give one in the cluster file or --agent {node}=tcp://HOST:PORT",
                              source=cluster.source, field=f"nodes.{node}.address")
        out[node] = address
    return out


def create_server_app(coordinator: Coordinator, agents: Mapping[str, str], *, secret: bytes = b"",
                      api_keys: Sequence[str] = (), dead_after_s: float = 1.8, loopback: bool = True,
                      reply_host: str = "127.0.0.1", curve: CurveKeys | None = None) -> FastAPI:
    """The HTTP app whose lifespan connects ``coordinator`` to ``agents`` (node -> control address) and
    then loads the tasks listed at start. ``loopback``: the server is bound to loopback only (beyond
    it, loading and unloading tasks needs an API key).

    Agents heartbeat every 0.25 s; one silent for ``dead_after_s`` is dead (noticed within 2 s).
    ``reply_host``: where the coordinator binds the socket agents send tokens to (``reply_to``); agents
    on other hosts (or emulated regions, helix.netem) need an address they can reach. ``curve``: the
    coordinator's CURVE keys and the agents' (:func:`helix.keys.coordinator_keys`); None: no CURVE.
    """

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        io = AgentsIO(dict(agents), secret=secret, dead_after_s=dead_after_s, bind_host=reply_host,
                      on_event=coordinator.on_agent_event, on_task_status=coordinator.task_status_threadsafe,
                      curve=curve)  # fmt: skip
        coordinator.attach(io, asyncio.get_running_loop())
        if coordinator.membership is not None:
            coordinator.membership.start()  # the re-planner's worker process
        io.start()
        watcher = asyncio.create_task(coordinator.watch_kv())
        startup = asyncio.create_task(coordinator.load_startup_tasks())
        try:
            yield
        finally:
            watcher.cancel()
            startup.cancel()
            io.close()
            if coordinator.membership is not None:
                coordinator.membership.close()

    return create_app(coordinator, api_keys=api_keys, lifespan=lifespan, task_admin_without_key=loopback)


def check_port_free(host: str, port: int, *, flag: str = "--port") -> None:
    """Refuse, in one line naming the flag, an HTTP port something already listens on — before any
    agent or coordinator starts (uvicorn would find out only after, with a traceback)."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve host {host!r}: {exc.strerror}", field="--host") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(f"{host}:{port} is not available ({exc.strerror}): stop what uses it or choose "
                              f"another {flag}", field=flag) from None  # fmt: skip


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "warning") -> object:
    """A uvicorn server for ``app`` (``await server.serve()``; ``server.should_exit = True`` stops it)."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=3, lifespan="on")
    return uvicorn.Server(config)
