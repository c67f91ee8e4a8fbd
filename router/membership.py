"""Live membership (issue 18): the coordinator's versioned view of its cluster and plan, and the policy
that re-plans it as nodes join, leave and die. Pure and step-driven like the core (:mod:`router.core`):
events in, actions out, the clock passed in; :mod:`router.membership_driver` runs it on the server's
event loop and carries its actions out (planner, agents, core, task registry).

**The view**: every member node with its state (:class:`MemberState`: joining, serving, standby,
leaving, dead), what its agent holds and serves as its own (its WELCOME, then its LAYERS answers),
the plan the core routes by and its ``version`` (0: the plan the server started with; a re-plan that
is routed gets the next number; one that is abandoned uses its number up, as the agents only take
growing versions), the reconfiguration in progress, and why the model cannot be served, if so.

**The policy** (:class:`MembershipPolicy`, defaults in brackets):

* a death waits ``grace_s`` [5 s] before re-planning (the node may come back: an agent restarted with
  the same layers is routed through again and nothing moves); a LEAVING re-plans at once, so new
  layers load elsewhere while the leaving agent drains; a node joining re-plans at once;
* at most one re-plan starts per ``min_interval_s`` [10 s], one reconfiguration at a time, and what
  changes meanwhile is planned for by the next one;
* when the nodes left cannot hold the model (the planner says so, naming the layers it lacks), the
  reason is ``unavailable``: the core answers 503 with it and /health is not ready; a new plan is
  tried as soon as the membership changes (a node comes back or joins);
* a reconfiguration that fails (a node cannot load its layers, a load or a task times out after
  ``load_timeout_s`` [120 s]) keeps the old plan and is tried again after ``retry_s`` [15 s]; one
  whose new plan lost a node (it died or left) is planned again by the rules above.

**A reconfiguration to plan v** (:class:`Phase`): PLANNING (``planner.replan`` in a worker process,
:class:`StartReplan` -> :class:`Replanned` or :class:`ReplanFailed`); LOADING (SET_LAYERS(v) to every
node whose range changes; every LAYERS ok awaited); TASKS (the registered fine-tuned tasks are sent
again to those nodes for their new layers, :class:`ReloadTasks` -> :class:`TasksReloaded`); the switch
(:class:`SwitchPlan`: the core routes by plan v, requests in flight keep their pipelines); RELEASING
(RELEASE_LAYERS(v, ``drain_s`` [30 s]) to those nodes, done when each answered). Dead and departed
members that plan v does not hold are forgotten at the switch (:class:`Forget`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict

from helix import wire
from helix.errors import ConfigError
from helix.plan import Plan
from helix.spec import ClusterSpec, NodeSpec
from router.agent_events import AgentDied, AgentJoined, AgentLeft
from router.holdings import spans
from router.membership_types import (
    Action,
    Dial,
    Forget,
    Member,
    MembershipEvent,
    MembershipPolicy,
    MemberState,
    Phase,
    Range,
    Reconfig,
    ReloadTasks,
    ReplanFailed,
    Replanned,
    Send,
    StartReplan,
    SwitchPlan,
    TasksReloaded,
    Unavailable,
)

log = logging.getLogger(__name__)


class Membership:
    """The versioned view and the re-planning policy (see the module doc)."""

    def __init__(self, cluster: ClusterSpec, plan: Plan, policy: MembershipPolicy | None = None, *,
                 now: float = 0.0) -> None:  # fmt: skip
        self.policy = policy or MembershipPolicy()
        self.plan, self.version = plan, 0
        self.members = {n: Member(n, cluster.node(n), MemberState.JOINING, now) for n in plan.placement}
        self.reconfig: Reconfig | None = None
        self.unavailable = ""  # why the model cannot be served now
        self.last_error = ""  # why the last reconfiguration failed
        self.history: deque[tuple[float, str]] = deque(maxlen=32)  # (time, what happened), newest last
        self._next_version = 1
        self._planned_over = frozenset(plan.placement)  # the nodes the routed plan was made for
        self._infeasible_for: frozenset[str] | None = None  # a membership the planner found too small
        self._last_start = self._retry_at = float("-inf")

    # -- inputs ------------------------------------------------------------------------------------

    def join(self, spec: NodeSpec, now: float) -> list[Action]:
        """A node asks to join (its agent is up, holding no layers): dial it. A connected member of the
        same id at the same address is a repeated ask (nothing to do); at another address, a ConfigError."""
        member = self.members.get(spec.id)
        if member is not None and member.spec.address == spec.address and \
                (member.connected or member.state is MemberState.JOINING):
            return []  # asked again while it is dialed or served
        if member is not None and member.connected and member.state is not MemberState.LEAVING:
            raise ConfigError(f"node id {spec.id!r} belongs to a connected member at {member.spec.address}",
                              field="node_id")  # fmt: skip
        if member is None:
            self.members[spec.id] = Member(spec.id, spec, MemberState.JOINING, now)
        else:
            member.spec, member.state, member.since = spec, MemberState.JOINING, now
        self._note(now, f"{spec.id} ({spec.gpu}) asks to join from {spec.address}")
        return [Dial(spec.id, spec.address or "")]

    def update(self, events: Iterable[MembershipEvent], now: float) -> list[Action]:
        out: list[Action] = []
        for event in events:
            out += self._apply(event, now)
        return out + self._due(now)

    def tick(self, now: float) -> list[Action]:
        """Timeouts, and re-plans that were waiting for a grace period or the rate limit."""
        return self._timeouts(now) + self._due(now)

    # -- queries -----------------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Members by state (every state, 0 included)."""
        return {s.value: sum(m.state is s for m in self.members.values()) for s in MemberState}

    def view(self, now: float) -> dict[str, object]:
        """What ``GET /v1/cluster`` shows."""
        r = self.reconfig
        return {
            "version": self.version,
            "plan": {"placement": {n: list(rng) for n, rng in self.plan.placement.items()},
                     "method": self.plan.method, "max_flow_tok_s": self.plan.max_flow_tok_s,
                     "replan": self.plan.stats.get("replan")},
            "members": [{"node": m.node, "state": m.state.value, "gpu": m.spec.gpu, "address": m.spec.address,
                         "connected": m.connected, "layers": _pair(self.plan.placement.get(m.node)),
                         "held": [list(h) for h in m.held], "for_s": round(now - m.since, 1)}
                        for m in sorted(self.members.values(), key=lambda m: m.node)],
            "reconfiguration": None if r is None else {
                "version": r.version, "phase": r.phase.value, "reasons": r.reasons, "nodes": list(r.nodes),
                "for_s": round(now - r.started, 1), "waiting_for": sorted(r.pending),
                "placement": None if r.plan is None else {n: list(g) for n, g in r.plan.placement.items()}},
            "unavailable": self.unavailable or None,
            "last_error": self.last_error or None,
            "policy": asdict(self.policy),
            "history": [{"ago_s": round(now - t, 1), "what": what} for t, what in self.history],
        }  # fmt: skip

    # -- events ------------------------------------------------------------------------------------

    def _apply(self, event: MembershipEvent, now: float) -> list[Action]:
        r = self.reconfig
        if isinstance(event, Replanned | ReplanFailed | TasksReloaded):
            if r is None or event.version != r.version:
                return []  # an abandoned reconfiguration's answer
            if isinstance(event, Replanned) and r.phase is Phase.PLANNING:
                return self._load(r, event.plan, now)
            if isinstance(event, ReplanFailed) and r.phase is Phase.PLANNING:
                return self._plan_failed(r, event, now)
            if isinstance(event, TasksReloaded) and r.phase is Phase.TASKS:
                return self._abort(f"tasks: {event.error}", now, retry=True) if event.error else self._switch(r, now)
            return []
        node = event.node if isinstance(event, AgentJoined | AgentDied | AgentLeft) else \
            event.node_id if isinstance(event, wire.Layers | wire.Leaving) else None
        member = self.members.get(node) if node is not None else None
        if member is None:
            return []
        if isinstance(event, AgentJoined):
            w = event.welcome
            self._next_version = max(self._next_version, w.version + 1)  # the agents take growing versions only
            member.connected, member.own, member.held = True, (w.layer_start, w.layer_end), \
                spans(w.held, w.layer_start, w.layer_end)
            if member.state is MemberState.LEAVING:
                member.state = MemberState.JOINING  # a new agent process
            self._settle(member, now)
        elif isinstance(event, AgentDied | AgentLeft):
            member.connected = False
            if isinstance(event, AgentLeft) or member.state is MemberState.LEAVING:
                self._note(now, f"{member.node} left")
                return self._lost(member, now) + self._gone(member)
            self._set(member, MemberState.DEAD, now)
            self._note(now, f"{member.node} died")
            return self._lost(member, now) + (self._gone(member) if member.node not in self.plan.placement else [])
        elif isinstance(event, wire.Leaving):
            self._set(member, MemberState.LEAVING, now)
            self._note(now, f"{member.node} is leaving (draining {event.running} requests)")
            return self._lost(member, now)
        elif isinstance(event, wire.Layers):
            if event.ok or event.layer_end:
                member.own, member.held = (event.layer_start, event.layer_end), \
                    spans(event.held, event.layer_start, event.layer_end)
            self._settle(member, now)
            return self._answered(member, event, now)
        return []

    def _answered(self, member: Member, msg: wire.Layers, now: float) -> list[Action]:
        r = self.reconfig
        if r is None or msg.version != r.version or member.node not in r.pending:
            return []
        if msg.op == "load" and r.phase is Phase.LOADING:
            if not msg.ok:
                return self._abort(f"{member.node} cannot load layers {_pair(r.plan.placement[member.node])}: "  # type: ignore[union-attr]
                                   f"{msg.error}", now, retry=True)  # fmt: skip
            log.info("%s loaded layers [%d, %d) of plan v%d in %.1f s", member.node, msg.layer_start, msg.layer_end,
                     r.version, msg.seconds)  # fmt: skip
            r.pending.discard(member.node)
            return [] if r.pending else self._tasks(r, now)
        if msg.op == "release" and r.phase is Phase.RELEASING:
            if not msg.ok:
                log.warning("%s did not release its old layers: %s", member.node, msg.error)
            r.pending.discard(member.node)
            if not r.pending:
                self._done(r, now)
        return []

    def _settle(self, m: Member, now: float) -> None:
        """A connected member's state from what it holds and what the routed plan gives it."""
        if not m.connected or m.state is MemberState.LEAVING:
            return
        rng = self.plan.placement.get(m.node)
        if rng is not None and any(s <= rng[0] and rng[1] <= e for s, e in m.held):
            self._set(m, MemberState.SERVING, now)
        elif rng is None and m.node in self._planned_over:
            self._set(m, MemberState.STANDBY, now)
        else:
            self._set(m, MemberState.JOINING, now)

    def _set(self, m: Member, state: MemberState, now: float) -> None:
        if m.state is not state:
            m.state, m.since = state, now

    def _gone(self, m: Member) -> list[Action]:
        """``m`` left for good: forget it now unless the routed plan still places it (then at the switch)."""
        if m.node in self.plan.placement:
            return []
        del self.members[m.node]
        return [Forget(m.node)]

    def _lost(self, m: Member, now: float) -> list[Action]:
        """``m`` died or leaves: drop a reconfiguration that was counting on it (not yet switched)."""
        r = self.reconfig
        if r is None or r.phase is Phase.RELEASING:
            if r is not None:
                r.pending.discard(m.node)
                if not r.pending:
                    self._done(r, now)
            return []
        if m.node in (r.plan.placement if r.plan is not None else r.nodes):
            gone = "died" if m.state is MemberState.DEAD else "left"
            return self._abort(f"{m.node} {gone} during the change", now, retry=False)
        return []

    # -- the reconfiguration ---------------------------------------------------------------------------

    def _due(self, now: float) -> list[Action]:
        """Start a re-plan if the membership calls for one and the policy allows it now."""
        if self.reconfig is not None:
            return []
        reasons: list[str] = []
        for node in self.plan.placement:
            m = self.members[node]
            if m.state is MemberState.LEAVING:
                reasons.append(f"{node} leaves")
            elif m.state is MemberState.DEAD:
                if now < m.since + self.policy.grace_s:
                    return []  # it may come back
                reasons.append(f"{node} died")
            elif m.connected and m.state is MemberState.JOINING:
                reasons.append(f"{node} lacks its layers")
        wanted = frozenset(n for n, m in self.members.items() if m.connected and m.state is not MemberState.LEAVING)
        reasons += [f"{n} joined" for n in sorted(wanted - self._planned_over)]
        if not reasons and self.unavailable:
            self.unavailable = ""
            return [Unavailable("")]
        if not reasons or not wanted or wanted == self._infeasible_for:
            return []
        if now < max(self._last_start + self.policy.min_interval_s, self._retry_at):
            return []
        r = self.reconfig = Reconfig(self._next_version, tuple(sorted(wanted)), reasons, now)
        self._next_version += 1
        self._last_start = now
        self._note(now, f"re-planning v{r.version} over {', '.join(r.nodes)}: {'; '.join(reasons)}")
        return [StartReplan(r.version, tuple(self.members[n].spec for n in r.nodes), self.plan)]

    def _plan_failed(self, r: Reconfig, event: ReplanFailed, now: float) -> list[Action]:
        self.reconfig = None
        self._note(now, f"re-plan v{r.version} failed: {event.reason}")
        if not event.infeasible:
            self.last_error, self._retry_at = event.reason, now + self.policy.retry_s
            return []
        self._infeasible_for = frozenset(r.nodes)
        self.unavailable = f"the {len(r.nodes)} node(s) left cannot serve the model: {event.reason}"
        return [Unavailable(self.unavailable)]

    def _load(self, r: Reconfig, plan: Plan, now: float) -> list[Action]:
        """Plan v is made: every node whose range changes loads its new one (SET_LAYERS)."""
        lost = [n for n in plan.placement if n not in self.members or not self.members[n].connected
                or self.members[n].state is MemberState.LEAVING]  # fmt: skip
        if lost:
            return self._abort(f"{', '.join(lost)} went away while planning", now, retry=False)
        r.plan, r.phase, r.started = plan, Phase.LOADING, now
        r.changed = tuple(n for n, rng in plan.placement.items() if self.members[n].own != tuple(rng))
        r.pending = set(r.changed)
        moves = "; ".join(f"{n} {_pair(self.members[n].own)} -> {_pair(plan.placement[n])}" for n in r.changed)
        self._note(now, f"plan v{r.version} made: {moves or 'no layer moves'}")
        out: list[Action] = [Send(n, wire.SetLayers(r.version, *plan.placement[n])) for n in r.changed]
        return out if r.pending else out + self._tasks(r, now)

    def _tasks(self, r: Reconfig, now: float) -> list[Action]:
        if not r.changed:
            return self._switch(r, now)
        r.phase, r.started = Phase.TASKS, now
        return [ReloadTasks(r.version, r.changed)]

    def _switch(self, r: Reconfig, now: float) -> list[Action]:
        """Route by plan v; forget the dead and departed it does not place; release the old layers."""
        assert r.plan is not None
        self.plan, self.version, self._planned_over = r.plan, r.version, frozenset(r.nodes)
        self._infeasible_for, self.last_error = None, ""
        out: list[Action] = [SwitchPlan(r.version, r.plan)]
        if self.unavailable:
            self.unavailable = ""
            out.append(Unavailable(""))
        for m in list(self.members.values()):
            departed = m.state is MemberState.LEAVING and not m.connected
            if m.node not in r.plan.placement and (m.state is MemberState.DEAD or departed):
                out += self._gone(m)
            self._settle(m, now)
        self._note(now, f"plan v{r.version} routed")
        r.phase, r.started, r.pending = Phase.RELEASING, now, set(r.changed)
        out += [Send(n, wire.ReleaseLayers(r.version, self.policy.drain_s)) for n in r.changed]
        if not r.pending:
            self._done(r, now)
        return out

    def _done(self, r: Reconfig, now: float) -> None:
        self.reconfig = None
        self._note(now, f"reconfiguration to v{r.version} done")

    def _abort(self, reason: str, now: float, *, retry: bool) -> list[Action]:
        """Keep the routed plan; try again later (``retry``: after ``retry_s``, else as the policy says)."""
        r = self.reconfig
        self.reconfig = None
        self.last_error = reason
        if retry:
            self._retry_at = now + self.policy.retry_s
        self._note(now, f"reconfiguration to v{r.version if r else '?'} dropped: {reason}")
        log.warning("reconfiguration dropped, plan v%d stays: %s", self.version, reason)
        return []

    def _timeouts(self, now: float) -> list[Action]:
        r = self.reconfig
        if r is None:
            return []
        if r.phase in (Phase.LOADING, Phase.TASKS) and now - r.started > self.policy.load_timeout_s:
            return self._abort(f"{', '.join(sorted(r.pending)) or 'the tasks'} did not answer within "
                               f"{self.policy.load_timeout_s:.0f} s", now, retry=True)  # fmt: skip
        if r.phase is Phase.RELEASING and now - r.started > self.policy.drain_s + self.policy.load_timeout_s:
            log.warning("%s did not confirm releasing their old layers", ", ".join(sorted(r.pending)))
            self._done(r, now)
        return []

    def _note(self, now: float, what: str) -> None:
        log.info("membership: %s", what)
        self.history.append((now, what))


def _pair(rng: Range | None) -> list[int] | None:
    return None if rng is None else [rng[0], rng[1]]
