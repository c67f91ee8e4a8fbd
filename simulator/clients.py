"""The simulated clients: which requests reach the coordinator core, when, and what they measure.

Every request is a :class:`router.request.Request` handed to
:meth:`router.core.CoordinatorCore.add_request`, as the HTTP layer hands them: its prompt of
the sampled length, ``max_tokens`` its sampled output length (the simulated model never samples
a stop token, so every request ends at ``max_tokens``), no stop strings and no text
(:class:`router.request.NoText`), and, with a task mix (:mod:`simulator.tasks`), a task drawn
from it. The core queues a request while every route is masked; in the simulator its queue has
no bound and no deadline (the simulator measures what waiting costs instead of refusing with 429).

* **Online**: each request of the arrival process (Poisson or Gamma, :mod:`simulator.workload`)
  or of the trace is sent when it arrives.
* **Offline, the paper's feeder** (default): 20 requests (``offline_initial``) at the start, then
  one more each time a prompt or a request completes, while the coordinator's KV estimate
  (:meth:`router.kv.KVEstimator.bottleneck_usage`) says the fullest layer is at most ``feed_hwm``
  and no request waits in the core's queue. No real client reads the coordinator's estimate: this
  is the paper's benchmark harness (its artifact's ``OfflineRequestFeeder``), kept because it
  admits alike for every router, so that only the next-hop choice differs between them.
* **Offline, ``max_inflight`` N**: N clients in a closed loop, each sending its next request when
  its last one ends (the paper's protocol for the routers that cannot refuse a request).

While no route is left (a membership trace, :mod:`simulator.membership`), the offline clients send
nothing, and they start again as at the start once the core has a route (:meth:`Clients.resume`);
online requests arriving meanwhile are refused, as the server refuses them (503).

What is measured (inside the window ``[warmup_s, warmup_s + duration_s)``): prompt latency
(arrival to first token, and admission to first token as the paper's simulator counts it),
decode latency (time between a request's consecutive tokens), prompt tokens of the requests
whose first token came in the window and every later token as a decode token. The clients keep
only these timings per request (:class:`Timing`); everything else about a request is the core's
:class:`~router.request.Request` and, on each node, the scheduler's ``SequenceState``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from helix.errors import HelixError
from router.core import CoordinatorCore
from router.request import GenerationRequest, NoText, Request, RequestOutput
from router.stops import StopMatcher
from simulator.nodes import TOKEN
from simulator.results import SimConfig
from simulator.tasks import TaskMix
from simulator.workload import LengthSampler, RequestSpec, arrival_times


class Timing:
    """When one request arrived, left the core's queue and got its latest token (-1: none yet)."""

    __slots__ = ("arrival", "admitted", "last", "prompt")

    def __init__(self, arrival: float, prompt: int) -> None:
        self.arrival, self.admitted, self.last, self.prompt = arrival, arrival, -1.0, prompt


class Clients:
    """The workload's side of one run (see the module doc)."""

    def __init__(self, config: SimConfig, core: CoordinatorCore, placement: Mapping[str, tuple[int, int]],
                 num_layers: int, mean_tokens: float, tasks: TaskMix | None = None) -> None:  # fmt: skip
        self.cfg, self.core, self.tasks = config, core, tasks
        self.placement, self.num_layers, self.mean_tokens = dict(placement), num_layers, mean_tokens
        self.lengths = LengthSampler(config.lengths, seed=config.seed)
        self.window = (config.warmup_s, config.warmup_s + config.duration_s)
        self.timing: dict[str, Timing] = {}
        self.issued = self.admitted = self.finished = self.failed = 0
        self.refused = 0  # of the failed: refused by the core when sent (no route, or it could never fit)
        self.decode_tokens = self.prompt_tokens = 0
        self.prompt_lat: list[float] = []
        self.prompt_lat_admitted: list[float] = []
        self.decode_lat: list[float] = []
        self.inflight_samples: list[int] = []  # requests on pipelines at every KV report in the window
        self.buckets = [0] * (int(math.ceil(self.window[1] / config.bucket_s)) + 2)

    @property
    def done(self) -> int:
        """Requests that will produce nothing more (finished, failed or refused)."""
        return self.finished + self.failed

    def arrivals(self, max_flow_tok_s: float) -> list[RequestSpec]:
        """Online: every request of the trace, or of the arrival process up to the window's end."""
        cfg = self.cfg
        if cfg.trace is not None:
            specs = list(cfg.trace)
        else:
            rate = cfg.rate_per_s
            if rate is None:
                rate = (0.75 if cfg.load is None else cfg.load) * max_flow_tok_s / self.mean_tokens
            specs = [RequestSpec(t, *self.lengths.sample()) for t in arrival_times(rate, self.window[1], cv=cfg.cv,
                                                                                    seed=cfg.seed)]  # fmt: skip
        return specs if cfg.num_requests is None else specs[: cfg.num_requests]

    def start(self, now: float) -> None:
        """Offline: the first requests."""
        self._feed(self.cfg.offline_initial, now)

    def send(self, spec: RequestSpec, now: float) -> bool:
        """Hand one request to the core; False when the core refused it (it could never be served: counted
        as failed)."""
        rid = str(self.issued)
        self.issued += 1
        params = GenerationRequest(prompt_ids=[TOKEN] * spec.prompt_tokens, max_tokens=spec.output_tokens,
                                   task=self.tasks.draw(now) if self.tasks is not None else "")
        self.timing[rid] = Timing(spec.arrival_s, spec.prompt_tokens)
        try:
            self.core.add_request(Request(rid, params, spec.arrival_s, NoText(), StopMatcher(())), now)
        except HelixError:
            del self.timing[rid]
            self.failed += 1
            self.refused += 1
            return False
        return True

    def record(self, outputs: Iterable[RequestOutput], now: float) -> bool:
        """Measure what the core reported; offline, send more as the feeder says. True when it sent any."""
        t0, t1 = self.window
        in_window = t0 <= now < t1
        completed = 0  # prompts and requests (the feeder's triggers)
        for out in outputs:
            t = self.timing.get(out.request_id)
            if t is None:
                continue
            if out.started:
                t.admitted = now
                self.admitted += 1
            if out.token_ids:
                if t.last < 0:  # its first token: the prompt is done
                    completed += 1
                    if in_window:
                        self.prompt_tokens += t.prompt
                        self.prompt_lat.append(now - t.arrival)
                        self.prompt_lat_admitted.append(now - t.admitted)
                else:
                    if in_window:
                        self.decode_tokens += 1
                        self.decode_lat.append(now - t.last)
                    b = int(now / self.cfg.bucket_s)
                    if b < len(self.buckets):
                        self.buckets[b] += 1
                t.last = now
            if out.finished:
                del self.timing[out.request_id]
                completed += 1
                if out.finish is not None:
                    self.finished += 1
                else:
                    self.failed += 1
        return self._feed(completed, now) if self.cfg.mode == "offline" else False

    def resume(self, now: float) -> bool:
        """Offline: the cluster has a route again after it had none (a membership trace): feed as at the start."""
        return self._feed(self.cfg.offline_initial, now) if self.cfg.mode == "offline" else False

    def _can_send(self) -> bool:
        return self.cfg.num_requests is None or self.issued < self.cfg.num_requests

    def _feed(self, budget: int, now: float) -> bool:
        core, sent = self.core, False
        if not core.ready:  # no route (a membership trace): wait for one (resume) rather than be refused
            return False
        fixed = self.cfg.max_inflight
        if fixed is not None:  # closed loop: a new request for every one that ended
            while self._can_send() and len(core.requests) < fixed:
                if not self.send(RequestSpec(now, *self.lengths.sample()), now):
                    break
                sent = True
            return sent
        kv = core.router.kv
        while budget > 0 and self._can_send() and not core.waiting \
                and kv.bottleneck_usage(self.placement, self.num_layers) <= self.cfg.feed_hwm:  # fmt: skip
            self.send(RequestSpec(now, *self.lengths.sample()), now)
            budget -= 1
            sent = True
        return sent
