"""The simulation's mutable state: requests and nodes (an iteration's cost comes from
:mod:`helix.perf_model`, as the planner prices it)."""

from __future__ import annotations

from helix.perf_model import NodeCurves, Span


class SimRequest:
    """One request as the simulation tracks it."""

    __slots__ = ("id", "prompt", "output", "generated", "ctx", "stages", "stage", "prefill", "arrival",
                 "first_token", "last_token", "kv", "seq", "t_enq", "pdone", "admitted")

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
        self.admitted = arrival  # when the coordinator last routed it (after waiting for KV, or a preemption)


class SimNode:
    """One placed node: its layers, latency curves, KV, queue and the iteration it runs."""

    __slots__ = ("id", "start", "end", "k", "cap", "curves", "head_share", "pmax", "dmax", "pcount", "dctx",
                 "queue", "busy", "kv_used", "kv_peak", "busy_s", "batch", "iters", "t_start", "waking", "version",
                 "remaining", "received")

    def __init__(self, nid: str, start: int, end: int, cap: float, curves: NodeCurves, pmax: int, dmax: int,
                 *, last: bool = False, pcount: int | None = None, dctx: float | None = None) -> None:
        self.id, self.start, self.end, self.k = nid, start, end, end - start
        self.cap, self.curves, self.pmax, self.dmax = cap, curves, pmax, dmax
        self.pcount = pcount  # whole prompts per iteration at most (None: only pmax tokens limit them)
        self.dctx = dctx  # decoding requests' contexts summed per iteration at most (None: no limit)
        self.received = [0, 0]  # of the batch taken last: tokens that came from other nodes, from the coordinator
        self.head_share = 1.0 if last else 0.0  # the head is paid on the stage holding the model's last layer
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
        """Form the next iteration from the queue, FIFO (Orca), skipping what does not fit:
        prefills up to ``pmax`` tokens and ``pcount`` prompts (or, ``chunk``, chunks of the oldest
        prompts, ``chunk`` tokens in all: Sarathi), decodes up to ``dmax`` requests whose contexts sum to at most
        ``dctx``, each only if its KV fits; the taken requests leave the queue and their KV is
        held. Returns the batch and its composition by entry layer (:meth:`iteration_ms`), or
        None when nothing fits (the caller preempts). ``received`` counts the batch's tokens
        that arrived by message (a prompt's on its first chunk, a decode's one token; none for a
        decode a whole-model node fed back to itself): from other nodes, from the coordinator."""
        batch: list[SimRequest] = []
        rest: list[SimRequest] = []
        used, cap = self.kv_used, self.cap
        ptoks = dcount = prompts = dctx = 0
        pcount, dctx_max = self.pcount, self.dctx
        from_nodes = from_coord = 0
        by_start: dict[int, list[int]] = {}
        for r in self.queue:
            ls = r.stages[r.stage].layer_start
            layers = self.end - ls
            if r.prefill:
                todo = r.ctx - r.pdone
                if chunk is not None:  # Sarathi: the oldest prompts' chunks, ``chunk`` tokens in all per iteration
                    if ptoks >= chunk:
                        rest.append(r)
                        continue
                    todo = min(todo, chunk - ptoks)
                elif ptoks and (ptoks + todo > self.pmax or (pcount is not None and prompts >= pcount)):
                    rest.append(r)
                    continue
                need = r.ctx * layers if r.pdone == 0 else 0.0
            else:
                context = r.prompt + r.generated
                if dcount >= self.dmax or (dctx_max is not None and dcount and dctx + context > dctx_max):
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
                received = r.ctx if r.pdone == 0 else 0
                r.pdone += todo
                ptoks += todo
                prompts += 1
                acc[0] += todo
            else:
                received = 0 if len(r.stages) == 1 else 1
                dcount += 1
                dctx += context
                acc[1] += 1
                acc[2] += context  # the context it attends over
            if r.stage:
                from_nodes += received
            else:
                from_coord += received
            batch.append(r)
        if not batch:
            return None
        self.received = [from_nodes, from_coord]
        self.queue = rest
        self.kv_used = used
        if used > self.kv_peak:
            self.kv_peak = used
        return batch, by_start

    def iteration_ms(self, by_start: dict[int, list[int]] | dict[int, tuple[int, int, int]], sampled: int) -> float:
        """What one iteration costs here (:meth:`helix.perf_model.NodeCurves.iteration_ms`):
        ``by_start`` maps the first layer requests entered at to their (prefill tokens, decoding
        requests, those requests' context tokens); a layer runs the tokens of every request that
        entered at or before it. The head is priced by the ``sampled`` sequences."""
        if len(by_start) == 1:
            start, (ptoks, dcount, ctx) = next(iter(by_start.items()))
            spans: list[Span] = [(self.end - start, ptoks, dcount, ctx)]
        else:
            spans = []
            ptoks = dcount = ctx = 0
            starts = sorted(by_start)
            for i, s in enumerate(starts):
                ptoks += by_start[s][0]
                dcount += by_start[s][1]
                ctx += by_start[s][2]
                spans.append(((starts[i + 1] if i + 1 < len(starts) else self.end) - s, ptoks, dcount, ctx))
        return self.curves.iteration_ms(spans, sampled=sampled, head_share=self.head_share)
