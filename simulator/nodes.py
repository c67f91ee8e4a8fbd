"""A simulated node: one agent's own scheduler (:class:`node_agent.scheduler.Scheduler` over a
:class:`node_agent.kv_account.KVAccount`), its iterations priced by the profile's curves
(:mod:`helix.perf_model`, as the planner prices them).

A node receives what an agent receives (``node_agent/agent.py``): on the first stage the
coordinator's ADMIT (the prompt's ids) and STEP (the token to decode next), on later stages
:class:`Hidden` activations from the stage before (the agent's ACTIVATIONS; only their size
matters here, and every one carries the request's admission), on every stage CANCEL. As the
agent does, it adds a request to its scheduler when it first sees it (the scheduler reserves
prompt + max_tokens of KV and never preempts; a request that could never fit is REFUSED),
feeds the inputs as they arrive, runs the scheduler's batch as one iteration, sends each
request's activations on to its next stage (a chunk as soon as it ran), samples on the last
stage (ending a request by :func:`helix.domain.token_finish`, the agent's rule) and, holding the
whole model for a request, feeds the sampled token to its own next step. A request's fine-tuned
task (ADMIT's ``task``) adds its PET type's cost to the layers it runs (:mod:`simulator.tasks`).

Two things differ from the agent on purpose (docs/simulator.md, "Where the nodes differ from the
agents"): :class:`IterationLimits`, the per-iteration limits of the paper's vLLM nodes, trim the
scheduler's batch; and unless ``SimConfig.max_batch_size`` is set, a node holds as many requests
as its KV reserves, as those vLLM nodes do (the agent bounds them by ``--max-batch-size``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

from helix import wire
from helix.domain import ErrorCode, Stage, token_finish
from helix.errors import CapacityError, ConfigError
from helix.perf_model import NodeCurves, Span, host_copy_s_per_byte, prompts_per_iteration
from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from node_agent.kv_account import KVAccount
from node_agent.scheduler import Batch, Scheduler, SchedulerConfig
from simulator.iteration_limits import IterationLimits
from simulator.results import SimConfig
from simulator.tasks import group_tasks, span_tasks

Group = int | tuple[int, int]  # requests priced together: the first layer they run here (or their range here)
TOKEN = 0  # what every simulated sample yields: only how many tokens there are matters
UNBOUNDED_KV_TOKENS = 2**40  # a node whose profile gives no KV capacity


@dataclass(frozen=True, slots=True)
class StepCosts:
    """What an iteration costs beyond the profile's curves: host CPU per iteration, and the bytes a node
    received for the batch copied to the GPU first (``copy_s_per_byte``; activations ``act_bytes`` per
    token from other nodes, token ids ``tok_bytes`` each from the coordinator)."""

    overhead_ms: float = 0.0
    copy_s_per_byte: float = 0.0
    act_bytes: float = 0.0
    tok_bytes: float = 0.0


class Visit:
    """One request on one node (the agent's route): its pipeline, this node's hop, what it generated here."""

    __slots__ = ("stages", "hop", "entry", "exit", "prompt", "max_tokens", "last", "loops", "next_node", "generated",
                 "t_in", "task")

    def __init__(self, stages: tuple[Stage, ...], hop: int, prompt: int, max_tokens: int, now: float,
                 task: str = "") -> None:  # fmt: skip
        self.stages, self.hop, self.prompt, self.max_tokens, self.task = stages, hop, prompt, max_tokens, task
        self.entry, self.exit = stages[hop].layer_start, stages[hop].layer_end  # the layers it runs here
        self.last = hop == len(stages) - 1
        self.loops = len(stages) == 1  # holds the whole model for it: samples feed its own next step
        self.next_node = "" if self.last else stages[hop + 1].node
        self.generated = 0
        self.t_in = now  # when its latest input arrived (Swarm's estimate of the time spent here)


class Hidden(NamedTuple):
    """Activations of ``tokens`` positions of a request from the stage before (``sender``: its visit there)."""

    wire_id: str
    tokens: int
    sender: Visit


NodeInput = wire.Admit | wire.Step | wire.Cancel | Hidden
Observe = Callable[[str, float], None]  # (node, seconds a request's input spent there): Swarm routing's feedback


class SimNode:
    """One placed node: its layers, curves, scheduler, the requests on it and the iteration it runs."""

    __slots__ = ("id", "start", "end", "k", "curves", "head_share", "kv_tokens", "scheduler", "limits", "costs",
                 "visits", "cancelled", "batch", "busy", "waking", "version", "remaining", "busy_s", "iters", "used",
                 "used_peak", "kv_waits", "_blocked", "_inputs", "task_types", "gate", "alone", "together", "alone_s",
                 "crowding")

    def __init__(self, nid: str, start: int, end: int, curves: NodeCurves, *, last: bool, kv_tokens: int,
                 scheduler: SchedulerConfig, limits: IterationLimits, costs: StepCosts,
                 task_types: Mapping[str, str] | None = None, alone: NodeCurves | None = None,
                 together: int = 1) -> None:  # fmt: skip
        self.id, self.start, self.end, self.k, self.curves = nid, start, end, end - start, curves
        # the curves stepping alone on a shared host, and how many stepped at once when ``curves`` were measured
        # (simulator.hosts: crowding); None: ``curves`` at any crowding
        self.alone, self.together = alone, together
        self.alone_s = 0.0  # the planned iteration's seconds with the host to itself (``alone``; else its price)
        self.crowding = 0.0  # its crowded price ÷ alone price - 1 (set by a shared host)
        self.task_types = task_types or {}  # task -> PET type (simulator.tasks.TaskMix.pet_of); empty: no task costs
        self.head_share = 1.0 if last else 0.0  # the head is paid on the stage holding the model's last layer
        self.kv_tokens = kv_tokens
        self.scheduler = Scheduler(scheduler, KVAccount(kv_tokens))
        self.limits, self.costs = limits, costs
        self.visits: dict[str, Visit] = {}
        self.cancelled: set[str] = set()  # cancelled before its activations arrived (the agent's tombstones)
        self.batch: Batch | None = None  # the running iteration's
        self.busy = False
        self.waking = False  # idle, woken by an arrival, gathering the rest of the burst (gather_window_ms)
        self.version = 0  # of the scheduled end of the running iteration (a shared host reschedules it)
        self.remaining = 0.0  # seconds of work the running iteration has left (shared hosts)
        self.busy_s = 0.0
        self.iters = 0
        self.used = self.used_peak = 0  # KV tokens computed (held for real), now and at most
        self.kv_waits = 0  # requests that could not start here at once (KV reservation or batch slots full)
        self._blocked: set[str] = set()
        self._inputs = 0  # input tokens arrived and not yet run, over every request here (0: nothing to schedule)
        # live membership (simulator.membership): a new request whose layers here are outside [start, end) is
        # refused with the code (a leaving agent refuses every one, a releasing one those on moving layers)
        self.gate: tuple[int, int, ErrorCode] | None = None

    # -- what arrives -----------------------------------------------------------------------------

    def receive(self, items: list[NodeInput], now: float) -> list[wire.Refused]:
        """Apply what arrived, as the agent does; the REFUSED to send back to the coordinator."""
        refused: list[wire.Refused] = []
        sched, visits = self.scheduler, self.visits
        for m in items:
            if type(m) is Hidden:
                visit = visits.get(m.wire_id)
                if visit is None:
                    if m.wire_id in self.cancelled:
                        continue
                    s = m.sender
                    visit = self._add(m.wire_id, Visit(s.stages, s.hop + 1, s.prompt, s.max_tokens, now, s.task), 0,
                                      refused)  # fmt: skip
                    if visit is None:
                        continue
                visit.t_in = now
                sched.add_input(m.wire_id, m.tokens)
                self._inputs += m.tokens
            elif type(m) is wire.Step:
                visit = visits.get(m.request_id)
                if visit is not None and not visit.loops:
                    visit.t_in = now
                    sched.add_input(m.request_id, 1)
                    self._inputs += 1
            elif type(m) is wire.Admit:
                stages = tuple(ref.stage for ref in m.pipeline)
                self._add(m.request_id, Visit(stages, 0, len(m.prompt), m.max_tokens, now, m.task), len(m.prompt),
                          refused)  # fmt: skip
            elif type(m) is wire.Cancel:
                if m.request_id in visits:
                    self._forget(m.request_id)
                else:
                    self.cancelled.add(m.request_id)
        return refused

    def _add(self, wire_id: str, visit: Visit, pending: int, refused: list[wire.Refused]) -> Visit | None:
        gate = self.gate
        if gate is not None and not gate[0] <= visit.entry < visit.exit <= gate[1]:
            self.cancelled.add(wire_id)
            refused.append(wire.Refused(wire_id, self.id, gate[2], f"layers [{visit.entry}, {visit.exit}) are not "
                                        f"served here any more ({gate[2].value})"))  # fmt: skip
            return None
        try:
            self.scheduler.add(wire_id, visit.prompt, visit.max_tokens, pending_tokens=pending)
        except CapacityError as exc:
            self.cancelled.add(wire_id)
            refused.append(wire.Refused(wire_id, self.id, ErrorCode.CAPACITY, exc.message))
            return None
        self.visits[wire_id] = visit
        self._inputs += pending
        return visit

    def _forget(self, wire_id: str) -> None:
        del self.visits[wire_id]
        sched = self.scheduler
        seq = sched.running.get(wire_id) or next(s for s in sched.waiting if s.request_id == wire_id)
        self.used -= seq.computed_tokens
        self._inputs -= seq.pending_tokens
        sched.remove(wire_id)
        self._blocked.discard(wire_id)

    # -- live membership (simulator.membership) ------------------------------------------------------

    def outside(self, start: int, end: int) -> list[str]:
        """The requests here whose layers are not all within ``[start, end)``."""
        return [rid for rid, v in self.visits.items() if not start <= v.entry < v.exit <= end]

    def refuse(self, wire_ids: list[str], code: ErrorCode) -> list[wire.Refused]:
        """Refuse (and forget) requests it runs, as an agent does at the end of a drain."""
        for rid in wire_ids:
            self._forget(rid)
            self.cancelled.add(rid)
        return [wire.Refused(rid, self.id, code, f"drained ({code.value})") for rid in wire_ids]

    def move_to(self, new: SimNode) -> None:
        """Serve ``new``'s range from now on (a re-plan switched to it), with its KV, limits and bounds; the
        requests here keep their layers (they are priced on what they run) until they end or are refused."""
        self.start, self.end, self.k, self.head_share = new.start, new.end, new.k, new.head_share
        self.kv_tokens, self.limits = new.kv_tokens, new.limits
        self.scheduler.config = new.scheduler.config
        self.scheduler.kv.capacity_tokens = new.kv_tokens

    def queued(self) -> int:
        """Requests with input waiting here or in the running iteration (shortest-queue routing)."""
        sched = self.scheduler
        pending = sum(1 for s in sched.running.values() if s.pending_tokens) + len(sched.waiting)
        return pending + (len(self.batch.work) if self.batch is not None else 0)

    # -- one iteration ----------------------------------------------------------------------------

    def plan(self) -> float | None:
        """Take the scheduler's next batch (trimmed by the limits) and return what it costs in seconds;
        None when nothing can run."""
        if not self._inputs:
            return None
        sched = self.scheduler
        batch = sched.schedule()
        for rid in batch.admitted:
            self._blocked.discard(rid)
        for seq in sched.waiting:  # strict FCFS: whatever is still waiting could not start
            if seq.request_id not in self._blocked:
                self._blocked.add(seq.request_id)
                self.kv_waits += 1
        if not batch.work:
            return None
        seconds = self._price(batch, self.limits)
        if seconds is None:  # past the limits: trim (rarely needed, so priced in one pass first)
            batch = self.limits.trim(batch)
            seconds = self._price(batch, None)
            assert seconds is not None
        self.batch = batch
        return seconds

    def _price(self, batch: Batch, limits: IterationLimits | None) -> float | None:
        """What ``batch`` costs in seconds; None when it passes ``limits``."""
        by_start: dict[Group, list[int]] = {}
        task_rows: dict[Group, dict[str, int]] | None = {} if self.task_types else None  # start -> task -> rows
        from_nodes = from_coord = sampled = decodes = context = prompts = prompt_tokens = 0
        visits, end, mixed = self.visits, self.end, False
        for w in batch.work:
            v = visits[w.request_id]
            key: Group = v.entry
            if v.exit != end:  # it runs a range this node served before a re-plan
                key, mixed = (v.entry, v.exit), True
            acc = by_start.get(key)
            if acc is None:
                acc = by_start[key] = [0, 0, 0]
            if task_rows is not None and v.task:
                rows = task_rows.setdefault(key, {})
                rows[v.task] = rows.get(v.task, 0) + w.num_tokens
            if w.is_prefill:
                acc[0] += w.num_tokens
                received = w.num_tokens
                prompts += 1
                prompt_tokens += w.num_tokens
            else:
                acc[1] += 1
                acc[2] += w.first_position + 1  # the context it attends over
                received = 0 if v.loops else 1
                decodes += 1
                context += w.first_position + 1
            if v.hop:
                from_nodes += received
            else:
                from_coord += received
            if v.last and w.ends_prompt_or_decodes:
                sampled += 1
        if limits is not None and limits.passed(decodes, context, prompts, prompt_tokens):
            return None
        c = self.costs
        copy = (from_nodes * c.act_bytes + from_coord * c.tok_bytes) * c.copy_s_per_byte
        ms = self._ranges_ms(by_start, sampled, task_rows) if mixed else \
            self.iteration_ms(cast(dict[int, list[int]], by_start), sampled, cast("dict[int, dict[str, int]] | None", task_rows))
        seconds = (ms + c.overhead_ms) / 1000.0 + copy
        self.alone_s = seconds
        if self.alone is not None:
            alone_ms = self._ranges_ms(by_start, sampled, task_rows, self.alone) if mixed else self.iteration_ms(
                cast(dict[int, list[int]], by_start), sampled, cast("dict[int, dict[str, int]] | None", task_rows),
                self.alone)  # fmt: skip
            self.alone_s = (alone_ms + c.overhead_ms) / 1000.0 + copy
        return seconds

    def complete(self, now: float, observe: Observe | None) -> tuple[dict[str, list[Hidden]], list[wire.TokenOut]]:
        """The running iteration ended: account it in the scheduler; the activations to send on (by next
        node) and the tokens sampled (for the coordinator). A request that ends here is dropped at once."""
        batch, self.batch = self.batch, None
        assert batch is not None
        forwards: dict[str, list[Hidden]] = {}
        tokens: list[wire.TokenOut] = []
        finished: list[str] = []
        looped: list[str] = []
        visits = self.visits
        for w in batch.work:
            v = visits.get(w.request_id)
            if v is None:  # cancelled while the iteration ran
                continue
            self.used += w.num_tokens
            self._inputs -= w.num_tokens
            if observe is not None:
                observe(self.id, now - v.t_in)
            if not v.last:
                hop = forwards.get(v.next_node)
                if hop is None:
                    hop = forwards[v.next_node] = []
                hop.append(Hidden(w.request_id, w.num_tokens, v))
            elif w.ends_prompt_or_decodes:
                v.generated += 1
                reason = token_finish(TOKEN, v.generated, v.max_tokens, ())
                tokens.append(wire.TokenOut(w.request_id, v.generated - 1, TOKEN, reason))
                if reason is not None:
                    finished.append(w.request_id)
                elif v.loops:
                    v.t_in = now
                    looped.append(w.request_id)
        if self.used > self.used_peak:
            self.used_peak = self.used
        self.scheduler.update(batch)
        for rid in finished:
            self._forget(rid)
        for rid in looped:
            self.scheduler.add_input(rid, 1)
        self._inputs += len(looped)
        return forwards, tokens

    def iteration_ms(self, by_start: Mapping[int, Sequence[int]], sampled: int,
                     task_rows: Mapping[int, Mapping[str, int]] | None = None,
                     curves: NodeCurves | None = None) -> float:  # fmt: skip
        """What one iteration costs here (:meth:`helix.perf_model.NodeCurves.iteration_ms`):
        ``by_start`` maps the first layer requests entered at to their (prefill tokens, decoding
        requests, those requests' context tokens); a layer runs the tokens of every request that
        entered at or before it. The head is priced by the ``sampled`` sequences; ``task_rows``
        gives, by start, the rows of each fine-tuned task among those requests; ``curves`` prices it
        (default: the node's)."""
        if len(by_start) == 1:
            start, (ptoks, dcount, ctx) = next(iter(by_start.items()))
            spans: list[Span] = [(self.end - start, ptoks, dcount, ctx)]
            starts = [start]
        else:
            spans = []
            ptoks = dcount = ctx = 0
            starts = sorted(by_start)
            for i, s in enumerate(starts):
                ptoks += by_start[s][0]
                dcount += by_start[s][1]
                ctx += by_start[s][2]
                spans.append(((starts[i + 1] if i + 1 < len(starts) else self.end) - s, ptoks, dcount, ctx))
        tasks = span_tasks(task_rows, starts, self.task_types) if task_rows else ()
        return (curves or self.curves).iteration_ms(spans, sampled=sampled, head_share=self.head_share, tasks=tasks)

    def _ranges_ms(self, by_range: Mapping[Group, Sequence[int]], sampled: int,
                   task_rows: Mapping[Group, Mapping[str, int]] | None = None,
                   curves: NodeCurves | None = None) -> float:  # fmt: skip
        """:meth:`iteration_ms` when requests run different ranges here (a key ``(start, end)``: requests
        that run ``[start, end)`` rather than up to the node's end, a range it served before a re-plan): one
        span between every two consecutive range bounds, running the requests whose range holds it."""
        ranges = {(key, self.end) if isinstance(key, int) else key: key for key in by_range}
        cuts = sorted({bound for r in ranges for bound in r})
        spans: list[Span] = []
        members: list[list[Group]] = []
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            inside = [key for (s, e), key in ranges.items() if s <= lo and hi <= e]
            if inside:
                ptoks, dcount, ctx = (sum(by_range[key][i] for key in inside) for i in range(3))
                spans.append((hi - lo, ptoks, dcount, ctx))
                members.append(inside)
        tasks = group_tasks(task_rows, members, self.task_types) if task_rows else ()
        return (curves or self.curves).iteration_ms(spans, sampled=sampled, head_share=self.head_share, tasks=tasks)

    def kv_report(self) -> tuple[float, float, float]:
        """What the agent's heartbeat says, in KV entries (tokens x layers here): used, reserved, capacity."""
        return (float(self.used * self.k), float(self.scheduler.kv.reserved_tokens * self.k),
                float(self.kv_tokens * self.k))  # fmt: skip


def build_nodes(cluster: ClusterSpec, profiles: ProfileSet, plan: Plan, config: SimConfig,
                kv_entries: Mapping[str, float], task_types: Mapping[str, str] | None = None) -> dict[str, SimNode]:  # fmt: skip
    """One :class:`SimNode` per placed node: its profile's curves and limits, ``kv_entries`` of KV (tokens x
    layers; absent: unbounded), the scheduler as ``config`` sets it, ``task_types`` (task -> PET type)
    to price the fine-tuned tasks its requests run."""
    return {nid: build_node(cluster, profiles, nid, s, e, config, kv_entries, task_types)
            for nid, (s, e) in plan.placement.items()}  # fmt: skip


def build_node(cluster: ClusterSpec, profiles: ProfileSet, nid: str, s: int, e: int, config: SimConfig,
               kv_entries: Mapping[str, float], task_types: Mapping[str, str] | None = None) -> SimNode:  # fmt: skip
    """The :class:`SimNode` of ``nid`` holding layers ``[s, e)`` (:func:`build_nodes`)."""
    model = profiles.models[cluster.model]
    costs = StepCosts(config.iteration_overhead_ms, host_copy_s_per_byte(config.host_copy_gb_per_s),
                      model.activation_bytes_per_token, model.token_bytes)  # fmt: skip
    gpu = cluster.node(nid).gpu
    tp = profiles.throughput(gpu, cluster.model)
    curves = tp.curves()
    if curves is None:
        raise ConfigError(
            f"GPU {gpu!r} has only a tok_s table for {cluster.model}; the simulator needs its latency curves "
            f"(prefill_ms_per_layer, decode_ms_per_layer): measure them with `helix profile --cluster "
            f"{cluster.source}` and list the file it writes last in the cluster's profiles:",
            source=", ".join(str(path) for path in cluster.profile_paths()),
            field=f"gpus.{gpu}.throughput.{cluster.model}",
        )
    # stepping alone on a shared host (simulator.hosts); only where nodes share hosts' cores
    alone = tp.alone_curves() if config.host_cores is not None and tp.alone is not None else None
    if not config.decode_floor:
        curves = dataclasses.replace(curves, decode_floor=False)
        alone = dataclasses.replace(alone, decode_floor=False) if alone is not None else None
    k = e - s
    pmax = tp.prompt_max_tokens_by_layers[k - 1] if tp.prompt_max_tokens_by_layers else 4096
    dmax = tp.decode_max_tokens_by_layers[k - 1] if tp.decode_max_tokens_by_layers else 256
    kv_tokens = max(1, int(kv_entries[nid] // k)) if nid in kv_entries else UNBOUNDED_KV_TOKENS
    running = config.max_batch_size or kv_tokens  # a request holds at least one token
    budget = config.token_budget or running + int(pmax)  # unset: the limits below bound an iteration
    per_slot = config.decode_context_per_slot
    limits = IterationLimits(int(dmax), int(pmax), prompts_per_iteration(pmax, config.prompt_slot_tokens),
                             None if per_slot is None else dmax * per_slot, config.prefill_chunk_tokens is not None)
    return SimNode(nid, s, e, curves, last=e == model.num_layers, kv_tokens=kv_tokens,
                   scheduler=SchedulerConfig(running, budget, config.prefill_chunk_tokens), limits=limits,
                   costs=costs, task_types=task_types, alone=alone,
                   together=tp.alone.together if alone is not None and tp.alone is not None else 1)  # fmt: skip
