"""The simulation's mutable state: requests and nodes, and the per-node latency tables."""

from __future__ import annotations

import numpy as np


class SimRequest:
    """One request as the simulation tracks it."""

    __slots__ = ("id", "prompt", "output", "generated", "ctx", "stages", "stage", "prefill", "arrival",
                 "first_token", "last_token", "kv", "seq", "t_enq", "pdone")

    def __init__(self, rid: int, prompt: int, output: int, arrival: float) -> None:
        self.id = rid
        self.prompt = prompt
        self.output = output
        self.generated = 0
        self.ctx = prompt  # tokens to prefill (prompt + generated after a preemption)
        self.stages: tuple = ()
        self.stage = 0
        self.prefill = True
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_token = 0.0
        self.kv: dict[str, float] = {}
        self.seq = 0
        self.t_enq = 0.0
        self.pdone = 0  # prompt tokens prefilled on the current stage (chunked prefill)


class SimNode:
    """One placed node: its layers, latency tables, KV, queue and the iteration it runs."""

    __slots__ = ("id", "start", "end", "k", "cap", "pf", "dc", "pmax", "dmax", "queue", "busy", "kv_used",
                 "kv_peak", "busy_s", "batch", "iters", "t_start", "step", "head", "waking", "version", "remaining",
                 "ctx_ref", "ctx_ms")

    def __init__(self, nid: str, start: int, end: int, cap: float, pf: list[float], dc: list[float],
                 pmax: int, dmax: int, step: list[float] | None = None, head: list[float] | None = None,
                 ctx_ref: float = 0.0, ctx_ms: float = 0.0) -> None:
        self.id, self.start, self.end, self.k = nid, start, end, end - start
        self.cap, self.pf, self.dc, self.pmax, self.dmax = cap, pf, dc, pmax, dmax
        self.step = step  # ms per iteration by batch tokens (prompt tokens + decodes), every stage
        self.head = head  # ms per iteration by sequences sampled; only on the stage with the last layer
        self.ctx_ref, self.ctx_ms = ctx_ref, ctx_ms  # decode: ms per layer, request and context token beyond ctx_ref
        self.queue: list[SimRequest] = []
        self.busy = False
        self.kv_used = 0.0
        self.kv_peak = 0.0
        self.busy_s = 0.0
        self.batch: list[SimRequest] = []
        self.iters = 0
        self.t_start = 0.0
        self.waking = False  # idle, woken by an arrival, gathering the rest of the burst (gather_window_ms)
        self.version = 0  # of the scheduled end of the running iteration (a shared host reschedules it)
        self.remaining = 0.0  # seconds of work the running iteration has left (shared hosts)

    def take_batch(self, chunk: int | None) -> tuple[list[SimRequest], dict[int, list[int]]] | None:
        """Form the next iteration from the queue, FIFO (Orca): prefills up to ``pmax`` tokens
        (or, ``chunk``, one chunk of the oldest prompt: Sarathi), decodes up to ``dmax``, each
        only if its KV fits; the taken requests leave the queue and their KV is held. Returns
        the batch and its composition by entry layer (:meth:`iteration_ms`), or None when
        nothing fits (the caller preempts)."""
        batch: list[SimRequest] = []
        rest: list[SimRequest] = []
        used, cap = self.kv_used, self.cap
        ptoks = dcount = 0
        by_start: dict[int, list[int]] = {}
        for r in self.queue:
            ls = r.stages[r.stage].layer_start
            layers = self.end - ls
            if r.prefill:
                todo = r.ctx - r.pdone
                if chunk is not None:  # Sarathi: one chunk of the oldest prompt per iteration
                    if ptoks:
                        rest.append(r)
                        continue
                    todo = min(todo, chunk)
                elif ptoks and ptoks + todo > self.pmax:
                    rest.append(r)
                    continue
                need = r.ctx * layers if r.pdone == 0 else 0.0
            else:
                if dcount >= self.dmax:
                    rest.append(r)
                    continue
                need = layers
            if used + need > cap:
                rest.append(r)
                continue
            used += need
            r.kv[self.id] = r.kv.get(self.id, 0.0) + need
            acc = by_start.get(ls)
            if acc is None:
                acc = by_start[ls] = [0, 0, 0]
            if r.prefill:
                r.pdone += todo
                ptoks += todo
                acc[0] += todo
            else:
                dcount += 1
                acc[1] += 1
                acc[2] += r.prompt + r.generated  # the context it attends over
            batch.append(r)
        if not batch:
            return None
        self.queue = rest
        self.kv_used = used
        if used > self.kv_peak:
            self.kv_peak = used
        return batch, by_start

    def iteration_ms(self, by_start: dict[int, list[int]] | dict[int, tuple[int, int, int]], sampled: int) -> float:
        """What one iteration costs here: ``by_start`` maps the first layer requests entered at to
        their (prefill tokens, decoding requests, those requests' context tokens); a layer runs the
        tokens of every request that entered at or before it. Plus the per-step cost by batch
        tokens, and the head by the ``sampled`` sequences on the stage holding the last layer."""
        pf, dc, ctx_ref, ctx_ms = self.pf, self.dc, self.ctx_ref, self.ctx_ms
        p_top, d_top = len(pf) - 1, len(dc) - 1
        if len(by_start) == 1:
            start, (ptoks, dcount, ctx) = next(iter(by_start.items()))
            layer = pf[min(ptoks, p_top)] + dc[min(dcount, d_top)] + ctx_ms * (ctx - dcount * ctx_ref)
            ms = (self.end - start) * max(0.0, layer)
        else:
            ms = 0.0
            ptoks = dcount = ctx = 0
            starts = sorted(by_start)
            for i, s in enumerate(starts):
                ptoks += by_start[s][0]
                dcount += by_start[s][1]
                ctx += by_start[s][2]
                seg = (starts[i + 1] if i + 1 < len(starts) else self.end) - s
                layer = pf[min(ptoks, p_top)] + dc[min(dcount, d_top)] + ctx_ms * (ctx - dcount * ctx_ref)
                ms += seg * max(0.0, layer)
        if self.step is not None:
            ms += self.step[min(ptoks + dcount, len(self.step) - 1)]
        if self.head is not None:
            ms += self.head[min(sampled, len(self.head) - 1)]
        return ms


def latency_table(curve: list[tuple[float, float]], n: int, *, proportional_low: bool = True) -> list[float]:
    """ms for x = 0..n-1 from a curve (linear interpolation, linear extrapolation past the end;
    below the first point proportional to x, or flat for a fixed per-step cost)."""
    pts = sorted(curve)
    xs = np.array([p[0] for p in pts], dtype=float)
    ys = np.array([p[1] for p in pts], dtype=float)
    grid = np.arange(n, dtype=float)
    out = np.interp(grid, xs, ys)
    if xs[0] > 0 and proportional_low:  # below the first point: proportional to x
        low = grid < xs[0]
        out[low] = ys[0] * grid[low] / xs[0]
    if len(xs) >= 2 and xs[-1] < n - 1:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        high = grid > xs[-1]
        out[high] = ys[-1] + slope * (grid[high] - xs[-1])
    out[0] = 0.0
    return out.tolist()
