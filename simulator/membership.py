"""A membership trace replayed in a simulated run (``helix simulate --membership``): nodes die, leave and join,
and the coordinator re-plans through the server's own membership policy and planner.

What is the server's, run as it is: :class:`router.membership.Membership` (the versioned view and the
re-planning policy: a death waits ``grace_s``, a leave or a join re-plans at once, one re-plan per
``min_interval_s``, "cannot hold the model"), fed the agents' events at simulated times and ticked every
:data:`TICK_S` as the coordinator's watcher ticks it; ``planner.replan.replan`` over the membership it asks
for (the cluster file's nodes less those gone plus those joined, as ``router.membership_driver`` builds it);
the coordinator core's failover (a dead or leaving node's requests re-prefilled on new pipelines) and its
switch to the new plan's router (:meth:`router.core.CoordinatorCore.set_router`).

What this module plays, for the agents and the transport (:class:`MembershipReplay` carries out the
membership's actions):

* **kill**: the node stops at once (what reaches it is lost); the coordinator hears ``AgentDied``
  ``detect_s`` later (its heartbeats stop).
* **leave**: the node refuses new requests (LEAVING) and tells the coordinator, finishes what it runs
  within ``drain_timeout_s`` and refuses what is left, then stops; ``AgentLeft`` ``detect_s`` later.
* **join**: the node's agent connects holding no layers (``POST /v1/cluster/join``, then the handshake).
* **a re-plan** takes ``replan_s`` simulated seconds (by default the policy's time limit, which the planner
  runs to); SET_LAYERS loads the layers a node lacks at ``load_gb_per_s`` (the model's weight bytes per
  layer) while it keeps serving; fine-tuned tasks reload at once; at the switch each changed node serves its
  new range (:meth:`simulator.nodes.SimNode.move_to`: its KV and limits for the new layer count) and the
  core routes by the new plan; RELEASE_LAYERS refuses new requests on the old layers (LAYERS_MOVED), lets
  those running there finish within ``drain_s`` and refuses the rest (the core re-prefills them).

:meth:`MembershipReplay.report` says what it cost: the re-plans with their layer moves, requests
re-prefilled, requests lost, and the time some layer had no live node serving it.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from helix import wire
from helix.domain import ErrorCode
from helix.errors import HelixError, InfeasiblePlanError
from helix.plan import Plan
from helix.spec import ClusterSpec, NodeSpec
from router.agent_events import AgentDied, AgentEvent, AgentJoined, AgentLeft, KVReported
from router.core_interfaces import QuietObserver
from router.membership import Membership
from router.membership_types import (
    Action,
    Dial,
    MembershipEvent,
    ReloadTasks,
    ReplanFailed,
    Replanned,
    Send,
    StartReplan,
    SwitchPlan,
    TasksReloaded,
    Unavailable,
)
from simulator.membership_trace import MembershipTrace, TraceEvent
from simulator.nodes import build_node

if TYPE_CHECKING:
    from simulator.engine import Simulation

TICK_S = 0.25  # the coordinator's watcher ticks the membership this often (router.coordinator.TICK_S)
Spans = tuple[tuple[int, int], ...]


class Reroutes(QuietObserver):
    """Counts the core's failovers: attempts re-prefilled on a new pipeline."""

    def __init__(self) -> None:
        self.count = 0

    def rerouted(self) -> None:
        self.count += 1


@dataclass(slots=True)
class ReplanRecord:
    """One re-plan the membership asked for, and how it went."""

    version: int
    started_s: float
    nodes: list[str]
    reasons: list[str]
    planned_s: float | None = None  # when the planner's answer came
    switched_s: float | None = None  # when the core routed by it (its layers loaded)
    outcome: str = "planning"  # planning | switched | failed: why | infeasible: why
    replan: dict[str, Any] = field(default_factory=dict)  # the plan's stats["replan"]: decision, moves, layers moved
    max_flow_tok_s: float | None = None


class MembershipReplay:
    """Replays ``trace`` in ``sim`` (see the module doc)."""

    def __init__(self, sim: Simulation, cluster: ClusterSpec, plan: Plan, trace: MembershipTrace,
                 joined: list[AgentJoined]) -> None:  # fmt: skip
        self.sim, self.trace, self.base = sim, trace, cluster
        self.model = sim.profiles.models[cluster.model]
        self.membership = Membership(cluster, plan, trace.membership_policy(), now=0.0)
        self.reroutes = Reroutes()
        sim.core.observer = self.reroutes
        sim.core.wait_for_replan = True  # as the live coordinator: with no route left, requests wait for the re-plan
        self._joined = joined  # the WELCOMEs of the nodes serving at the start
        self.up = set(plan.placement)  # nodes whose agents run
        self.held: dict[str, Spans] = {n: ((r[0], r[1]),) for n, r in plan.placement.items()}
        self.leaving: dict[str, float] = {}  # node -> when its drain ends at the latest
        self.releasing: dict[str, tuple[int, float]] = {}  # node -> (version, when its drain ends)
        self.loader_free: dict[str, float] = {}  # node -> when its loads queued so far are done
        self.clusters: dict[int, ClusterSpec] = {}  # re-plan version -> the membership it was made for
        self.replans: dict[int, ReplanRecord] = {}
        self.timeline: list[tuple[float, str]] = []
        self.gaps: list[tuple[float, float]] = []  # times some layer had no live node serving it
        self._gap_since: float | None = None
        self._last_note: object = None
        self._ready = True  # whether the core had a route after the last event
        self.end = float("inf")

    # -- driving -----------------------------------------------------------------------------------

    def start(self, end: float) -> None:
        """At time 0: the nodes have joined; the trace's events and the ticks are due until ``end``."""
        self.end = end
        self._run(self.membership.update(self._joined, 0.0))
        for i, ev in self.trace.ordered():
            self.sim.at(ev.at_s, functools.partial(self._event, i, ev))
        self.sim.at(TICK_S, self._tick)

    def _tick(self) -> None:
        now = self.sim.now
        for node in list(self.leaving):
            self._drain_leaving(node)
        for node in list(self.releasing):
            self._drain_release(node)
        self._run(self.membership.tick(now))
        if now + TICK_S <= self.end:
            self.sim.at(now + TICK_S, self._tick)

    def _deliver(self, events: list[AgentEvent]) -> None:
        """What the transport reports: to the core (its failover), then to the membership."""
        sim = self.sim
        sim.to_coordinator(events)
        self._run(self.membership.update(events, sim.now))
        self._coverage()
        if sim.core.ready and not self._ready and sim.clients.resume(sim.now):  # routes again: clients come back
            sim.to_coordinator([])
        self._ready = sim.core.ready

    def _answer(self, event: MembershipEvent) -> None:
        self._run(self.membership.update((event,), self.sim.now))

    def _run(self, actions: list[Action]) -> None:
        self._sync_notes()
        for action in actions:
            self._do(action)

    def _do(self, action: Action) -> None:
        sim, now = self.sim, self.sim.now
        if isinstance(action, StartReplan):
            self._replan(action)
        elif isinstance(action, Send) and isinstance(action.message, wire.SetLayers):
            self._set_layers(action.node, action.message)
        elif isinstance(action, Send) and isinstance(action.message, wire.ReleaseLayers):
            self._release(action.node, action.message)
        elif isinstance(action, ReloadTasks):  # the simulated tasks need no reload
            sim.at(now, functools.partial(self._answer, TasksReloaded(action.version)))
        elif isinstance(action, SwitchPlan):
            self._switch(action)
        elif isinstance(action, Dial):  # the joining agent's handshake
            sim.at(now, functools.partial(self._handshake, action.node))
        elif isinstance(action, Unavailable):
            sim.core.set_unavailable(action.reason)
        # Forget: nothing is kept of a departed node here

    # -- the trace's events ------------------------------------------------------------------------

    def _event(self, index: int, ev: TraceEvent) -> None:
        sim, now, node = self.sim, self.sim.now, ev.node
        self._note(now, f"trace events[{index}]: {ev.what} {node}")
        if ev.kill is not None:
            self._stop(node)
            sim.at(now + self.trace.detect_s, functools.partial(self._deliver, [AgentDied(node)]))
        elif ev.leave is not None:
            n = sim.nodes.get(node)
            running = len(n.visits) if n is not None else 0
            if n is not None:
                n.gate = (0, 0, ErrorCode.LEAVING)
            self.leaving[node] = now + self.trace.drain_timeout_s
            self._deliver([wire.Leaving(node, self.trace.drain_timeout_s, running)])
            self._drain_leaving(node)
        else:
            assert ev.join is not None
            self.up.add(node)
            self.held[node] = ()
            # as POST /v1/cluster/join takes it (router.membership_driver): no region is the coordinator's
            spec = ev.join if ev.join.region else ev.join.model_copy(update={"region": self.base.coordinator.region})
            self._run(self.membership.join(spec, now))

    def _handshake(self, node: str) -> None:
        spec = self._spec(node)
        kv = self.sim.profiles.throughput(spec.gpu, self.base.model).kv_capacity_tokens_by_layers
        self._deliver([AgentJoined(node, wire.Welcome(node, 0, 0, int(kv[0]) if kv else 0, spec.address or ""))])

    def _drain_leaving(self, node: str) -> None:
        """A leaving node stops once it runs nothing, or refuses what is left when its drain ends."""
        n = self.sim.nodes.get(node)
        if n is not None and n.visits and self.sim.now < self.leaving[node]:
            return
        del self.leaving[node]
        if n is not None and n.visits:
            self.sim.to_coordinator([*n.refuse(list(n.visits), ErrorCode.LEAVING)])
        self._stop(node)
        self.sim.at(self.sim.now + self.trace.detect_s, functools.partial(self._deliver, [AgentLeft(node)]))

    def _stop(self, node: str) -> None:
        self.up.discard(node)
        self.releasing.pop(node, None)
        if node in self.sim.nodes:
            self.sim.remove_node(node)
        self._coverage()

    # -- a reconfiguration -------------------------------------------------------------------------

    def _replan(self, action: StartReplan) -> None:
        """``planner.replan`` over the membership, as ``router.membership_driver`` runs it; its answer comes
        ``replan_s`` later."""
        from planner.replan import ReplanOptions, replan, with_nodes, without_nodes

        keep, base, now = {n.id for n in action.nodes}, self.base, self.sim.now
        cluster = with_nodes(without_nodes(base, [n for n in base.node_ids if n not in keep]),
                             [n for n in action.nodes if n.id not in base.node_ids])  # fmt: skip
        self.clusters[action.version] = cluster
        r = self.membership.reconfig
        record = self.replans[action.version] = ReplanRecord(action.version, now, sorted(keep),
                                                             list(r.reasons) if r is not None else [])  # fmt: skip
        event: MembershipEvent
        try:
            options = ReplanOptions(time_limit_s=self.membership.policy.replan_time_limit_s)
            result = replan(cluster, self.sim.profiles, action.plan, options)
        except HelixError as exc:
            infeasible = isinstance(exc, InfeasiblePlanError)
            event = ReplanFailed(action.version, exc.message, infeasible=infeasible)
            record.outcome = f"{'infeasible' if infeasible else 'failed'}: {exc.message}"
        else:
            event = Replanned(action.version, result.plan)
            record.replan, record.max_flow_tok_s = result.plan.stats.get("replan", {}), result.plan.max_flow_tok_s
        self.sim.at(now + self.trace.replan_duration_s, functools.partial(self._planned, record, event))

    def _planned(self, record: ReplanRecord, event: MembershipEvent) -> None:
        record.planned_s = self.sim.now
        self._answer(event)

    def _set_layers(self, node: str, msg: wire.SetLayers) -> None:
        """Load the layers of ``[start, end)`` the node lacks, one load after another, while it serves."""
        if self.releasing.pop(node, None) is not None:  # a newer range: the release is superseded
            self._note(self.sim.now, f"{node}: release superseded by SET_LAYERS v{msg.version}")
        held = self.held.get(node, ())
        missing = sum(1 for layer in range(msg.layer_start, msg.layer_end) if not any(s <= layer < e for s, e in held))
        seconds = missing * self.model.layer_weight_bytes / (self.trace.load_gb_per_s * 1e9)
        done = max(self.sim.now, self.loader_free.get(node, 0.0)) + seconds
        self.loader_free[node] = done
        self.sim.at(done, functools.partial(self._loaded, node, msg, seconds))

    def _loaded(self, node: str, msg: wire.SetLayers, seconds: float) -> None:
        if node not in self.up:
            return  # it died or left meanwhile
        held = self.held[node] = _union((*self.held.get(node, ()), (msg.layer_start, msg.layer_end)))
        self._deliver([wire.Layers(node, msg.version, "load", msg.layer_start, msg.layer_end, _spans(held),
                                   seconds=seconds)])  # fmt: skip

    def _switch(self, action: SwitchPlan) -> None:
        """Route by the new plan: every node whose range changed serves its new one (a joiner starts)."""
        sim = self.sim
        cluster = self.clusters.pop(action.version)
        for old in [v for v in self.clusters if v < action.version]:
            del self.clusters[old]
        base = sim.base_router(action.plan, cluster)
        kv = sim.kv_entries(base)
        changed = []
        for node, (s, e) in action.plan.placement.items():
            n = sim.nodes.get(node)
            if n is not None and (n.start, n.end) == (s, e):
                continue
            fresh = build_node(cluster, sim.profiles, node, s, e, sim.cfg, kv,
                               sim.tasks.pet_of if sim.tasks is not None else None)  # fmt: skip
            if n is None:
                sim.add_node(fresh, cluster)
            else:
                n.move_to(fresh)
            changed.append(sim.nodes[node])
        sim.core.set_router(sim.router_of(base))
        sim.clients.placement = dict(action.plan.placement)
        record = self.replans.get(action.version)
        if record is not None:
            record.switched_s, record.outcome = sim.now, "switched"
        # the changed nodes' heartbeats: their KV for the new layer count, then the core starts what waits
        self._deliver([KVReported(n.id, *n.kv_report()) for n in changed])

    def _release(self, node: str, msg: wire.ReleaseLayers) -> None:
        """New requests on the old layers are refused; those running there get ``drain_s`` to finish."""
        n = self.sim.nodes.get(node)
        if n is None:
            return
        n.gate = (n.start, n.end, ErrorCode.LAYERS_MOVED)
        self.releasing[node] = (msg.version, self.sim.now + msg.drain_s)
        self._drain_release(node)

    def _drain_release(self, node: str) -> None:
        n = self.sim.nodes.get(node)
        version, until = self.releasing[node]
        if n is None:
            del self.releasing[node]
            return
        moving = n.outside(n.start, n.end)
        if moving and self.sim.now < until:
            return
        del self.releasing[node]
        if moving:
            self.sim.to_coordinator([*n.refuse(moving, ErrorCode.LAYERS_MOVED)])
        self.held[node] = ((n.start, n.end),)
        self._deliver([wire.Layers(node, version, "release", n.start, n.end, _spans(self.held[node]))])

    # -- what it cost ------------------------------------------------------------------------------

    def _coverage(self) -> None:
        """Track the time some layer has no live, not leaving node of the routed plan serving it."""
        now, placement = self.sim.now, self.sim.core.router.topology.placement
        live = [r for n, r in placement.items() if n in self.up and n not in self.leaving]
        covered = all(any(s <= layer < e for s, e in live) for layer in range(self.model.num_layers))
        if not covered and self._gap_since is None:
            self._gap_since = now
        elif covered and self._gap_since is not None:
            self.gaps.append((self._gap_since, now))
            self._gap_since = None

    def _note(self, now: float, what: str) -> None:
        self.timeline.append((now, what))

    def _sync_notes(self) -> None:
        """Copy what the membership noted since the last call (its history keeps the last few only)."""
        new = []
        for entry in reversed(self.membership.history):
            if entry is self._last_note:
                break
            new.append(entry)
        if new:
            self._last_note = new[0]
            self.timeline.extend(reversed(new))

    def _spec(self, node: str) -> NodeSpec:
        return self.membership.members[node].spec

    def report(self, now: float) -> dict[str, Any]:
        """The replay's figures (``SimResult.membership``)."""
        self._sync_notes()
        gaps = self.gaps + ([(self._gap_since, now)] if self._gap_since is not None else [])
        return {
            "requests_rerouted": self.reroutes.count,
            "lost_requests": self.sim.clients.failed - self.sim.clients.refused,
            "refused_requests": self.sim.clients.refused,
            "uncovered_s": sum(b - a for a, b in gaps),
            "uncovered": [[a, b] for a, b in gaps],
            "replans": [asdict(r) for r in self.replans.values()],
            "plan_version": self.membership.version,
            "placement": {n: list(r) for n, r in self.membership.plan.placement.items()},
            "unavailable": self.membership.unavailable or None,
            "timeline": [{"at_s": round(t, 3), "what": what} for t, what in sorted(self.timeline, key=lambda x: x[0])],
        }


def _union(spans: Spans) -> Spans:
    """Layer spans merged: ascending, apart (as the wire's ``held`` lists them)."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return tuple(out)


def _spans(held: Spans) -> tuple[wire.LayerSpan, ...]:
    return tuple(wire.LayerSpan(s, e) for s, e in held)
