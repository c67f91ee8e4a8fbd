"""Fabricated inputs for pure-policy tests: the demo placement's router, agents' WELCOMEs and
TOKENS, requests, and a coordinator core with every agent joined.

Only outputs of other parts are fabricated here (what agents would send); the core, router, KV
estimator and stop logic under test are the real ones.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from helix import wire
from helix.domain import FinishReason
from helix.plan import Plan
from helix.spec import load_cluster
from router.agent_events import AgentJoined
from router.core import CoordinatorCore
from router.policy import Router
from router.request import Detokenizer, GenerationRequest, NoText, Request
from router.stops import StopMatcher

REPO = Path(__file__).resolve().parents[1]
DEMO_PLACEMENT = {"cpu-0": (0, 30), "cpu-1": (0, 16), "cpu-2": (16, 30)}
DEMO_FLOWS = {("coordinator", "cpu-0"): 1.0, ("coordinator", "cpu-1"): 1.0, ("cpu-1", "cpu-2"): 1.0,
              ("cpu-0", "coordinator"): 1.0, ("cpu-2", "coordinator"): 1.0}  # fmt: skip


def demo_router(kv_entries: float, *, placement: Mapping[str, tuple[int, int]] = DEMO_PLACEMENT,
                flows: Mapping[tuple[str, str], float] = DEMO_FLOWS) -> Router:
    """The demo cluster's router for ``placement``; every node holds ``kv_entries`` (tokens x layers)."""
    cluster = load_cluster(REPO / "clusters" / "demo" / "cluster.yaml")
    plan = Plan(cluster="demo", model=cluster.model, method="manual", placement=dict(placement), max_flow_tok_s=2.0,
                flows=[{"src": s, "dst": d, "tok_s": f} for (s, d), f in flows.items()])  # type: ignore[misc]
    return Router.from_plan(plan, cluster, None, num_layers=30, kv_capacity=dict.fromkeys(placement, kv_entries),
                            watermark=1.0)  # fmt: skip


def welcome(node: str, layers: tuple[int, int], kv_capacity_tokens: int = 10**9) -> wire.Welcome:
    return wire.Welcome(node, layers[0], layers[1], kv_capacity_tokens, f"tcp://127.0.0.1:1/{node}")


def joined_core(router: Router, **options: object) -> CoordinatorCore:
    """A core over ``router`` whose every planned agent has joined (KV capacities as the router has them)."""
    core = CoordinatorCore(router, **options)  # type: ignore[arg-type]
    placement = router.topology.placement
    caps = {n: router.kv.nodes[n].capacity for n in placement if n in router.kv.nodes}
    core.update_from_output([AgentJoined(n, welcome(n, r, int(caps.get(n, 1e9) // (r[1] - r[0]))))
                             for n, r in placement.items()], now=0.0)  # fmt: skip
    core.schedule(0.0)
    return core


def request(request_id: str, prompt: list[int] | None = None, *, max_tokens: int = 10, stop: tuple[str, ...] = (),
            detok: Detokenizer | None = None, **params: object) -> Request:
    gen = GenerationRequest(prompt_ids=prompt if prompt is not None else list(range(1, 11)), max_tokens=max_tokens,
                            stop=stop, **params)  # type: ignore[arg-type]
    return Request(request_id, gen, arrival_s=time.monotonic(), detok=detok or NoText(), stops=StopMatcher(stop))


def tokens(node: str, wire_id: str, token: int, *, step: int = 0, finished: bool = False,
           reason: str = "") -> wire.Tokens:
    """What a last stage sends for one sampled token."""
    return wire.Tokens(node, (wire.TokenOut(wire_id, step, token, FinishReason(reason) if finished else None),))
