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
  token ids on a first stage, at 4 then 5 GB/s) and the profile's optional per-step, head and
  context costs. The visit v_i = t_i + ``wait_share`` x E[T^2] / 2 E[T]: a decode waits for
  part of the lumpy iteration in progress (prompts come whole, Poisson, of the workload's
  length spread). Without latency curves: t_i = b / T_i(k_i).
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from helix.domain import Placement
from helix.perf_model import (
    DECODE_CONTEXT_PER_SLOT,
    HOST_COPY_GB_PER_S,
    PROMPT_SLOT_TOKENS,
    host_copy_s_per_byte,
    prompts_per_iteration,
)
from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.graph import hands_off
from planner.solvers import Model

MAX_PATHS = 400
MAX_PREFILL_BUSY = 0.9
FIRST_LP_MIN_S = 0.5  # the first round's LP may run this long past a deadline (it takes ms)


@dataclass(slots=True, frozen=True)
class Workload:
    prompt_tokens: float = 763.0
    output_tokens: float = 232.0
    kv_watermark: float = 0.8  # the feeder admits while the fullest layer's KV (summed over its holders) is below this
    kv_node_watermark: float = 0.85  # the router masks a node whose own KV estimate would pass this (router.kv)
    reserve_tokens: float | None = None  # KV reserved per request per layer; None = prompt + output
    prompt_counts_in_tok_s: bool = False  # True: T_i(k) caps prompt+decode tokens; False: decode only
    compute: str = "curves"  # "curves": node time from the latency curves when profiled; "tok_s": T_i(k)
    mixed_batches: bool = True  # iterations mix prefill and decode tokens (else: prefill inflation)
    routing: str = "flows"  # "flows": split as the max-flow paths (IWRR); "free": LP picks paths
    fixed_hop_ms: float = 0.0  # per-hop overhead not in the link latency
    # how decodes batch (fitted to the simulator on single24's placements, docs/planner-optimizer.md section 6):
    # requests move in convoys, convoys_per_width of them per parallel node of the widest layer; a decode waits
    # wait_share of the residual of the iteration in progress; a node runs at most busy_max of the time
    convoys_per_width: float = 5.0
    wait_share: float = 0.7
    busy_max: float = 0.9
    prompt_cv: float = 0.66  # prompt length's coefficient of variation (the Azure conversation mix: 0.66)
    # the paper's vLLM nodes (issue 21; helix.perf_model, as the simulator's defaults): whole prompts per iteration
    # <= prompt_max_tokens // prompt_slot_tokens, decodes' contexts <= decode_max x decode_context_per_slot, and
    # the bytes a node receives copied to the GPU at each of host_copy_gb_per_s; None / (): off
    prompt_slot_tokens: int | None = PROMPT_SLOT_TOKENS
    decode_context_per_slot: float | None = DECODE_CONTEXT_PER_SLOT
    host_copy_gb_per_s: tuple[float, ...] = HOST_COPY_GB_PER_S


@dataclass(slots=True)
class ServingEstimate:
    decode_tok_s: float
    max_flow_tok_s: float
    requests_in_flight: float
    mean_round_trip_ms: float
    mean_hops: float
    binding: str  # "compute" | "kv" | "links" | "none"
    path_flows: list[tuple[list[str], float]] = field(default_factory=list)  # (nodes, decode tok/s)


def _decompose(flows: dict[tuple[str, str], float], coord: str) -> list[tuple[list[str], float]]:
    # rounded, and ties broken by name, so the paths do not depend on float noise in the flows
    rest = {e: round(f, 3) for e, f in flows.items() if f > 1e-3}
    out_edges: dict[str, list[str]] = {}
    for a, b in rest:
        out_edges.setdefault(a, []).append(b)
    paths: list[tuple[list[str], float]] = []
    while len(paths) < MAX_PATHS:
        v, amount = coord, float("inf")
        path: list[str] = []
        steps = 0
        while True:
            nxt = [w for w in out_edges.get(v, []) if rest.get((v, w), 0.0) > 1e-6]
            if not nxt or steps > 10_000:
                path = []
                break
            w = max(nxt, key=lambda cand: (rest[(v, cand)], cand))  # noqa: B023 - used at once
            amount = min(amount, rest[(v, w)])
            steps += 1
            if w == coord:
                break
            path.append(w)
            v = w
        if not path:
            break
        prev = coord
        for node in [*path, coord]:
            rest[(prev, node)] -= amount
            prev = node
        paths.append((path, amount))
    return paths


class ServingModel:
    """Scores placements of one planning problem for one workload (caches prefill times per kind)."""

    def __init__(self, cap: CapacityModel, workload: Workload | None = None) -> None:
        self.cap = cap
        self.w = workload or Workload()
        self._prefill: dict[tuple[str, int, bool], float] = {}
        self._copy_s_per_byte = host_copy_s_per_byte(self.w.host_copy_gb_per_s)

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
        ms = steps * (g.curves.iteration_ms(spans, sampled=per_step, head_share=float(last)) + riding * prompt_ms)
        if overflow:
            ms += overflow / ride_max * g.curves.iteration_ms(((layers_run, ride_max, 0.0, 0.0),), sampled=1.0,
                                                              head_share=float(last))  # fmt: skip
        return ms / 1000.0

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
            return g.curves.iteration_ms((span,), sampled=1.0, head_share=float(last)) / 1000.0
        return self.w.prompt_tokens / g.tok_s[layers_run - 1]

    def link_s(self, a: str, b: str) -> float:
        lat = self.cap.link_latency_ms(a, b)
        return ((lat or 0.0) + self.w.fixed_hop_ms) / 1000.0

    def transfer_s(self, a: str, b: str, tokens: float) -> float:
        link = self.cap.activation_link_tok_s(a, b)
        return tokens / link if link else 0.0

    def _layer_segments(self, placement: Placement) -> tuple[list[tuple[tuple[int, int], list[str]]], dict[tuple[int, int], float]]:
        """Layer segments with their holders, and KV entries per layer of each (summed over the
        holders, each node's KV spread evenly over its layers, as ``router.kv`` counts it)."""
        segments = _segments_of(placement)
        kv = {}
        for seg, holders in segments:
            total = 0.0
            for n in holders:
                s, e = placement[n]
                total += self.cap.kind(n).kv_entries[e - s - 1] / (e - s)
            kv[seg] = total
        return segments, kv

    # paths ---------------------------------------------------------------------------

    def _layers_run(self, placement: Placement, path: list[str]) -> list[int]:
        out, done = [], 0
        for node in path:
            s, e = placement[node]
            out.append(e - max(s, done))
            done = e
        return out

    def short_paths(self, placement: Placement) -> list[list[str]]:
        """For every node, the lowest-latency source->sink path through it (DP on the DAG)."""
        cap, coord, L = self.cap, self.cap.coordinator, self.cap.num_layers
        cost = {n: self.decode_s(n, e - s, 8.0, e == L) for n, (s, e) in placement.items()}
        order = sorted(placement, key=lambda n: placement[n][1])
        fwd: dict[str, tuple[float, str | None]] = {}
        for n in order:
            s, e = placement[n]
            best: tuple[float, str | None] = (float("inf"), None)
            if s == 0 and cap.link_latency_ms(coord, n) is not None:
                best = (self.link_s(coord, n), None)
            for m in order:
                if placement[m][1] >= e:
                    break
                if m in fwd and hands_off(placement[m], placement[n], True) and cap.link_latency_ms(m, n) is not None:
                    c = fwd[m][0] + cost[m] + self.link_s(m, n)
                    if c < best[0]:
                        best = (c, m)
            if best[0] < float("inf"):
                fwd[n] = best
        bwd: dict[str, tuple[float, str | None]] = {}
        for n in reversed(order):
            s, e = placement[n]
            best = (float("inf"), None)
            if e == L and cap.link_latency_ms(n, coord) is not None:
                best = (self.link_s(n, coord) + cost[n], None)
            for m in order:
                if m in bwd and hands_off(placement[n], placement[m], True) and cap.link_latency_ms(n, m) is not None:
                    c = bwd[m][0] + cost[n] + self.link_s(n, m)
                    if c < best[0]:
                        best = (c, m)
            if best[0] < float("inf"):
                bwd[n] = best
        paths: list[list[str]] = []
        for n in placement:
            if n not in fwd or n not in bwd:
                continue
            head: list[str] = []
            v: str | None = fwd[n][1]
            while v is not None:
                head.append(v)
                v = fwd[v][1]
            tail: list[str] = []
            v = bwd[n][1]
            while v is not None:
                tail.append(v)
                v = bwd[v][1]
            p = [*reversed(head), n, *tail]
            if p not in paths:
                paths.append(p)
        return paths

    # the estimate --------------------------------------------------------------------

    def estimate(
        self, placement: Placement, flows: dict[tuple[str, str], float], max_flow: float, *, iterations: int = 10,
        deadline: Deadline | None = None,
    ) -> ServingEstimate:
        """The estimate after ``iterations`` rounds of the batch fixed point; past ``deadline``
        it returns the last round's (at least the first round runs: one LP of milliseconds)."""
        cap, w, coord = self.cap, self.w, self.cap.coordinator
        if max_flow <= 0:
            return ServingEstimate(0.0, max_flow, 0.0, 0.0, 0.0, "none")
        decomposed = _decompose(flows, coord)
        paths = [p for p, _ in decomposed]
        weights = [f for _, f in decomposed]
        if w.routing == "free":
            for p in self.short_paths(placement):
                if p not in paths:
                    paths.append(p)
        runs = [self._layers_run(placement, p) for p in paths]
        tokens_per_decode = (w.prompt_tokens + w.output_tokens) / w.output_tokens
        riding_per_decode = tokens_per_decode if w.mixed_batches else 1.0
        t_row = tokens_per_decode if w.prompt_counts_in_tok_s else 1.0
        ctx = w.reserve_tokens if w.reserve_tokens is not None else w.prompt_tokens + w.output_tokens
        segments, layer_kv = self._layer_segments(placement)
        rel, width = _convoy_shape(flows)
        batch = {n: 8.0 for n in placement}
        last = {n: e == cap.num_layers for n, (_, e) in placement.items()}  # pays head_ms
        busy_prefill = {n: 0.0 for n in placement}  # share of a node's time spent on prefills
        result = ServingEstimate(0.0, max_flow, 0.0, 0.0, 0.0, "none")
        for it in range(iterations):
            if it > 0 and deadline is not None and deadline.expired():
                break
            taus, times = [], []
            for p, r in zip(paths, runs, strict=True):
                # a decode step waits for the whole iteration, prefill chunks included
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
                times.append((wp, hop))
            m = Model(maximize=True)
            rows_kind_pre: list[str] = []
            cols = [m.add_col(0.0, cost=1.0 / tau) for tau in taus]
            if w.routing == "flows":  # the router splits requests in proportion to the plan's flows
                alpha = m.add_col(0.0)
                for j, c in enumerate(cols):
                    m.add_row([c, alpha], [1.0 / taus[j], -weights[j]], 0.0, 0.0)
                    rows_kind_pre.append("split")
            through: dict[str, list[int]] = {}
            over: dict[tuple[str, str], list[int]] = {}
            for j, p in enumerate(paths):
                for n in p:
                    through.setdefault(n, []).append(j)
                for link in zip([coord, *p], [*p, coord], strict=True):
                    over.setdefault(link, []).append(j)
            rows_kind: list[str] = rows_kind_pre
            for n, js in through.items():
                s, e = placement[n]
                g = cap.kind(n)
                if w.compute == "curves" and g.curves is not None:
                    # busy seconds per decode token: prefill share + this token's share of a batch step
                    vals = []
                    for j in js:
                        at = paths[j].index(n)
                        lr = runs[j][at]
                        per_tok = ((self.prefill_s(n, lr, last[n]) + self.copy_s(w.prompt_tokens, first=at == 0))
                                   / w.output_tokens
                                   + self.step_s(n, lr, batch[n], last[n], at == 0, len(paths[j]) == 1) / batch[n])
                        vals.append(per_tok / taus[j])
                    m.add_row([cols[j] for j in js], vals, hi=1.0)
                    rows_kind.append("compute")
                m.add_row([cols[j] for j in js], [t_row / taus[j] for j in js], hi=cap.node_capacity(n, e - s))
                rows_kind.append("compute")
                kv = cap.kind(n).kv_entries[e - s - 1] * w.kv_node_watermark
                vals = [ctx * runs[j][paths[j].index(n)] for j in js]
                m.add_row([cols[j] for j in js], vals, hi=kv)
                rows_kind.append("kv")
            # the feeder: every layer's KV, summed over its holders (each node's spread evenly over its layers)
            for seg, holders in segments:
                coef: dict[int, float] = {}
                for n in holders:
                    k = placement[n][1] - placement[n][0]
                    for j in through.get(n, []):
                        coef[j] = coef.get(j, 0.0) + ctx * runs[j][paths[j].index(n)] / k
                if coef:
                    m.add_row([cols[j] for j in coef], list(coef.values()), hi=w.kv_watermark * layer_kv[seg])
                    rows_kind.append("kv")
            for (a, b), js in over.items():
                capl = cap.token_link_tok_s(a, b) if coord in (a, b) else cap.activation_link_tok_s(a, b)
                if capl is None:
                    capl = 0.0
                m.add_row([cols[j] for j in js], [tokens_per_decode / taus[j]] * len(js), hi=capl)
                rows_kind.append("links")
            limit = 10.0 if deadline is None else max(FIRST_LP_MIN_S if it == 0 else 0.0, deadline.solver_limit(10.0))
            sol = m.solve(time_limit_s=limit)
            if not sol.x:
                return result
            n_p = sol.x
            binding = _binding(m, n_p, rows_kind)
            # Offline serving fills KV up to the watermark (the router admits while it fits), so
            # the batches nodes see come from the KV-full population, not the LP's minimum.
            fill = float("inf")
            for (idx, val, _, hi), kind in zip(m.rows, rows_kind, strict=True):
                if kind == "kv":
                    used = sum(v * n_p[i] for i, v in zip(idx, val, strict=True))
                    if used > 1e-9:
                        fill = min(fill, hi / used)
            fill = 1.0 if fill == float("inf") else max(1.0, fill)
            # the batch a node sees: a convoy (the requests in flight over the convoys), a node's share of it
            # where parallel nodes split it unevenly; at least what arrives while it runs its busiest
            convoy = fill * sum(n_p) / (w.convoys_per_width * width)
            decodes_per_s: dict[str, float] = {}
            step: dict[str, float] = {}
            for j, p in enumerate(paths):
                for at, (n, lr) in enumerate(zip(p, runs[j], strict=True)):
                    decodes_per_s[n] = decodes_per_s.get(n, 0.0) + fill * n_p[j] / taus[j]
                    step[n] = self.step_s(n, lr, batch[n], last[n], at == 0, len(p) == 1)
            new_batch = {n: 1.0 for n in placement}
            for n, rate in decodes_per_s.items():
                new_batch[n] = max(1.0, convoy * rel.get(n, 1.0), rate * step[n] / w.busy_max)
            batch = {n: max(1.0, 0.5 * batch[n] + 0.5 * new_batch[n]) for n in placement}
            new_busy = {n: 0.0 for n in placement}
            for j, p in enumerate(paths):
                lam = n_p[j] / taus[j] / w.output_tokens  # requests/s on this path
                for n, lr in zip(p, runs[j], strict=True):
                    new_busy[n] += lam * self.prefill_s(n, lr, last[n])
            busy_prefill = {n: min(MAX_PREFILL_BUSY, 0.5 * busy_prefill[n] + 0.5 * new_busy[n]) for n in placement}
            total_n = sum(n_p)
            y = [n_p[j] / taus[j] for j in range(len(paths))]
            ysum = sum(y)
            result = ServingEstimate(
                decode_tok_s=ysum,
                max_flow_tok_s=max_flow,
                requests_in_flight=total_n,
                mean_round_trip_ms=1000 * sum(times[j][0] * y[j] for j in range(len(y))) / ysum if ysum else 0.0,
                mean_hops=sum(len(paths[j]) * y[j] for j in range(len(y))) / ysum if ysum else 0.0,
                binding=binding,
                path_flows=[(paths[j], y[j]) for j in range(len(y)) if y[j] > 1e-9],
            )
        return result


def _convoy_shape(flows: dict[tuple[str, str], float]) -> tuple[dict[str, float], float]:
    """How the flows split convoys at forks: ``width``, the largest participation ratio
    ``(sum f)^2 / sum f^2`` of any vertex's out-flows, the coordinator's included (3 for a node
    feeding three parallel nodes equally, ~1 where one next hop carries nearly all), and per
    node ``min(1, width x its largest share of a predecessor's out-flow)``: 1 for a node of an
    even split, less for one that gets a small part of every convoy."""
    out: dict[str, list[tuple[str, float]]] = {}
    for (src, dst), f in flows.items():
        if f > 0:
            out.setdefault(src, []).append((dst, f))
    width = 1.0
    share: dict[str, float] = {}
    for hops in out.values():
        total = sum(f for _, f in hops)
        width = max(width, total * total / sum(f * f for _, f in hops))
        for dst, f in hops:
            share[dst] = max(share.get(dst, 0.0), f / total)
    return {n: min(1.0, width * x) for n, x in share.items()}, width


def _segments_of(placement: Placement) -> list[tuple[tuple[int, int], list[str]]]:
    """The placement's layers cut at every range boundary, each with the nodes holding it."""
    cuts = sorted({x for s, e in placement.values() for x in (s, e)})
    return [((a, b), [n for n, (s, e) in placement.items() if s <= a and e >= b]) for a, b in zip(cuts, cuts[1:], strict=False)]


def _binding(m: Model, x: list[float], kinds: list[str]) -> str:
    tight: dict[str, int] = {}
    for (idx, val, _, hi), kind in zip(m.rows, kinds, strict=True):
        act = sum(v * x[i] for i, v in zip(idx, val, strict=True))
        if hi > 0 and act >= hi * (1 - 1e-6):
            tight[kind] = tight.get(kind, 0) + 1
    return max(tight, key=lambda k: tight[k]) if tight else "none"
