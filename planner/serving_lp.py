"""The serving model's LP (``planner.serving_model``): how many requests are in flight on each path.

Variables ``n_p`` (requests in flight on path p, each yielding ``n_p / tau_p`` decode tokens/s),
maximising the decode tokens/s, with one row per limit and its kind (what :func:`binding` reports):

* ``split``: the router splits requests in proportion to the plan's flows (``routing="flows"``);
* ``compute``: a node's busy seconds per second (from the latency curves, when profiled) and its
  ``T_i(k_i)``;
* ``kv``: a node's KV under the router's mask (``kv_node_watermark``), and every layer's KV summed
  over its holders under the feeder's watermark (``kv_watermark``);
* ``links``: every hop's tokens/s, and every capacity hops share (a region's uplink / downlink, a
  node's NIC: :mod:`planner.shared_links`) in bytes/s.
"""

from __future__ import annotations

from planner.capacity import CapacityModel
from planner.serving_paths import Routes
from planner.serving_workload import Workload
from planner.shared_links import shared_capacities
from planner.solvers import Model


def requests_lp(cap: CapacityModel, w: Workload, routes: Routes, taus: list[float],
                busy: dict[str, list[float]]) -> tuple[Model, list[str]]:
    """The LP for one round of the batch fixed point, and each row's kind. ``taus[j]``: seconds per
    decode token of a request on path j; ``busy[node]``: the node's busy seconds per decode token of
    each path through it (nodes with latency curves only)."""
    placement, paths, runs, coord = routes.placement, routes.paths, routes.runs, cap.coordinator
    tokens_per_decode = (w.prompt_tokens + w.output_tokens) / w.output_tokens
    t_row = tokens_per_decode if w.prompt_counts_in_tok_s else 1.0
    ctx = w.reserve_tokens if w.reserve_tokens is not None else w.prompt_tokens + w.output_tokens
    m = Model(maximize=True)
    kinds: list[str] = []
    cols = [m.add_col(0.0, cost=1.0 / tau) for tau in taus]
    if w.routing == "flows":  # the router splits requests in proportion to the plan's flows
        alpha = m.add_col(0.0)
        for j, c in enumerate(cols):
            m.add_row([c, alpha], [1.0 / taus[j], -routes.weights[j]], 0.0, 0.0)
            kinds.append("split")
    for n, js in routes.through.items():
        s, e = placement[n]
        if n in busy:  # busy seconds per decode token: prefill share + this token's share of a batch step
            m.add_row([cols[j] for j in js], [b / taus[j] for b, j in zip(busy[n], js, strict=True)], hi=1.0)
            kinds.append("compute")
        m.add_row([cols[j] for j in js], [t_row / taus[j] for j in js], hi=cap.node_capacity(n, e - s))
        kinds.append("compute")
        kv = cap.kind(n).kv_entries[e - s - 1] * w.kv_node_watermark
        vals = [ctx * runs[j][paths[j].index(n)] for j in js]
        m.add_row([cols[j] for j in js], vals, hi=kv)
        kinds.append("kv")
    # the feeder: every layer's KV, summed over its holders (each node's spread evenly over its layers)
    for seg, holders in routes.segments:
        coef: dict[int, float] = {}
        for n in holders:
            k = placement[n][1] - placement[n][0]
            for j in routes.through.get(n, []):
                coef[j] = coef.get(j, 0.0) + ctx * runs[j][paths[j].index(n)] / k
        if coef:
            m.add_row([cols[j] for j in coef], list(coef.values()), hi=w.kv_watermark * routes.layer_kv[seg])
            kinds.append("kv")
    for (a, b), js in routes.over.items():
        capl = cap.token_link_tok_s(a, b) if coord in (a, b) else cap.activation_link_tok_s(a, b)
        if capl is None:
            capl = 0.0
        m.add_row([cols[j] for j in js], [tokens_per_decode / taus[j]] * len(js), hi=capl)
        kinds.append("links")
    for row in shared_capacities(cap, ((key, key[0], key[1]) for key in routes.over)):
        unit = max(nbytes for _, nbytes in row.edges)
        share: dict[int, float] = {}
        for key, nbytes in row.edges:
            for j in routes.over[key]:
                share[j] = share.get(j, 0.0) + nbytes / unit * tokens_per_decode / taus[j]
        m.add_row([cols[j] for j in share], list(share.values()), hi=row.bytes_per_s / unit)
        kinds.append("links")
    return m, kinds


def kv_fill(m: Model, x: list[float], kinds: list[str]) -> float:
    """How many times the LP's requests fit in the tightest KV row (at least 1): offline serving
    fills KV up to the watermark (the router admits while it fits), so the batches nodes see come
    from the KV-full population, not the LP's minimum."""
    fill = float("inf")
    for (idx, val, _, hi), kind in zip(m.rows, kinds, strict=True):
        if kind == "kv":
            used = sum(v * x[i] for i, v in zip(idx, val, strict=True))
            if used > 1e-9:
                fill = min(fill, hi / used)
    return 1.0 if fill == float("inf") else max(1.0, fill)


def binding(m: Model, x: list[float], kinds: list[str]) -> str:
    """The kind of limit with the most tight rows at ``x`` ("none" when no row is tight)."""
    tight: dict[str, int] = {}
    for (idx, val, _, hi), kind in zip(m.rows, kinds, strict=True):
        act = sum(v * x[i] for i, v in zip(idx, val, strict=True))
        if hi > 0 and act >= hi * (1 - 1e-6):
            tight[kind] = tight.get(kind, 0) + 1
    return max(tight, key=lambda k: tight[k]) if tight else "none"
