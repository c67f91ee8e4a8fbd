"""Prometheus metrics of the coordinator (one registry per coordinator, so tests can run several).

Counters and histograms are updated as requests run (every HTTP response by route and status
code, 4xx included, is counted by the app's outermost middleware); gauges that mirror state
(per-node KV use, queue lengths, liveness, per-edge planned vs observed flow) are refreshed by
:meth:`ServingMetrics.refresh` just before ``/metrics`` renders. Observed flow is the tokens
that crossed each edge of the cluster graph (prompt tokens at prefill, one per decode step)
over a sliding window.

Per-node engine steps (wall time, requests and tokens per step) are histograms the agents count
themselves, in the buckets the wire fixes, and send cumulatively in their heartbeats
(:class:`helix.wire.StepStats`); :class:`NodeStepCollector` exposes each node's latest counts
(a restarted agent starts from zero, which Prometheus reads as a counter reset).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from helix.wire import STEP_STATS_BOUNDS, StepStats
from router.agent_events import KVReport
from router.request import Request

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
FLOW_WINDOW_S = 10.0


class EdgeFlow:
    """Tokens per edge over the last ``window_s`` seconds (a deque of (time, edge, tokens))."""

    __slots__ = ("window_s", "_events", "_sums")

    def __init__(self, window_s: float = FLOW_WINDOW_S) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, tuple[str, str], int]] = deque()
        self._sums: dict[tuple[str, str], int] = {}

    def add(self, edges: Iterable[tuple[str, str]], tokens: int, now: float | None = None) -> None:
        t = time.monotonic() if now is None else now
        for edge in edges:
            self._events.append((t, edge, tokens))
            self._sums[edge] = self._sums.get(edge, 0) + tokens

    def rates(self, now: float | None = None) -> dict[tuple[str, str], float]:
        t = time.monotonic() if now is None else now
        while self._events and self._events[0][0] < t - self.window_s:
            _, edge, tokens = self._events.popleft()
            self._sums[edge] -= tokens
        return {edge: total / self.window_s for edge, total in self._sums.items()}


NODE_STEP_HISTOGRAMS = {  # StepStats field -> (metric name, help)
    "seconds": ("helix_node_step_seconds", "Wall time of each engine step that ran something, per node"),
    "sequences": ("helix_node_batch_sequences", "Requests batched in one engine step, per node"),
    "tokens": ("helix_node_batch_tokens", "Tokens (prefill chunks and decodes) in one engine step, per node"),
}


class NodeStepCollector(Collector):
    """The agents' step histograms (``helix_node_step_seconds``, ``helix_node_batch_sequences``,
    ``helix_node_batch_tokens``), labelled by node, from the latest counts each agent reported."""

    def __init__(self) -> None:
        self.latest: dict[str, StepStats] = {}

    def describe(self) -> Iterator[HistogramMetricFamily]:
        for name, doc in NODE_STEP_HISTOGRAMS.values():
            yield HistogramMetricFamily(name, doc, labels=["node"])

    def collect(self) -> Iterator[HistogramMetricFamily]:
        for field, (name, doc) in NODE_STEP_HISTOGRAMS.items():
            family = HistogramMetricFamily(name, doc, labels=["node"])
            bounds = STEP_STATS_BOUNDS[field]
            for node, stats in sorted(self.latest.items()):
                dist = getattr(stats, field)
                cumulative, buckets = 0, []
                for bound, count in zip((*bounds, float("inf")), dist.counts, strict=True):
                    cumulative += count
                    buckets.append((floatToGoString(bound), cumulative))
                family.add_metric([node], buckets, dist.total)
            yield family


class ServingMetrics:
    """Every metric ``/metrics`` exposes."""

    def __init__(self, planned_flows: Mapping[tuple[str, str], float], base_label: str = "") -> None:
        self.base_label = base_label  # the base model's name: the task label of requests without a task
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("helix_requests", "HTTP generation requests by endpoint and outcome",
                                ["endpoint", "status"], registry=r)
        self.http_responses = Counter("helix_http_responses", "HTTP responses by route (the path of a known route, "
                                      "else 'other') and status code", ["route", "code"], registry=r)
        self._response_counters: dict[tuple[str, int], Any] = {}
        self.prompt_tokens = Counter("helix_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generated_tokens = Counter("helix_generated_tokens", "Tokens generated and returned", registry=r)
        self.task_requests = Counter("helix_task_requests", "Generation requests admitted, by task (a fine-tuned "
                                     "task's name, or the base model's)", ["task"], registry=r)
        self.task_tokens = Counter("helix_task_tokens", "Tokens by task (a fine-tuned task's name, or the base "
                                   "model's) and kind (prompt, generated)", ["task", "kind"], registry=r)
        self._task_counters: dict[tuple[str, str], Any] = {}
        self.ttft = Histogram("helix_time_to_first_token_seconds", "Time from arrival to first token",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("helix_time_per_output_token_seconds", "Time between output tokens of a request",
                              buckets=TPOT_BUCKETS_S, registry=r)
        self.latency = Histogram("helix_request_duration_seconds", "Time from arrival to the last token",
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        self.reroutes = Counter("helix_reroutes", "In-flight requests moved to a new pipeline after a node died",
                                registry=r)
        self.rejected = Counter("helix_rejected_requests", "Requests refused at admission", ["reason"], registry=r)
        self.running = Gauge("helix_running_requests", "Requests generating now", registry=r)
        self.waiting = Gauge("helix_waiting_requests", "Requests waiting for a route (all masked)", registry=r)
        self.ready = Gauge("helix_ready", "1 while at least one complete pipeline exists", registry=r)
        self.node_alive = Gauge("helix_node_alive", "1 while the node's agent answers heartbeats", ["node"], registry=r)
        self.kv_usage = Gauge("helix_node_kv_usage_ratio", "Estimated KV use / capacity per node", ["node"], registry=r)
        self.kv_reported = Gauge("helix_node_kv_tokens", "KV tokens the agent reported, by kind (used, reserved, "
                                 "capacity)", ["node", "kind"], registry=r)
        self.node_queue = Gauge("helix_node_queue_requests", "Requests waiting in the node agent's scheduler "
                                "(not yet admitted to its batch)", ["node"], registry=r)
        self.node_running = Gauge("helix_node_running_requests", "Requests admitted to the node agent's batch",
                                  ["node"], registry=r)
        self.node_steps = NodeStepCollector()
        r.register(self.node_steps)
        self.flow_planned = Gauge("helix_edge_planned_flow_tok_s", "The plan's max-flow value on each edge",
                                  ["src", "dst"], registry=r)
        self.flow_observed = Gauge("helix_edge_observed_flow_tok_s", f"Tokens/s that crossed each edge over the "
                                   f"last {FLOW_WINDOW_S:.0f} s", ["src", "dst"], registry=r)
        self.edge_tokens = Counter("helix_edge_tokens", "Tokens that crossed each edge", ["src", "dst"], registry=r)
        self._edge_counters: dict[tuple[str, str], Any] = {}  # labels() looked up once per edge, not per token
        self.plan_version = Gauge("helix_plan_version", "Version of the plan the coordinator routes by (0: the one "
                                  "it started with; each re-plan routed takes a higher one)", registry=r)
        self.members = Gauge("helix_cluster_members", "Member nodes by state (joining, serving, standby, leaving, "
                             "dead)", ["state"], registry=r)
        self.flow = EdgeFlow()
        self._planned: set[tuple[str, str]] = set()
        self._nodes_shown: set[str] = set()
        self.set_planned_flows(planned_flows)

    def set_planned_flows(self, planned_flows: Mapping[tuple[str, str], float]) -> None:
        """The routed plan's flow per edge (a re-plan's replaces the old; edges it lacks are dropped)."""
        for edge in self._planned - set(planned_flows):
            self.flow_planned.remove(*edge)
        for (src, dst), tok_s in planned_flows.items():
            self.flow_planned.labels(src, dst).set(tok_s)
            self.flow_observed.labels(src, dst).set(0.0)
        self._planned = set(planned_flows)

    def membership(self, version: int, members: Mapping[str, int]) -> None:
        """The plan version and the member nodes by state (live membership)."""
        self.plan_version.set(version)
        for state, count in members.items():
            self.members.labels(state).set(count)

    def tokens_moved(self, edges: Sequence[tuple[str, str]], tokens: int) -> None:
        self.flow.add(edges, tokens)
        counters = self._edge_counters
        for edge in edges:
            counter = counters.get(edge)
            if counter is None:
                counter = counters[edge] = self.edge_tokens.labels(*edge)
            counter.inc(tokens)

    def task_tokens_add(self, task: str, kind: str, tokens: int) -> None:
        """Count ``tokens`` of ``kind`` (prompt, generated) for ``task`` (labels looked up once per pair)."""
        counter = self._task_counters.get((task, kind))
        if counter is None:
            counter = self._task_counters[task, kind] = self.task_tokens.labels(task, kind)
        counter.inc(tokens)

    def response(self, route: str, code: int) -> None:
        """Count one HTTP response (``route``: a bounded set of names, never a raw client path)."""
        counter = self._response_counters.get((route, code))
        if counter is None:
            counter = self._response_counters[route, code] = self.http_responses.labels(route, str(code))
        counter.inc()

    def refresh(self, *, ready: bool, alive: Mapping[str, bool], kv_usage: Mapping[str, float],
                reports: Mapping[str, KVReport], waiting: int, running: int) -> None:
        """Mirror the state into the gauges; ``reports``: each live agent's latest heartbeat."""
        self.ready.set(1.0 if ready else 0.0)
        self.waiting.set(waiting)
        self.running.set(running)
        shown = set(alive) | set(kv_usage) | set(reports)
        self._forget_nodes(self._nodes_shown - shown)  # no stale node after it left the cluster
        self._nodes_shown = shown
        for node, up in alive.items():
            self.node_alive.labels(node).set(1.0 if up else 0.0)
        for node, ratio in kv_usage.items():
            self.kv_usage.labels(node).set(ratio)
        for node, report in reports.items():
            for kind, value in (("used", report.used_tokens), ("reserved", report.reserved_tokens),
                                ("capacity", report.capacity_tokens)):
                self.kv_reported.labels(node, kind).set(value)
            self.node_queue.labels(node).set(report.waiting)
            self.node_running.labels(node).set(report.running)
            self.node_steps.latest[node] = report.steps
        for (src, dst), rate in self.flow.rates().items():
            self.flow_observed.labels(src, dst).set(rate)

    def _forget_nodes(self, nodes: Iterable[str]) -> None:
        for node in nodes:
            for gauge in (self.node_alive, self.kv_usage, self.node_queue, self.node_running):
                with contextlib.suppress(KeyError):
                    gauge.remove(node)
            for kind in ("used", "reserved", "capacity"):
                with contextlib.suppress(KeyError):
                    self.kv_reported.remove(node, kind)
            self.node_steps.latest.pop(node, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsObserver:
    """What the coordinator core reports (:class:`router.core_interfaces.CoreObserver`), counted in
    ``metrics``."""

    __slots__ = ("metrics",)

    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics

    def admitted(self, task: str, prompt_tokens: int) -> None:
        m = self.metrics
        m.prompt_tokens.inc(prompt_tokens)
        m.task_requests.labels(task).inc()
        m.task_tokens_add(task, "prompt", prompt_tokens)

    def rejected(self, reason: str) -> None:
        self.metrics.rejected.labels(reason).inc()

    def token(self, request: Request, edges: tuple[tuple[str, str], ...], moved: int, now: float) -> None:
        m = self.metrics
        m.tokens_moved(edges, moved)
        if request.output_ids:
            m.tpot.observe(now - request.last_token_s)
        else:
            m.ttft.observe(now - request.arrival_s)
        m.generated_tokens.inc()
        m.task_tokens_add(request.params.task or m.base_label, "generated", 1)

    def rerouted(self) -> None:
        self.metrics.reroutes.inc()

    def finished(self, request: Request, now: float) -> None:
        self.metrics.latency.observe(now - request.arrival_s)
