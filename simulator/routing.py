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
"""

from __future__ import annotations

import random
from collections.abc import Callable, Container, Mapping

from helix.errors import ConfigError
from router.policy import Router

ROUTERS = ("iwrr", "random", "shortest-queue", "swarm")
SWARM_EMA_ALPHA = 0.1


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
