"""The serving objective: an estimate of the decode tokens/s a placement really delivers.

Max flow counts prompt and decode tokens alike and ignores that every hop adds latency to
every generated token and that a request's KV must fit on every node it passes. This model
keeps both (Little's law on each request path), for a workload of ``P`` prompt and ``D``
output tokens per request (Azure conversation trace means: 763 / 232):

* Paths p: a decomposition of the max flow into source->sink paths, plus, for every node,
  the shortest (lowest per-token latency) path through it. On p, node i runs ``l_ip`` layers
  (fewer than it holds after a partial hand-off).
* Per-token round trip  W_p = sum_i l_ip * d_i(b_i) + sum of link latencies on p
  (coordinator -> first, hops, last -> coordinator), with d_i(b) the profile's
  decode_ms_per_layer at decode batch b (else b / T_i(k_i), i.e. derived from tok_s), plus
  the profile's optional per-step costs: step_overhead_ms once per step on every node and
  head_ms on the node holding the last layer (absent: 0), and the profile's optional context
  cost for the workload's mean context (prompt + half the output) per request.
  Amortised prefill adds  pre_p / D  with pre_p = sum_i l_ip * prefill_ms_i(P) + latencies.
  The batch b_i a node sees is the expected number of its in-flight requests currently at
  it (n_i * its share of W_p), found by a short fixed-point iteration.
* Variables n_p = requests in flight on p; each yields y_p = n_p / tau_p decode tokens/s,
  tau_p = W_p + pre_p / D. The LP (HiGHS)

      maximize   sum_p y_p
      compute:   sum_{p through i} y_p (P + D) / D <= T_i(k_i)          (capacity model)
      links:     sum_{p over e} y_p (P + D) / D <= capacity_e
      KV:        sum_{p through i} n_p (P + D) l_ip <= watermark * KV_i(k_i)

  (KV reserved up front for the whole request, DESIGN.md) gives the estimate. It is
  min(max flow * D/(P+D), requests that fit in KV / round trip) generalised to many paths:
  deep pipelines pay in W_p, thinly spread layers pay in KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.budget import Deadline
from planner.graph import hands_off
from planner.highs_model import Model
from planner.instance import Instance, Placement

MAX_PATHS = 400
MAX_PREFILL_BUSY = 0.9
FIRST_LP_MIN_S = 0.5  # the first round's LP may run this long past a deadline (it takes ms)


@dataclass(slots=True, frozen=True)
class Workload:
    prompt_tokens: float = 763.0
    output_tokens: float = 232.0
    kv_watermark: float = 0.8  # the feeder admits while the fullest layer's KV is below this
    reserve_tokens: float | None = None  # KV reserved per request per layer; None = prompt + output
    prompt_counts_in_tok_s: bool = False  # True: T_i(k) caps prompt+decode tokens; False: decode only
    compute: str = "curves"
    mixed_batches: bool = True  # iterations mix prefill and decode tokens (else: prefill inflation)
    spread: float = 0.35  # 0: requests move as one convoy per node; 1: spread evenly over the round trip
    routing: str = "flows"  # "flows": split as the max-flow paths (IWRR); "free": LP picks paths  # "curves": node time from the latency curves when profiled; "tok_s": T_i(k)
    fixed_hop_ms: float = 0.0  # per-hop overhead not in the link latency (e.g. host copies)


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
    """Scores placements for one instance and workload (caches per-type curves)."""

    def __init__(self, inst: Instance, workload: Workload | None = None) -> None:
        self.inst = inst
        self.w = workload or Workload()
        self._prefill: dict[tuple[str, int, bool], float] = {}

    # per-node timing ----------------------------------------------------------------

    def decode_s(self, node: str, layers_run: int, batch: float, last: bool = False) -> float:
        """Seconds of one decode step of ``batch`` requests over ``layers_run`` layers; ``last``:
        the node holds the model's last layer (pays the profile's ``head_ms``). The steady
        state's iteration (:mod:`helix.perf_model`): each request at the workload's mean context
        and, with mixed batches, the workload's share of prompt tokens riding along; a batch
        above the node's decode limit takes several steps."""
        g = self.inst.gpus[self.inst.gpu_of[node]]
        batch = max(1.0, batch)
        if g.curves is None:
            return batch / g.tok_s[layers_run - 1]
        cap = float(g.decode_max_batch[layers_run - 1]) if g.decode_max_batch else batch
        steps = math.ceil(batch / cap - 1e-9)
        per_step = batch / steps
        # in steady state every iteration also carries prompt tokens in the workload's ratio
        riding = per_step * self.w.prompt_tokens / self.w.output_tokens if self.w.mixed_batches else 0.0
        context = per_step * (self.w.prompt_tokens + self.w.output_tokens / 2)
        ms = g.curves.iteration_ms(((layers_run, riding, per_step, context),), sampled=per_step, head_share=float(last))
        return steps * ms / 1000.0

    def prefill_s(self, node: str, layers_run: int, last: bool = False) -> float:
        key = (self.inst.gpu_of[node], layers_run, last)
        hit = self._prefill.get(key)
        if hit is None:
            hit = self._prefill[key] = self._prefill_s(node, layers_run, last)
        return hit

    def _prefill_s(self, node: str, layers_run: int, last: bool) -> float:
        g = self.inst.gpus[self.inst.gpu_of[node]]
        if g.curves is not None:  # one prompt alone in an iteration
            span = (layers_run, self.w.prompt_tokens, 0.0, 0.0)
            return g.curves.iteration_ms((span,), sampled=1.0, head_share=float(last)) / 1000.0
        return self.w.prompt_tokens / g.tok_s[layers_run - 1]

    def link_s(self, a: str, b: str) -> float:
        lat = self.inst.latency_ms(a, b)
        return ((lat or 0.0) + self.w.fixed_hop_ms) / 1000.0

    def transfer_s(self, a: str, b: str, tokens: float) -> float:
        cap = self.inst.cap.activation_link_tok_s(a, b)
        return tokens / cap if cap else 0.0

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
        inst, coord, L = self.inst, self.inst.coordinator, self.inst.num_layers
        cost = {n: self.decode_s(n, e - s, 8.0, e == L) for n, (s, e) in placement.items()}
        order = sorted(placement, key=lambda n: placement[n][1])
        fwd: dict[str, tuple[float, str | None]] = {}
        for n in order:
            s, e = placement[n]
            best: tuple[float, str | None] = (float("inf"), None)
            if s == 0 and inst.latency_ms(coord, n) is not None:
                best = (self.link_s(coord, n), None)
            for m in order:
                if placement[m][1] >= e:
                    break
                if m in fwd and hands_off(placement[m], placement[n], True) and inst.latency_ms(m, n) is not None:
                    c = fwd[m][0] + cost[m] + self.link_s(m, n)
                    if c < best[0]:
                        best = (c, m)
            if best[0] < float("inf"):
                fwd[n] = best
        bwd: dict[str, tuple[float, str | None]] = {}
        for n in reversed(order):
            s, e = placement[n]
            best = (float("inf"), None)
            if e == L and inst.latency_ms(n, coord) is not None:
                best = (self.link_s(n, coord) + cost[n], None)
            for m in order:
                if m in bwd and hands_off(placement[n], placement[m], True) and inst.latency_ms(n, m) is not None:
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
        inst, w, coord = self.inst, self.w, self.inst.coordinator
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
        t_row = tokens_per_decode if w.prompt_counts_in_tok_s else 1.0
        ctx = w.reserve_tokens if w.reserve_tokens is not None else w.prompt_tokens + w.output_tokens
        batch = {n: 8.0 for n in placement}
        last = {n: e == inst.num_layers for n, (_, e) in placement.items()}  # pays head_ms
        busy_prefill = {n: 0.0 for n in placement}  # share of a node's time spent on prefills
        result = ServingEstimate(0.0, max_flow, 0.0, 0.0, 0.0, "none")
        for it in range(iterations):
            if it > 0 and deadline is not None and deadline.expired():
                break
            taus, times = [], []
            for p, r in zip(paths, runs, strict=True):
                # a decode step waits for the whole iteration, prefill chunks included
                hop = [
                    self.decode_s(n, lr, batch[n], last[n]) / (1.0 - (0.0 if w.mixed_batches else busy_prefill[n]))
                    for n, lr in zip(p, r, strict=True)
                ]
                lat = self.link_s(coord, p[0]) + self.link_s(p[-1], coord)
                lat += sum(self.link_s(a, b) for a, b in zip(p, p[1:], strict=False))
                # the convoy crosses each hop as one message: batch x activation bytes / bandwidth
                lat += sum(self.transfer_s(a, b, batch[a]) for a, b in zip(p, p[1:], strict=False))
                pre = sum(self.prefill_s(n, lr, last[n]) for n, lr in zip(p, r, strict=True)) + lat
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
                g = inst.gpus[inst.gpu_of[n]]
                if w.compute == "curves" and g.curves is not None:
                    # busy seconds per decode token: prefill share + this token's share of a batch step
                    vals = []
                    for j in js:
                        lr = runs[j][paths[j].index(n)]
                        per_tok = (self.prefill_s(n, lr, last[n]) / w.output_tokens
                                   + self.decode_s(n, lr, batch[n], last[n]) / batch[n])
                        vals.append(per_tok / taus[j])
                    m.add_row([cols[j] for j in js], vals, hi=1.0)
                    rows_kind.append("compute")
                m.add_row([cols[j] for j in js], [t_row / taus[j] for j in js], hi=inst.node_tok_s(n, e - s))
                rows_kind.append("compute")
                kv = inst.gpus[inst.gpu_of[n]].kv_entries[e - s - 1] * w.kv_watermark
                vals = [ctx * runs[j][paths[j].index(n)] for j in js]
                m.add_row([cols[j] for j in js], vals, hi=kv)
                rows_kind.append("kv")
            for (a, b), js in over.items():
                capl = inst.cap.token_link_tok_s(a, b) if coord in (a, b) else inst.cap.activation_link_tok_s(a, b)
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
            new_batch = {n: 1.0 for n in placement}
            for j, p in enumerate(paths):
                wp, hop = times[j]
                for n, h in zip(p, hop, strict=True):
                    # share of the node's in-flight requests that sit in one of its batches:
                    # 1 for a single convoy, (time at node / round trip) for evenly spread ones
                    new_batch[n] += fill * n_p[j] * (h / max(wp, 1e-9)) ** w.spread
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


def _binding(m: Model, x: list[float], kinds: list[str]) -> str:
    tight: dict[str, int] = {}
    for (idx, val, _, hi), kind in zip(m.rows, kinds, strict=True):
        act = sum(v * x[i] for i, v in zip(idx, val, strict=True))
        if hi > 0 and act >= hi * (1 - 1e-6):
            tight[kind] = tight.get(kind, 0) + 1
    return max(tight, key=lambda k: tight[k]) if tight else "none"
