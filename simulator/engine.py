"""The discrete-event engine: one planned cluster in simulated time, its coordinator the server's own core.

Who owns what (the model and its calibration: ``docs/simulator.md``):

* **The coordinator** is :class:`router.core.CoordinatorCore`, the object ``helix serve`` drives:
  admission and its queue, routing (a :class:`router.policy.Router` from
  :mod:`simulator.routing`: IWRR with KV masking, or a baseline's chooser), request ids, the
  decision to send each next STEP, stop conditions. Its clock is the simulated one. The engine
  carries what it schedules (ADMIT, STEP, CANCEL) over the simulated links, and hands it what
  reaches the coordinator (TOKENS and REFUSED from the nodes, every node's KV report each
  ``kv_report_interval_s``) with :meth:`~router.core.CoordinatorCore.update_from_output`. Every
  node joins at time 0 (a WELCOME with its layers and KV capacity); none fails, unless a membership
  trace (:mod:`simulator.membership`) kills, drains and adds nodes and re-plans as the server does.
* **The nodes** (:mod:`simulator.nodes`) run the agents' scheduler and KV account; an
  iteration's cost comes from the profile (:mod:`helix.perf_model`, as the planner prices it).
  When idle, a node starts its next iteration as soon as something arrives, or
  ``gather_window_ms`` later (the agent waits that long for the rest of a burst).
* **The links** (:mod:`simulator.links`): FIFO servers. What one sender sends to one receiver at
  one instant goes as one message (an agent sends a step's activations for one next node
  together, the coordinator a step's messages for one node), or, ``per_request_messages``, one
  message per request, back to back (the paper's simulator), so an idle receiver starts on the
  first and its batch fragments.
* **Shared hosts** (:mod:`simulator.hosts`, ``host_cores``): nodes whose addresses name one host
  share its cores, processor-sharing.
* **The clients** (:mod:`simulator.clients`): who sends requests (online arrivals, the paper's
  offline feeder, or a fixed number in flight) and what is measured.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from helix import wire
from helix.addresses import host_of
from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from router.agent_events import AgentEvent, AgentJoined, KVReported
from router.core import CoordinatorCore
from router.policy import Router
from simulator.clients import Clients
from simulator.hosts import SharedHost
from simulator.links import Links
from simulator.membership import MembershipReplay
from simulator.membership_trace import MembershipTrace
from simulator.nodes import NodeInput, Observe, SimNode, build_nodes
from simulator.pet_migration import TaskBalance
from simulator.results import SimConfig, SimResult, percentiles
from simulator.routing import judge_router, make_router
from simulator.tasks import TaskMix

__all__ = ["SimConfig", "SimResult", "Simulation", "simulate"]

_DONE, _AT_NODE, _AT_COORD, _NEW, _REPORT, _WAKE, _CALL = 0, 1, 2, 3, 4, 5, 6
UNBOUNDED = 2**62  # the core's queue bound in the simulator: it never refuses for a full queue


def _host(address: str | None) -> str | None:
    """The host of a node's address (None without one: such a node is a host of its own)."""
    return host_of(address) if address else None


class Simulation:
    """One run: build from a plan, then :meth:`run`. Deterministic for ``config.seed``."""

    def __init__(self, cluster: ClusterSpec, profiles: ProfileSet, plan: Plan, config: SimConfig,
                 membership: MembershipTrace | None = None) -> None:  # fmt: skip
        config.check()
        self.cfg = config
        self.profiles = profiles
        model = profiles.models[cluster.model]
        self.num_layers = model.num_layers
        self.act_bytes = model.activation_bytes_per_token
        self.tok_bytes = model.token_bytes
        self.coord = cluster.coordinator.id
        self.placement = dict(plan.placement)
        self.tasks = tasks = TaskMix.resolve(config.task_mix, cluster, model, config.seed, config.task_popularity)
        self.nodes: dict[str, SimNode] = {}
        self.retired: dict[str, SimNode] = {}  # nodes that died or left (membership traces), for the results
        base = self.base_router(plan, cluster)
        self.nodes.update(build_nodes(cluster, profiles, plan, config, self.kv_entries(base),
                                      tasks.pet_of if tasks is not None else None))  # fmt: skip
        self.observe: Observe | None = None
        router = self.router_of(base)
        self.core = CoordinatorCore(router, queue_bound=UNBOUNDED, admission_timeout_s=math.inf)
        joined = [AgentJoined(n.id, wire.Welcome(n.id, n.start, n.end, n.kv_tokens, cluster.node(n.id).address or ""))
                  for n in self.nodes.values()]  # fmt: skip
        self.core.update_from_output(joined, 0.0)
        self.links = Links(cluster)
        self.mean_tokens = config.expected_output_tokens + 763.0
        self.max_flow = plan.max_flow_tok_s or 1.0
        self.clients = Clients(config, self.core, plan.placement, self.num_layers, self.mean_tokens, tasks)
        # nodes sharing a host's cores (host_cores): host -> its running iterations (processor sharing)
        self.host_of = {nid: _host(cluster.node(nid).address) or nid for nid in self.nodes}
        self.hosts = {h: SharedHost(config.host_cores or 1) for h in self.host_of.values()}
        self.window = self.clients.window
        self.heap: list[tuple[Any, ...]] = []
        self.seq = 0
        self.now = 0.0
        self.replay = MembershipReplay(self, cluster, plan, membership, joined) if membership is not None else None
        self.balance = TaskBalance.build(self, tasks, model, config)  # tasks placed, moved or skewed

    def base_router(self, plan: Plan, cluster: ClusterSpec) -> Router:
        """IWRR with KV masking over ``plan``'s flows (or the judge's, ``flows="judge"``)."""
        cfg = self.cfg
        if cfg.flows == "judge":
            return judge_router(plan, cluster, self.profiles, watermark=cfg.watermark,
                                expected_output_tokens=cfg.expected_output_tokens)  # fmt: skip
        return Router.from_plan(plan, cluster, self.profiles, watermark=cfg.watermark,
                                expected_output_tokens=cfg.expected_output_tokens)  # fmt: skip

    def router_of(self, base: Router) -> Router:
        """``base`` as the configured router (``SimConfig.router``); Swarm's feedback goes to its new state."""
        initial = {n.id: n.k * n.curves.decode_ms(1) / 1000.0 for n in self.nodes.values()}
        router, swarm = make_router(self.cfg.router, base, seed=self.cfg.seed, swarm_initial_s=initial,
                                    queue_len=lambda n: self.nodes[n].queued() if n in self.nodes else 0)  # fmt: skip
        self.observe = swarm.observe if swarm is not None else None
        return router

    @staticmethod
    def kv_entries(router: Router) -> dict[str, float]:
        return {n: kv.capacity for n, kv in router.kv.nodes.items()}

    # -- membership (simulator.membership) ----------------------------------------------------

    def at(self, t: float, call: Callable[[], None]) -> None:
        """Run ``call`` at simulated time ``t``."""
        self._push(t, _CALL, call)

    def add_node(self, node: SimNode, cluster: ClusterSpec) -> None:
        """``node`` (of ``cluster``, which gives its links) serves from now on."""
        self.nodes[node.id] = node
        self.links.add(cluster)
        self.host_of[node.id] = _host(cluster.node(node.id).address) or node.id
        self.hosts.setdefault(self.host_of[node.id], SharedHost(self.cfg.host_cores or 1))

    def remove_node(self, nid: str) -> None:
        """``nid`` stops: what reaches it is lost, its running iteration never ends."""
        n = self.retired[nid] = self.nodes.pop(nid)
        if n.busy and self.cfg.host_cores is not None:
            self.hosts[self.host_of[nid]].finish(n, self.now, self._schedule_end)

    def kv_bound_inflight(self) -> int:
        """Requests the fullest layer's KV holds at ``feed_hwm`` with the expected length (an
        oracle's fixed concurrency, for sensitivity runs; no real router knows it)."""
        per_layer = [0.0] * self.num_layers
        for n in self.nodes.values():
            for layer in range(n.start, n.end):
                per_layer[layer] += n.kv_tokens
        return max(1, int(self.cfg.feed_hwm * min(per_layer) / self.mean_tokens))

    # -- messages -----------------------------------------------------------------------------

    def _push(self, t: float, kind: int, a: object, b: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def _post(self, src: str, dst: str, items: list[Any], sizes: list[float]) -> None:
        """Send ``items`` (of ``sizes`` bytes) from ``src`` to ``dst``: one message, or one per item
        (``per_request_messages``)."""
        kind = _AT_COORD if dst == self.coord else _AT_NODE
        if self.cfg.per_request_messages and len(items) > 1:
            for item, size in zip(items, sizes, strict=True):
                self._push(self.links.arrival(src, dst, size, self.now), kind, dst, [item])
        else:
            self._push(self.links.arrival(src, dst, sum(sizes), self.now), kind, dst, items)

    def _coordinate(self) -> None:
        """Step the core: send what it schedules, give the clients what it reports; again while they send more."""
        core, tok = self.core, self.tok_bytes
        while True:
            out = core.schedule(self.now)
            by_node: dict[str, list[NodeInput]] = {}
            for node, msg in out.messages:
                by_node.setdefault(node, []).append(msg)  # type: ignore[arg-type]
            for node, msgs in by_node.items():
                sizes = [len(m.prompt) * tok if type(m) is wire.Admit else tok if type(m) is wire.Step else 0.0
                         for m in msgs]  # fmt: skip
                self._post(self.coord, node, msgs, sizes)
            if not self.clients.record(out.outputs, self.now):
                return

    def to_coordinator(self, events: list[AgentEvent]) -> None:
        self.core.update_from_output(events, self.now)
        self._coordinate()

    # -- nodes --------------------------------------------------------------------------------

    def _arrive(self, n: SimNode, items: list[NodeInput], gather: float) -> None:
        refused = n.receive(items, self.now)
        if refused:
            self._post(n.id, self.coord, refused, [0.0] * len(refused))
        if not n.busy and not n.waking:
            if gather > 0:  # an idle agent waits for the rest of a burst (AgentConfig.gather_window_s)
                n.waking = True
                self._push(self.now + gather, _WAKE, n)
            else:
                self._try_start(n)

    def _try_start(self, n: SimNode) -> None:
        if n.busy:
            return
        dur = n.plan()
        if dur is None:
            return
        n.busy = True
        n.iters += 1
        t0, t1 = self.window
        if self.now >= t0:
            n.busy_s += min(dur, max(0.0, t1 - self.now))
        if self.cfg.host_cores is None:
            self._push(self.now + dur, _DONE, n, n.version)
        else:
            self.hosts[self.host_of[n.id]].start(n, dur, self.now, self._schedule_end, n.alone_s)

    def _schedule_end(self, t: float, n: SimNode) -> None:
        self._push(t, _DONE, n, n.version)

    def _node_done(self, n: SimNode) -> None:
        n.busy = False
        if self.cfg.host_cores is not None:
            self.hosts[self.host_of[n.id]].finish(n, self.now, self._schedule_end)
        forwards, tokens = n.complete(self.now, self.observe)
        for dst, hidden in forwards.items():
            self._post(n.id, dst, hidden, [h.tokens * self.act_bytes for h in hidden])
        if tokens:
            if self.cfg.per_request_messages:
                self._post(n.id, self.coord, [wire.Tokens(n.id, (t,)) for t in tokens], [self.tok_bytes] * len(tokens))
            else:
                self._post(n.id, self.coord, [wire.Tokens(n.id, tuple(tokens))], [len(tokens) * self.tok_bytes])
        self._try_start(n)

    def _report_kv(self) -> None:
        """Every node's heartbeat reaches the coordinator (KV in entries, as ``router.driver`` folds them in)."""
        t0, t1 = self.window
        if t0 <= self.now < t1:
            self.clients.inflight_samples.append(self.core.running)
        self.to_coordinator([KVReported(n.id, *n.kv_report()) for n in self.nodes.values()])

    # -- run ----------------------------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        cfg = self.cfg
        end = self.window[1]
        if cfg.mode == "online":
            for spec in self.clients.arrivals(self.max_flow):
                self._push(spec.arrival_s, _NEW, spec)
        else:
            self.clients.start(0.0)
            self._coordinate()
        if cfg.kv_report_interval_s > 0:
            self._push(cfg.kv_report_interval_s, _REPORT, None)
        if self.replay is not None:
            self.replay.start(end)
        if self.balance is not None:
            self.balance.start(end)
        heap, pop, nodes, clients = self.heap, heapq.heappop, self.nodes, self.clients
        events = 0
        drain = cfg.num_requests is not None
        gather = cfg.gather_window_ms / 1000.0
        next_tick = 1.0
        while heap:
            t, _, kind, a, b = pop(heap)
            if t > end and not drain:
                break
            self.now = t
            events += 1
            if kind == _AT_COORD:
                self.to_coordinator(b)
            elif kind == _AT_NODE:
                if a in nodes:  # else it died or left: the message is lost
                    self._arrive(nodes[a], b, gather)
            elif kind == _DONE:
                live = nodes.get(a.id)
                if live is a and live is not None and b == live.version:  # else dead, or superseded (a host's share)
                    self._node_done(live)
            elif kind == _WAKE:
                a.waking = False
                self._try_start(a)
            elif kind == _CALL:
                a()
            elif kind == _NEW:
                clients.send(a, t)
                self._coordinate()
            else:  # _REPORT
                self._report_kv()
                if heap and (drain or t < end):
                    self._push(t + cfg.kv_report_interval_s, _REPORT, None)
            if progress is not None and t >= next_tick:
                progress(t)
                next_tick = t + 1.0
            if drain and clients.done >= (cfg.num_requests or 0):
                break
        return self._result(events)

    def _result(self, events: int) -> SimResult:
        cfg, c = self.cfg, self.clients
        t0, t1 = self.window
        span = max(1e-9, min(t1, self.now) - t0) if cfg.num_requests is None else max(1e-9, self.now - t0)
        kv_est = self.core.router.kv.peak_estimate
        nodes = {**self.retired, **self.nodes}
        return SimResult(
            config=cfg,
            sim_end_s=self.now,
            decode_tok_s=c.decode_tokens / span,
            prompt_tok_s=c.prompt_tokens / span,
            prompt_latency_s=percentiles(c.prompt_lat),
            decode_latency_s=percentiles(c.decode_lat),
            finished_requests=c.finished,
            admitted_requests=c.admitted,
            kv_waits=sum(n.kv_waits for n in nodes.values()),
            max_inflight=cfg.max_inflight,
            node_utilization={n.id: n.busy_s / span for n in nodes.values()},
            kv_peak_fraction={n.id: n.used_peak / n.kv_tokens for n in nodes.values()},
            kv_estimate_peak_fraction={n: kv_est[n] / (nodes[n].kv_tokens * nodes[n].k) for n in nodes if n in kv_est},
            throughput_over_time=[((i + 1) * cfg.bucket_s, x / cfg.bucket_s) for i, x in enumerate(c.buckets)
                                  if (i + 1) * cfg.bucket_s <= min(t1, self.now) + 1e-9],
            events=events,
            membership=self.replay.report(self.now) if self.replay is not None else None,
            tasks=self.balance.report(self.now) if self.balance is not None else None,
            extra={"mean_inflight": float(np.mean(c.inflight_samples)) if c.inflight_samples else math.nan,
                   "failed_requests": float(c.failed),
                   **{f"prompt_latency_from_admission_{k}_s": v for k, v in percentiles(c.prompt_lat_admitted).items()}},
        )


def simulate(cluster: ClusterSpec, profiles: ProfileSet, plan: Plan, config: SimConfig,
             progress: Callable[[float], None] | None = None, membership: MembershipTrace | None = None) -> SimResult:
    return Simulation(cluster, profiles, plan, config, membership).run(progress)
