"""Routers the simulator can drive: the real one and the baselines of Helix section 5.7.

* ``iwrr`` — :class:`router.policy.Router` exactly as the coordinator uses it: IWRR over the
  plan's flows with KV high-watermark masking.
* ``random`` — the next hop uniformly among the valid ones (no KV masking).
* ``shortest-queue`` — the valid next hop with the fewest requests queued or running.
* ``swarm`` — Swarm-style: the next hop at random with probability proportional to its
  observed throughput, i.e. to 1 / EMA of the time a request spends there (queue + compute),
  initialised from the node's profiled time per iteration.

All baselines are the same :class:`~router.policy.Router` (same topology, pipelines, KV
bookkeeping) with another chooser and ``mask_kv=False``; none reimplements IWRR or masking.

:func:`judge_router` builds that router over the flows the Helix paper's simulator routes by
(issue 21's judge, ``SimConfig.flows = "judge"``): it ignores the plan's flows, recomputes a
max flow of the placement with networkx's default algorithm (preflow-push) and never uses a
hop that carries under 5 % of its vertex's out-flow. Where a placement has slack, that flow
leaves some parallel nodes with none, and so do we then (docs/notes/judge-mechanisms.md
sections 4 and 5). The judge's graph also has a NIC edge per node, ours only at the
coordinator (never binding on the paper's clusters); which of several equal parallel nodes
gets no flow may differ, the pattern does not.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Container, Mapping

from helix.errors import ConfigError
from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from router.kv import KVEstimator
from router.pipeline import Topology
from router.policy import Router, kv_capacity_from_profiles

ROUTERS = ("iwrr", "random", "shortest-queue", "swarm")
FLOWS = ("plan", "judge")
SWARM_EMA_ALPHA = 0.1


def judge_flows(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet) -> dict[tuple[str, str], float]:
    """The hops the paper's simulator routes over, with their flows (tok/s): a preflow-push max
    flow of ``plan``'s placement (``plan.flows`` ignored), less every hop under
    :data:`planner.flows.JUDGE_MIN_SHARE` of its vertex's out-flow (:func:`planner.flows.judge_flows`, which the
    planner's serving objective scores placements with too)."""
    from planner import flows
    from planner.capacity import CapacityModel

    return flows.judge_flows(CapacityModel.build(cluster, profiles), dict(plan.placement),
                             partial_handoffs=plan.partial_handoffs)  # fmt: skip


def judge_router(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet, *, watermark: float,
                 expected_output_tokens: float) -> Router:
    """:class:`~router.policy.Router` (IWRR, KV masking) over :func:`judge_flows` only: a hop the
    judge drops is gone, not kept as a fallback, so a node without flow stays idle."""
    flows = judge_flows(plan, cluster, profiles)
    topology = Topology(cluster.coordinator.id, profiles.models[cluster.model].num_layers, plan.placement, set(flows),
                        partial_handoffs=plan.partial_handoffs)  # fmt: skip
    kv = KVEstimator(kv_capacity_from_profiles(plan, cluster, profiles), watermark=watermark,
                     expected_output_tokens=expected_output_tokens)  # fmt: skip
    return Router(topology, flows, kv)


class SwarmState:
    """Latency EMA per node, fed by the simulator after every node visit."""

    __slots__ = ("ema_s",)

    def __init__(self, initial_s: Mapping[str, float]) -> None:
        self.ema_s: dict[str, float] = dict(initial_s)

    def observe(self, node: str, seconds: float) -> None:
        old = self.ema_s.get(node, seconds)
        self.ema_s[node] = old + SWARM_EMA_ALPHA * (seconds - old)


def make_router(
    kind: str,
    base: Router,
    *,
    seed: int = 0,
    queue_len: Callable[[str], int] | None = None,
    swarm_initial_s: Mapping[str, float] | None = None,
) -> tuple[Router, SwarmState | None]:
    """Turn a freshly built IWRR router into the requested kind (same topology and KV state)."""
    if kind == "iwrr":
        return base, None
    rng = random.Random(seed)
    succ = base.topology.successors
    swarm: SwarmState | None = None

    if kind == "random":

        def choose(v: str, excluded: Container[str], ok: Callable[[str], bool]) -> str | None:
            cands = [c for c in succ[v] if c not in excluded and ok(c)]
            return rng.choice(cands) if cands else None

    elif kind == "shortest-queue":
        if queue_len is None:
            raise ValueError("shortest-queue needs queue_len")
        ql = queue_len
        coord = base.topology.coordinator

        def choose(v: str, excluded: Container[str], ok: Callable[[str], bool]) -> str | None:
            best, best_q = None, None
            for c in succ[v]:
                if c in excluded or not ok(c):
                    continue
                q = 0 if c == coord else ql(c)
                if best_q is None or q < best_q:
                    best, best_q = c, q
            return best

    elif kind == "swarm":
        swarm = SwarmState(swarm_initial_s or {})
        ema = swarm.ema_s

        def choose(v: str, excluded: Container[str], ok: Callable[[str], bool]) -> str | None:
            cands = [c for c in succ[v] if c not in excluded and ok(c)]
            if not cands:
                return None
            if len(cands) == 1:
                return cands[0]
            weights = [1.0 / max(ema.get(c, 1.0), 1e-6) for c in cands]
            return rng.choices(cands, weights)[0]

    else:
        raise ConfigError(f"unknown router {kind!r} (choose from {', '.join(ROUTERS)})", field="--router")
    router = Router(base.topology, {}, base.kv, mask_kv=False, chooser=choose)
    return router, swarm
