"""The discrete-event engine: nodes, links and the coordinator of one planned cluster
(configuration and results in :mod:`simulator.results`, request and node state in
:mod:`simulator.state`).

Model (documented with its calibration in ``docs/simulator.md``):

* **Coordinator.** Admits requests through a router from :mod:`simulator.routing` (the real
  :class:`router.policy.Router` for ``iwrr``), sends every iteration's input to the first
  stage and receives the sampled token from the last; after each token it applies the stop
  condition (the request's output length) and sends the next decode step down the *same*
  pipeline (a node holding the whole model for a request feeds the token to its own next
  iteration instead, as the agent does). Offline mode keeps the cluster saturated like the
  paper's feeder, the same for every router: it starts with ``offline_initial`` requests and,
  whenever a prompt or a
  request finishes, admits one more while the coordinator's KV estimate
  (:class:`router.kv.KVEstimator`, which holds every admitted request's reservation whatever
  chose its next hops) says the fullest layer is at most ``feed_hwm``. Only the next-hop
  choice differs between routers. ``max_inflight`` replaces that feeder by a fixed number of
  requests in flight (a sensitivity setting; the paper ran Swarm at 180). ``flows="judge"``
  routes over the flows the paper's simulator recomputes instead of the plan's
  (:func:`simulator.routing.judge_router`).
* **Nodes.** Iteration-level batching (Orca): when idle, a node takes queued requests FIFO —
  prefills up to ``prompt_max_tokens`` tokens, decodes up to ``decode_max_tokens`` requests —
  and runs one iteration of ``sum over its layers of prefill_ms(prefill tokens on that layer)
  + decode_ms(decode requests on that layer)`` from its profile's per-layer curves (requests
  that entered mid-range run only their layers), plus the profile's optional per-step costs:
  ``step_overhead_ms`` once per iteration on every node, ``head_ms`` on the node holding the
  last layer (absent: 0); priced by :mod:`helix.perf_model`, as the planner prices it (a decode
  below the smallest measured batch costs that batch, ``decode_floor``). As the paper's vLLM
  nodes (issue 21): at most ``prompt_max_tokens // prompt_slot_tokens`` whole prompts per
  iteration, decodes whose contexts sum to at most ``decode_max_tokens x
  decode_context_per_slot``, and the bytes a node received for the batch copied to the GPU
  (``host_copy_gb_per_s``) before it starts. True KV use (entries = tokens x layers) is
  enforced against the node's capacity: a request that would not fit waits, and if nothing
  fits the latest-admitted waiting request is preempted (its KV freed everywhere, re-admitted
  once a request finishes, with its generated tokens re-prefilled), so KV never exceeds capacity.
* **Chunked prefill** (``prefill_chunk_tokens``, off by default): one chunk of the oldest
  prompt per iteration, as ``helix agent`` runs (Sarathi); off, whole prompts are batched.
* **Shared hosts** (``host_cores``, off by default): nodes whose addresses name the same host
  share its ``host_cores`` cores as the OS shares them (processor sharing): an iteration
  starts at once with what its node has, and while ``n`` iterations run on ``c`` cores each
  advances at ``min(1, c / n)`` of its speed (the loopback demo: three agents, two cores).
  A node slowed down this way gathers fewer arrivals per iteration than one that waited for a
  free core, so it runs more, smaller iterations, as the real agents do.
* **Links.** Each directed link is a FIFO server: a message of ``tokens x bytes per token``
  occupies it for ``bytes / bandwidth`` after the previous one, then arrives ``latency_ms``
  later. Activations between nodes, token ids to and from the coordinator. A node's finished
  batch goes on as one message per next hop (an agent gathers a burst before it steps), or,
  ``per_request_messages`` (the paper's simulator, off by default), one message per request,
  back to back, so an idle next node starts on the first and the batch fragments.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Callable

import numpy as np

from helix.addresses import host_of
from helix.errors import ConfigError, NoRouteError
from helix.perf_model import host_copy_s_per_byte, prompts_per_iteration
from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from helix.units import gbps_to_bytes_per_s
from router.policy import Router, RouteRequest
from simulator.hosts import SharedHost
from simulator.results import SimConfig, SimResult, percentiles
from simulator.routing import FLOWS, judge_router, make_router
from simulator.state import SimNode, SimRequest
from simulator.workload import LengthSampler, RequestSpec, arrival_times

__all__ = ["SimConfig", "SimResult", "Simulation", "simulate"]

_NODE_DONE, _ARRIVE, _COORD, _NEW, _REPORT, _WAKE = 0, 1, 2, 3, 4, 5


def _prompt_tokens(r: SimRequest) -> int:
    return r.ctx


def _one_token(r: SimRequest) -> int:
    return 1


def _step_tokens(r: SimRequest) -> int:
    """Tokens of the activations a stage sends on for ``r``: its prompt (and any re-prefill), or one decode."""
    return r.ctx if r.prefill else 1


def _host(address: str | None) -> str | None:
    """The host of a node's address (None without one: such a node is a host of its own)."""
    return host_of(address) if address else None


class Simulation:
    """One run: build from a plan, then :meth:`run`. Deterministic for ``config.seed``."""

    def __init__(self, cluster: ClusterSpec, profiles: ProfileSet, plan: Plan, config: SimConfig) -> None:
        if config.mode not in ("offline", "online"):
            raise ConfigError(f"unknown mode {config.mode!r} (offline or online)", field="--mode")
        if config.flows not in FLOWS:
            raise ConfigError(f"unknown flows {config.flows!r} ({' or '.join(FLOWS)})", field="flows")
        for name in ("host_cores", "prefill_chunk_tokens", "prompt_slot_tokens"):
            value = getattr(config, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1 (or None: off), got {value}", field=name)
        if config.decode_context_per_slot is not None and config.decode_context_per_slot <= 0:
            raise ConfigError(f"decode_context_per_slot must be positive (or None: off), got "
                              f"{config.decode_context_per_slot}", field="decode_context_per_slot")  # fmt: skip
        if any(rate <= 0 for rate in config.host_copy_gb_per_s):
            raise ConfigError(f"host_copy_gb_per_s rates must be positive, got {config.host_copy_gb_per_s}",
                              field="host_copy_gb_per_s")  # fmt: skip
        self.cfg = config
        model = profiles.models[cluster.model]
        self.num_layers = model.num_layers
        self.act_bytes = model.activation_bytes_per_token
        self.tok_bytes = model.token_bytes
        # the paper simulator's host copy: every received byte is copied once at each rate (concat, then to the GPU)
        self.copy_s_per_byte = host_copy_s_per_byte(config.host_copy_gb_per_s)
        self.coord = cluster.coordinator.id
        if config.flows == "judge":
            base = judge_router(plan, cluster, profiles, watermark=config.watermark,
                                expected_output_tokens=config.expected_output_tokens)  # fmt: skip
        else:
            base = Router.from_plan(
                plan, cluster, profiles, watermark=config.watermark, expected_output_tokens=config.expected_output_tokens
            )
        self.placement = dict(plan.placement)
        self.nodes: dict[str, SimNode] = {}
        for nid, (s, e) in plan.placement.items():
            gpu = cluster.node(nid).gpu
            tp = profiles.throughput(gpu, cluster.model)
            curves = tp.curves()
            if curves is not None and not config.decode_floor:
                curves = dataclasses.replace(curves, decode_floor=False)
            if curves is None:
                raise ConfigError(
                    f"GPU {gpu!r} has only a tok_s table for {cluster.model}; the simulator needs its latency curves "
                    f"(prefill_ms_per_layer, decode_ms_per_layer): measure them with `helix profile --cluster "
                    f"{cluster.source}` and list the file it writes last in the cluster's profiles:",
                    source=", ".join(str(path) for path in cluster.profile_paths()),
                    field=f"gpus.{gpu}.throughput.{cluster.model}",
                )
            k = e - s
            pmax = tp.prompt_max_tokens_by_layers[k - 1] if tp.prompt_max_tokens_by_layers else 4096
            dmax = tp.decode_max_tokens_by_layers[k - 1] if tp.decode_max_tokens_by_layers else 256
            cap = base.kv.nodes[nid].capacity if nid in base.kv.nodes else math.inf
            slot, per_slot = config.prompt_slot_tokens, config.decode_context_per_slot
            self.nodes[nid] = SimNode(nid, s, e, cap, curves, pmax, dmax, last=e == self.num_layers,
                                      pcount=prompts_per_iteration(pmax, slot),
                                      dctx=None if per_slot is None else dmax * per_slot)  # fmt: skip
        initial = {n.id: n.k * n.curves.decode_ms(1) / 1000.0 for n in self.nodes.values()}
        self.router, self.swarm = make_router(
            config.router, base, seed=config.seed, queue_len=lambda n: len(self.nodes[n].queue) + len(self.nodes[n].batch),
            swarm_initial_s=initial,
        )
        self.links: dict[tuple[str, str], list[float]] = {
            key: [0.0, gbps_to_bytes_per_s(link.bandwidth_gbps), link.latency_ms / 1000.0]
            for key, link in cluster.resolved_links().items()
        }
        self.lengths = LengthSampler(config.lengths, seed=config.seed)
        self.mean_tokens = config.expected_output_tokens + 763.0
        self.max_flow = plan.max_flow_tok_s or 1.0
        # state
        self.heap: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        self.waiting: deque[SimRequest] = deque()
        self.inflight = 0
        self.next_id = 0
        self.issued = 0
        self.admit_seq = 0
        # metrics
        t0, t1 = config.warmup_s, config.warmup_s + config.duration_s
        self.window = (t0, t1)
        self.decode_tokens = 0
        self.prompt_tokens = 0
        self.prompt_lat: list[float] = []
        self.prompt_lat_admitted: list[float] = []  # from admission, as the paper's simulator counts it
        self.decode_lat: list[float] = []
        self.finished = 0
        self.preemptions = 0
        self.preempted: deque[SimRequest] = deque()  # victims wait here until a finished request frees KV
        # nodes sharing a host's cores (host_cores): host -> its running iterations (processor sharing)
        self.host_of = {nid: _host(cluster.node(nid).address) or nid for nid in self.nodes}
        self.hosts = {h: SharedHost(config.host_cores or 1) for h in self.host_of.values()}
        self.inflight_samples: list[int] = []  # requests in flight at every KV report in the window
        self.buckets = [0] * (int(math.ceil(t1 / config.bucket_s)) + 2)
        self.cap_inflight = config.max_inflight  # None: the KV feeder admits
        self.kv_fed = config.mode == "offline" and config.max_inflight is None

    # -- helpers ------------------------------------------------------------------------------

    def kv_bound_inflight(self) -> int:
        """Requests the fullest layer's KV holds at ``feed_hwm`` with the expected length (an
        oracle's fixed concurrency, for sensitivity runs; no real router knows it)."""
        per_layer = [0.0] * self.num_layers
        for n in self.nodes.values():
            for layer in range(n.start, n.end):
                per_layer[layer] += n.cap / n.k
        return max(1, int(self.cfg.feed_hwm * min(per_layer) / self.mean_tokens))

    def _push(self, t: float, kind: int, a: object, b: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def _send_all(self, src: str, dst: str, reqs: list[SimRequest], tokens_of: Callable[[SimRequest], int],
                  bytes_per_token: float) -> None:
        """Send ``reqs`` from ``src`` to ``dst``: one message (an agent's burst, gathered on arrival), or with
        ``per_request_messages`` one per request, back to back on the link (the paper's simulator)."""
        if self.cfg.per_request_messages:
            for r in reqs:
                self._send(src, dst, tokens_of(r) * bytes_per_token, [r])
        else:
            self._send(src, dst, sum(tokens_of(r) for r in reqs) * bytes_per_token, reqs)

    def _send(self, src: str, dst: str, nbytes: float, payload: list[SimRequest]) -> None:
        link = self.links.get((src, dst))
        if link is None:
            raise ConfigError(f"no link {src} -> {dst} for a planned hop")
        start = self.now if self.now > link[0] else link[0]
        link[0] = start + nbytes / link[1]
        kind = _COORD if dst == self.coord else _ARRIVE
        self._push(link[0] + link[2], kind, dst, payload)

    def _new_request(self, spec: RequestSpec | None = None) -> SimRequest:
        if spec is None:
            p, o = self.lengths.sample()
            spec = RequestSpec(self.now, p, o)
        r = SimRequest(self.next_id, spec.prompt_tokens, spec.output_tokens, spec.arrival_s)
        self.next_id += 1
        self.issued += 1
        return r

    # -- admission ----------------------------------------------------------------------------

    def _offline_backlog(self) -> None:
        if not self.waiting and (self.cfg.num_requests is None or self.issued < self.cfg.num_requests):
            self.waiting.append(self._new_request())

    def _admit(self, budget: int | None = None) -> None:
        cfg = self.cfg
        router = self.router
        offline = cfg.mode == "offline"
        kv_fed = self.kv_fed
        groups: dict[str, list[SimRequest]] = {}
        while True:
            if offline:
                self._offline_backlog()
            if not self.waiting or budget == 0:
                break
            if offline and not kv_fed and self.inflight >= (self.cap_inflight or 0):
                break
            if kv_fed and router.kv.bottleneck_usage(self.placement, self.num_layers) > cfg.feed_hwm:
                break
            r = self.waiting[0]
            try:
                pipeline = router.route(RouteRequest(r.id, r.ctx))
            except NoRouteError:
                break
            self.waiting.popleft()
            r.admitted = self.now
            r.stages = pipeline.stages
            r.stage = 0
            r.prefill = True
            self.admit_seq += 1
            r.seq = self.admit_seq
            self.inflight += 1
            groups.setdefault(r.stages[0].node, []).append(r)
            if budget is not None:
                budget -= 1
        for node, reqs in groups.items():
            self._send_all(self.coord, node, reqs, _prompt_tokens, self.tok_bytes)

    # -- nodes --------------------------------------------------------------------------------

    def _try_start(self, n: SimNode) -> None:
        cores = self.cfg.host_cores
        while n.queue and not n.busy:
            taken = n.take_batch(self.cfg.prefill_chunk_tokens)
            if taken is None:
                self._preempt(n)
                continue
            batch, by_start = taken
            dur = (n.iteration_ms(by_start, len(batch)) + self.cfg.iteration_overhead_ms) / 1000.0
            if self.copy_s_per_byte:
                from_nodes, from_coord = n.received
                dur += (from_nodes * self.act_bytes + from_coord * self.tok_bytes) * self.copy_s_per_byte
            n.busy = True
            n.batch = batch
            n.t_start = self.now
            n.iters += 1
            if self.now >= self.window[0]:
                n.busy_s += min(dur, max(0.0, self.window[1] - self.now))
            if cores is None:
                self._push(self.now + dur, _NODE_DONE, n, n.version)
            else:
                self.hosts[self.host_of[n.id]].start(n, dur, self.now, self._schedule_end)

    def _preempt(self, n: SimNode) -> None:
        """Nothing on ``n`` fits its KV: free the latest-admitted waiting request everywhere."""
        victim = max(n.queue, key=lambda r: r.seq)
        n.queue.remove(victim)
        self._free_kv(victim)
        self.router.finish(victim.id)
        self.inflight -= 1
        self.preemptions += 1
        victim.ctx = victim.prompt + victim.generated
        victim.prefill = True
        victim.pdone = 0
        # re-admitted when a request finishes (and frees KV), not at once: re-admitted now, it would be routed
        # straight back into a full node and preempted again, millions of times under a fixed overload
        self.preempted.append(victim)

    def _free_kv(self, r: SimRequest) -> None:
        for nid, e in r.kv.items():
            node = self.nodes[nid]
            node.kv_used -= e
            if node.kv_used < 1e-6:
                node.kv_used = 0.0
            if node.queue and not node.busy:
                self._push(self.now, _ARRIVE, nid, [])
        r.kv = {}

    def _schedule_end(self, t: float, n: SimNode) -> None:
        self._push(t, _NODE_DONE, n, n.version)

    def _node_done(self, n: SimNode) -> None:
        n.busy = False
        if self.cfg.host_cores is not None:
            self.hosts[self.host_of[n.id]].finish(n, self.now, self._schedule_end)
        batch, n.batch = n.batch, []
        groups: dict[str, list[SimRequest]] = {}
        swarm = self.swarm
        unfinished = [r for r in batch if r.prefill and r.pdone < r.ctx]  # chunked prompts: stay here
        if unfinished:
            n.queue[:0] = unfinished
            batch = [r for r in batch if not (r.prefill and r.pdone < r.ctx)]
        looped: list[SimRequest] = []
        for r in batch:
            r.pdone = 0
            if swarm is not None:
                swarm.observe(n.id, self.now - r.t_enq)
            r.stage += 1
            if len(r.stages) == 1:  # this node holds the whole model for it: the token loops back here
                looped.append(r)
                continue
            dst = self.coord if r.stage == len(r.stages) else r.stages[r.stage].node
            g = groups.get(dst)
            if g is None:
                groups[dst] = [r]
            else:
                g.append(r)
        for dst, reqs in groups.items():
            if dst == self.coord:
                self._send_all(n.id, dst, reqs, _one_token, self.tok_bytes)
            else:
                self._send_all(n.id, dst, reqs, _step_tokens, self.act_bytes)
        if looped:
            self._tokens(looped, loop_back=n)
        self._try_start(n)

    # -- coordinator --------------------------------------------------------------------------

    def _tokens(self, reqs: list[SimRequest], loop_back: SimNode | None = None) -> None:
        """Tokens the coordinator receives: stop condition, metrics, then each unfinished
        request's next decode goes to its first stage — or, ``loop_back``, straight back into the
        queue of the node that holds the whole model for it (the agent feeds its sampled token to
        its own next step; the coordinator only hears of it)."""
        now = self.now
        t0, t1 = self.window
        in_window = t0 <= now < t1
        groups: dict[str, list[SimRequest]] = {}
        triggers = 0
        for r in reqs:
            r.generated += 1
            if r.prefill:
                r.prefill = False
                if r.first_token is None:
                    r.first_token = now
                    if in_window:
                        self.prompt_tokens += r.prompt
                        self.prompt_lat.append(now - r.arrival)
                        self.prompt_lat_admitted.append(now - r.admitted)
                    triggers += 1
            else:
                if in_window:
                    self.decode_tokens += 1
                    self.decode_lat.append(now - r.last_token)
                b = int(now / self.cfg.bucket_s)
                if b < len(self.buckets):
                    self.buckets[b] += 1
            r.last_token = now
            if r.generated >= r.output:
                self._free_kv(r)
                self.router.finish(r.id)
                self.inflight -= 1
                self.finished += 1
                triggers += 1
                while self.preempted:  # KV was freed: the victims go first, oldest at the head
                    self.waiting.appendleft(self.preempted.pop())
                continue
            r.stage = 0
            if loop_back is not None:
                r.t_enq = now
                loop_back.queue.append(r)
                continue
            dst = r.stages[0].node
            g = groups.get(dst)
            if g is None:
                groups[dst] = [r]
            else:
                g.append(r)
        for dst, g in groups.items():
            self._send_all(self.coord, dst, g, _one_token, self.tok_bytes)
        if triggers:
            self._admit(budget=triggers if self.kv_fed else None)

    # -- run ----------------------------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        cfg = self.cfg
        end = self.window[1]
        if cfg.mode == "online":
            if cfg.trace is not None:
                specs = cfg.trace
            else:
                rate = cfg.rate_per_s
                if rate is None:
                    load = 0.75 if cfg.load is None else cfg.load
                    rate = load * self.max_flow / self.mean_tokens
                times = arrival_times(rate, end, cv=cfg.cv, seed=cfg.seed)
                specs = []
                for t in times:
                    p, o = self.lengths.sample()
                    specs.append(RequestSpec(t, p, o))
            if cfg.num_requests is not None:
                specs = specs[: cfg.num_requests]
            for spec in specs:
                self._push(spec.arrival_s, _NEW, spec)
        else:
            self._admit(budget=cfg.offline_initial if self.kv_fed else None)
        if cfg.kv_report_interval_s > 0:
            self._push(cfg.kv_report_interval_s, _REPORT, None)
        heap = self.heap
        pop = heapq.heappop
        nodes = self.nodes
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
            if kind == _COORD:
                self._tokens(b)
            elif kind == _ARRIVE:
                n = nodes[a]
                for r in b:
                    r.t_enq = t
                idle = not n.queue and not n.busy and not n.waking
                n.queue.extend(b)
                if idle and gather > 0:  # an idle agent waits for the rest of a burst (AgentConfig.gather_window_s)
                    n.waking = True
                    self._push(t + gather, _WAKE, n)
                elif not n.busy and not n.waking:
                    self._try_start(n)
            elif kind == _WAKE:
                a.waking = False
                self._try_start(a)
            elif kind == _NODE_DONE:
                if b == a.version:  # else superseded: the host's share changed since it was scheduled
                    self._node_done(a)
            elif kind == _NEW:
                if a is not None:
                    self.waiting.append(self._new_request(a))
                self._admit()
            else:  # _REPORT
                if self.window[0] <= t < self.window[1]:
                    self.inflight_samples.append(self.inflight)
                for n in nodes.values():
                    self.router.report_kv(n.id, used=n.kv_used)
                if heap and (drain or t < end):
                    self._push(t + cfg.kv_report_interval_s, _REPORT, None)
            if progress is not None and t >= next_tick:
                progress(t)
                next_tick = t + 1.0
            if drain and self.finished >= (cfg.num_requests or 0) and not self.waiting:
                break
        return self._result(events)

    def _result(self, events: int) -> SimResult:
        cfg = self.cfg
        t0, t1 = self.window
        span = max(1e-9, min(t1, self.now) - t0) if cfg.num_requests is None else max(1e-9, self.now - t0)
        kv_est = self.router.kv.peak_estimate
        return SimResult(
            config=cfg,
            sim_end_s=self.now,
            decode_tok_s=self.decode_tokens / span,
            prompt_tok_s=self.prompt_tokens / span,
            prompt_latency_s=percentiles(self.prompt_lat),
            decode_latency_s=percentiles(self.decode_lat),
            finished_requests=self.finished,
            admitted_requests=self.admit_seq,
            preemptions=self.preemptions,
            max_inflight=self.cap_inflight,
            node_utilization={n.id: n.busy_s / span for n in self.nodes.values()},
            kv_peak_fraction={n.id: n.kv_peak / n.cap for n in self.nodes.values()},
            kv_estimate_peak_fraction={n: kv_est[n] / self.nodes[n].cap for n in self.nodes if n in kv_est},
            throughput_over_time=[((i + 1) * cfg.bucket_s, c / cfg.bucket_s) for i, c in enumerate(self.buckets)
                                  if (i + 1) * cfg.bucket_s <= min(t1, self.now) + 1e-9],
            events=events,
            extra={"mean_inflight": float(np.mean(self.inflight_samples)) if self.inflight_samples else math.nan,
                   **{f"prompt_latency_from_admission_{k}_s": v
                      for k, v in percentiles(self.prompt_lat_admitted).items()}},
        )


def simulate(cluster: ClusterSpec, profiles: ProfileSet, plan: Plan, config: SimConfig,
             progress: Callable[[float], None] | None = None) -> SimResult:
    return Simulation(cluster, profiles, plan, config).run(progress)
