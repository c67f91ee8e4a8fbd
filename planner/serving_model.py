"""The serving objective: an estimate of the decode tokens/s a placement really delivers.

Max flow counts prompt and decode tokens alike and ignores that every hop adds latency to
every generated token and that a request's KV must fit on every node it passes. This model
keeps both (Little's law on each request path), for a workload of ``P`` prompt and ``D``
output tokens per request (Azure conversation trace means: 763 / 232):

* Paths p: a decomposition of the max flow into source->sink paths, plus, for every node,
  the shortest (lowest per-token latency) path through it. On p, node i runs ``l_ip`` layers
  (fewer than it holds after a partial hand-off).
* Per-token round trip  W_p = sum_i v_i + sum of link latencies on p (coordinator -> first,
  hops, last -> coordinator) + each hop's message (its batch's decodes and riding prompt
  tokens) over the link's bandwidth. The node's step t_i(b) prices the steady state's
  iteration as the simulator does (:mod:`helix.perf_model`): b decodes at the workload's mean
  context and b / D whole prompts riding along (the prefill curve at P each), split into
  several steps above the decode limits (requests; contexts summed <= decode_max x 1000) and
  with prompts beyond ``prompt_max_tokens // 2048`` per iteration (A100 3, L4 and T4 1) in
  prompt-only iterations, plus the host copy of what the node received (activations, or
  token ids on a first stage, at 4 then 5 GB/s) and the profile's optional per-step, head,
  context and per-task costs (the tasks a batch touches on average, each request on one of
  the workload's task mix: :func:`helix.perf_model.expected_tasks`). The visit
  v_i = t_i + ``wait_share`` x E[T^2] / 2 E[T]: a decode waits for part of the lumpy
  iteration in progress (prompts come whole, Poisson, of the workload's length spread).
  Without latency curves: t_i = b / T_i(k_i).
  Amortised prefill adds  pre_p / D  with pre_p = sum_i (l_ip * prefill_ms_i(P) + its host
  copy) + latencies.
* The batch b_i a node sees: requests move in convoys that forks split
  (``convoys_per_width`` per unit of the flows' widest fork), a node taking its share of
  each; at least what arrives while the node runs ``busy_max`` of the time. Found by a short
  fixed-point iteration with the LP below.
* Variables n_p = requests in flight on p; each yields y_p = n_p / tau_p decode tokens/s,
  tau_p = W_p + pre_p / D. The LP (HiGHS)

      maximize   sum_p y_p
      compute:   sum_{p through i} y_p (P + D) / D <= T_i(k_i)          (capacity model)
                 sum_{p through i} y_p * busy seconds per decode <= 1  (the step times)
      links:     sum_{p over e} y_p (P + D) / D <= capacity_e
      KV:        sum_{p through i} n_p (P + D) l_ip <= 0.85 * KV_i(k_i)   (the router's mask)
                 per layer, summed over its holders (each node's KV spread over its layers)
                 <= 0.8 * their KV                                       (the feeder's watermark)

  (KV reserved up front for the whole request, DESIGN.md) gives the estimate. It is
  min(max flow * D/(P+D), requests that fit in KV / round trip) generalised to many paths:
  deep pipelines pay in W_p, thinly spread layers pay in KV. The convoy count and the wait
  share are fitted to the simulator on single24's placements (docs/planner-optimizer.md
  section 6, with how far off the estimate is).

Here: the per-node timing and the fixed point; the paths in ``planner.serving_paths``, the LP in
``planner.serving_lp``, the workload (P, D and the mechanisms' settings) in ``planner.serving_workload``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from helix.domain import Placement
from helix.perf_model import TaskGroup, expected_tasks, host_copy_s_per_byte, prompts_per_iteration
from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.serving_lp import binding, kv_fill, requests_lp
from planner.serving_paths import Routes, decompose, fastest_paths
from planner.serving_workload import Workload

MAX_PREFILL_BUSY = 0.9
FIRST_LP_MIN_S = 0.5  # the first round's LP may run this long past a deadline (it takes ms)


@dataclass(slots=True)
class ServingEstimate:
    decode_tok_s: float
    max_flow_tok_s: float
    requests_in_flight: float
    mean_round_trip_ms: float
    mean_hops: float
    binding: str  # "compute" | "kv" | "links" | "none"
    path_flows: list[tuple[list[str], float]] = field(default_factory=list)  # (nodes, decode tok/s)


class ServingModel:
    """Scores placements of one planning problem for one workload (caches prefill times per kind)."""

    def __init__(self, cap: CapacityModel, workload: Workload | None = None) -> None:
        self.cap = cap
        self.w = workload or Workload()
        self._prefill: dict[tuple[str, int, bool], float] = {}
        self._copy_s_per_byte = host_copy_s_per_byte(self.w.host_copy_gb_per_s)
        self.task_mix = cap.task_mix if self.w.task_mix is None else self.w.task_mix

    # per-node timing ----------------------------------------------------------------

    def decode_s(self, node: str, layers_run: int, batch: float, last: bool = False) -> float:
        """Seconds of one decode step of ``batch`` requests over ``layers_run`` layers; ``last``:
        the node holds the model's last layer (pays the profile's ``head_ms``). The steady
        state's iteration (:mod:`helix.perf_model`): each request at the workload's mean context
        and, with mixed batches, the workload's share of prompt tokens riding along; a batch
        above the node's decode limit (requests, or their contexts summed) takes several steps,
        and prompt tokens beyond what one iteration may carry (whole prompts, tokens) run in
        prompt-only iterations of their own."""
        g = self.cap.kind(node)
        w = self.w
        batch = max(1.0, batch)
        if g.curves is None:
            return batch / g.tok_s[layers_run - 1]
        limit = float(g.decode_max_batch[layers_run - 1]) if g.decode_max_batch else batch
        mean_context = w.prompt_tokens + w.output_tokens / 2
        if g.decode_max_batch and w.decode_context_per_slot is not None and mean_context > 0:
            limit = min(limit, max(1.0, g.decode_max_batch[layers_run - 1] * w.decode_context_per_slot / mean_context))
        steps = math.ceil(batch / limit - 1e-9)
        per_step = batch / steps
        # in steady state every iteration also carries prompt tokens in the workload's ratio
        riding = per_step * w.prompt_tokens / w.output_tokens if w.mixed_batches else 0.0
        ride_max = self.prompt_tokens_per_iteration(node, layers_run)
        overflow = 0.0
        if riding > ride_max:
            overflow, riding = steps * (riding - ride_max), ride_max
        context = per_step * mean_context
        # riding prompt tokens are whole prompts of the workload's mean length, each priced as the simulator
        # prices a prompt (the prefill curve at its length), riding / P of them per step
        prompt_ms = layers_run * g.curves.prefill.at(w.prompt_tokens) / w.prompt_tokens if w.prompt_tokens > 0 else 0.0
        # (a zero-layer span carrying the riding tokens: the per-step cost is by all the batch's tokens)
        spans = ((layers_run, 0.0, per_step, context), (0, riding, per_step, context))
        tasks = self.tasks(per_step + riding / max(w.prompt_tokens, 1.0), per_step + riding)
        ms = steps * (g.curves.iteration_ms(spans, sampled=per_step, head_share=float(last), tasks=tasks)
                      + riding * prompt_ms)  # fmt: skip
        if overflow:
            ms += overflow / ride_max * g.curves.iteration_ms(((layers_run, ride_max, 0.0, 0.0),), sampled=1.0,
                                                              head_share=float(last),
                                                              tasks=self.tasks(ride_max / max(w.prompt_tokens, 1.0),
                                                                               ride_max))  # fmt: skip
        return ms / 1000.0

    def tasks(self, requests: float, rows: float) -> tuple[list[TaskGroup], ...]:
        """The fine-tuned tasks a step of ``requests`` (``rows`` in all) touches on average, as the
        one span's tasks of :meth:`helix.perf_model.NodeCurves.iteration_ms`; () without a task mix."""
        return (expected_tasks(self.task_mix, requests, rows),) if self.task_mix else ()

    def step_s(self, node: str, layers_run: int, batch: float, last: bool, first: bool, alone: bool) -> float:
        """:meth:`decode_s` plus the host copy of what the node received for it: every decode's
        token (not on a node that holds the whole model for its requests, ``alone``: it feeds
        its token back to itself) and the prompt tokens riding along; ``first``: the node is
        its path's first (it receives token ids)."""
        w = self.w
        batch = max(1.0, batch)
        riding = batch * w.prompt_tokens / w.output_tokens if w.mixed_batches else 0.0
        return self.decode_s(node, layers_run, batch, last) + self.copy_s((0.0 if alone else batch) + riding, first=first)

    def visit_s(self, node: str, layers_run: int, batch: float, last: bool, first: bool, alone: bool) -> float:
        """A decode's time at a node: the iteration it rides (:meth:`step_s`) plus
        ``Workload.wait_share`` of the residual of the iteration in progress when it arrives,
        ``E[T^2] / 2 E[T]``: prompts make iterations lumpy (on average ``batch / D`` of them per
        iteration, Poisson, of the workload's length spread ``prompt_cv``)."""
        w = self.w
        batch = max(1.0, batch)
        et = self.step_s(node, layers_run, batch, last, first, alone)
        ep = self.prefill_s(node, layers_run, last) + self.copy_s(w.prompt_tokens, first=first)
        m = batch / w.output_tokens if w.mixed_batches else 0.0
        d0 = max(et - m * ep, 0.0)
        et2 = d0 * d0 + 2 * d0 * m * ep + m * ep * ep * (1 + w.prompt_cv**2) + m * m * ep * ep
        return et + w.wait_share * et2 / (2 * et) if et > 0 else 0.0

    def prompt_tokens_per_iteration(self, node: str, layers_run: int) -> float:
        """Prompt tokens one iteration of ``node`` carries at most in steady state: whole prompts
        of the workload's mean length (:func:`helix.perf_model.prompts_per_iteration`), within
        the profile's ``prompt_max_tokens`` (4096 when absent, as in the simulator); never less
        than one prompt."""
        g = self.cap.kind(node)
        pmax = float(g.prompt_max_tokens[layers_run - 1]) if g.prompt_max_tokens else 4096.0
        count = prompts_per_iteration(pmax, self.w.prompt_slot_tokens)
        tokens = pmax if count is None else min(pmax, count * self.w.prompt_tokens)
        return max(tokens, self.w.prompt_tokens, 1.0)

    def copy_s(self, tokens: float, *, first: bool) -> float:
        """Seconds a node spends copying ``tokens`` it received to the GPU before an iteration
        (``Workload.host_copy_gb_per_s``): activations from another node, or token ids when
        ``first`` (a node holding layer 0 receives ids from the coordinator)."""
        if not self._copy_s_per_byte:
            return 0.0
        cap = self.cap
        return tokens * (cap.token_bytes if first else cap.activation_bytes) * self._copy_s_per_byte

    def prefill_s(self, node: str, layers_run: int, last: bool = False) -> float:
        key = (self.cap.kind_of[node], layers_run, last)
        hit = self._prefill.get(key)
        if hit is None:
            hit = self._prefill[key] = self._prefill_s(node, layers_run, last)
        return hit

    def _prefill_s(self, node: str, layers_run: int, last: bool) -> float:
        g = self.cap.kind(node)
        if g.curves is not None:  # one prompt alone in an iteration
            span = (layers_run, self.w.prompt_tokens, 0.0, 0.0)
            tasks = self.tasks(1.0, self.w.prompt_tokens)
            return g.curves.iteration_ms((span,), sampled=1.0, head_share=float(last), tasks=tasks) / 1000.0
        return self.w.prompt_tokens / g.tok_s[layers_run - 1]

    def link_s(self, a: str, b: str) -> float:
        lat = self.cap.link_latency_ms(a, b)
        return ((lat or 0.0) + self.w.fixed_hop_ms) / 1000.0

    def transfer_s(self, a: str, b: str, tokens: float) -> float:
        link = self.cap.activation_link_tok_s(a, b)
        return tokens / link if link else 0.0

    def short_paths(self, placement: Placement) -> list[list[str]]:
        """For every node, the lowest-latency source->sink path through it (decodes of 8)."""
        L = self.cap.num_layers
        cost = {n: self.decode_s(n, e - s, 8.0, e == L) for n, (s, e) in placement.items()}
        return fastest_paths(self.cap, placement, cost, self.link_s)

    # the estimate: a fixed point of the batches nodes see and the LP of requests in flight ---

    def estimate(
        self, placement: Placement, flows: dict[tuple[str, str], float], max_flow: float, *, iterations: int = 10,
        deadline: Deadline | None = None,
    ) -> ServingEstimate:
        """The estimate after ``iterations`` rounds of the batch fixed point; past ``deadline``
        it returns the last round's (at least the first round runs: one LP of milliseconds)."""
        if max_flow <= 0:
            return ServingEstimate(0.0, max_flow, 0.0, 0.0, 0.0, "none")
        routes = self._routes(placement, flows)
        batch = {n: 8.0 for n in placement}  # decodes per iteration, by node
        busy_prefill = {n: 0.0 for n in placement}  # share of a node's time spent on prefills
        result = ServingEstimate(0.0, max_flow, 0.0, 0.0, 0.0, "none")
        for it in range(iterations):
            if it > 0 and deadline is not None and deadline.expired():
                break
            taus, round_trips = self._seconds_per_token(routes, batch, busy_prefill)
            lp, kinds = requests_lp(self.cap, self.w, routes, taus, self._busy_per_decode(routes, batch))
            limit = 10.0 if deadline is None else max(FIRST_LP_MIN_S if it == 0 else 0.0, deadline.solver_limit(10.0))
            sol = lp.solve(time_limit_s=limit)
            if not sol.x:
                return result
            n_p = sol.x
            result = _summary(routes, max_flow, n_p, taus, round_trips, binding(lp, n_p, kinds))
            batch = self._next_batches(routes, batch, n_p, taus, kv_fill(lp, n_p, kinds))
            busy_prefill = self._next_prefill_busy(routes, busy_prefill, n_p, taus)
        return result

    def _routes(self, placement: Placement, flows: dict[tuple[str, str], float]) -> Routes:
        """The paths requests take: the flows' decomposition (and, ``routing="free"``, every node's fastest)."""
        decomposed = decompose(flows, self.cap.coordinator)
        paths = [p for p, _ in decomposed]
        weights = [f for _, f in decomposed]
        if self.w.routing == "free":
            for p in self.short_paths(placement):
                if p not in paths:
                    paths.append(p)
        return Routes.build(self.cap, placement, flows, paths, weights)

    def _seconds_per_token(self, routes: Routes, batch: dict[str, float],
                           busy_prefill: dict[str, float]) -> tuple[list[float], list[float]]:
        """Per path: ``tau_p`` (seconds a request spends per decode token, its prefill amortised) and
        ``W_p`` (the per-token round trip), at the nodes' current batches."""
        w, coord = self.w, self.cap.coordinator
        riding_per_decode = (w.prompt_tokens + w.output_tokens) / w.output_tokens if w.mixed_batches else 1.0
        last = routes.last
        taus, round_trips = [], []
        for p, r in zip(routes.paths, routes.runs, strict=True):
            # a decode waits for the iteration in progress, then rides the next (prefills included)
            hop = [
                self.visit_s(n, lr, batch[n], last[n], j == 0, len(p) == 1)
                / (1.0 - (0.0 if w.mixed_batches else busy_prefill[n]))
                for j, (n, lr) in enumerate(zip(p, r, strict=True))
            ]
            lat = self.link_s(coord, p[0]) + self.link_s(p[-1], coord)
            lat += sum(self.link_s(a, b) for a, b in zip(p, p[1:], strict=False))
            # the convoy crosses each hop as one message: its decodes' and riding prompts' activations / bandwidth
            lat += sum(self.transfer_s(a, b, batch[a] * riding_per_decode) for a, b in zip(p, p[1:], strict=False))
            pre = sum(self.prefill_s(n, lr, last[n]) + self.copy_s(w.prompt_tokens, first=j == 0)
                      for j, (n, lr) in enumerate(zip(p, r, strict=True))) + lat  # fmt: skip
            wp = sum(hop) + lat
            taus.append(wp + pre / w.output_tokens)
            round_trips.append(wp)
        return taus, round_trips

    def _busy_per_decode(self, routes: Routes, batch: dict[str, float]) -> dict[str, list[float]]:
        """Per node with latency curves, for each path through it: busy seconds per decode token
        (its share of the prefill and of a batch step)."""
        w, last = self.w, routes.last
        out: dict[str, list[float]] = {}
        for n, js in routes.through.items():
            if w.compute != "curves" or self.cap.kind(n).curves is None:
                continue
            vals = []
            for j in js:
                at = routes.paths[j].index(n)
                lr = routes.runs[j][at]
                vals.append((self.prefill_s(n, lr, last[n]) + self.copy_s(w.prompt_tokens, first=at == 0))
                            / w.output_tokens
                            + self.step_s(n, lr, batch[n], last[n], at == 0, len(routes.paths[j]) == 1) / batch[n])
            out[n] = vals
        return out

    def _next_batches(self, routes: Routes, batch: dict[str, float], n_p: list[float], taus: list[float],
                      fill: float) -> dict[str, float]:
        """The batch each node sees next round: a convoy (the requests in flight, KV-full, over the
        convoys), a node's share of it where parallel nodes split it unevenly; at least what arrives
        while it runs its busiest; damped by half."""
        w = self.w
        convoy = fill * sum(n_p) / (w.convoys_per_width * routes.convoy_width)
        decodes_per_s: dict[str, float] = {}
        step: dict[str, float] = {}
        for j, p in enumerate(routes.paths):
            for at, (n, lr) in enumerate(zip(p, routes.runs[j], strict=True)):
                decodes_per_s[n] = decodes_per_s.get(n, 0.0) + fill * n_p[j] / taus[j]
                step[n] = self.step_s(n, lr, batch[n], routes.last[n], at == 0, len(p) == 1)
        new_batch = {n: 1.0 for n in routes.placement}
        for n, rate in decodes_per_s.items():
            new_batch[n] = max(1.0, convoy * routes.convoy_share.get(n, 1.0), rate * step[n] / w.busy_max)
        return {n: max(1.0, 0.5 * batch[n] + 0.5 * new_batch[n]) for n in routes.placement}

    def _next_prefill_busy(self, routes: Routes, busy_prefill: dict[str, float], n_p: list[float],
                           taus: list[float]) -> dict[str, float]:
        """The share of each node's time its prefills take next round (damped by half)."""
        new_busy = {n: 0.0 for n in routes.placement}
        for j, p in enumerate(routes.paths):
            lam = n_p[j] / taus[j] / self.w.output_tokens  # requests/s on this path
            for n, lr in zip(p, routes.runs[j], strict=True):
                new_busy[n] += lam * self.prefill_s(n, lr, routes.last[n])
        return {n: min(MAX_PREFILL_BUSY, 0.5 * busy_prefill[n] + 0.5 * new_busy[n]) for n in routes.placement}


def _summary(routes: Routes, max_flow: float, n_p: list[float], taus: list[float], round_trips: list[float],
             binding_kind: str) -> ServingEstimate:
    """One round's estimate: decode tokens/s per path (``n_p / tau_p``) and their means."""
    paths = routes.paths
    total_n = sum(n_p)
    y = [n_p[j] / taus[j] for j in range(len(paths))]
    ysum = sum(y)
    return ServingEstimate(
        decode_tok_s=ysum,
        max_flow_tok_s=max_flow,
        requests_in_flight=total_n,
        mean_round_trip_ms=1000 * sum(round_trips[j] * y[j] for j in range(len(y))) / ysum if ysum else 0.0,
        mean_hops=sum(len(paths[j]) * y[j] for j in range(len(y))) / ysum if ysum else 0.0,
        binding=binding_kind,
        path_flows=[(paths[j], y[j]) for j in range(len(y)) if y[j] > 1e-9],
    )
