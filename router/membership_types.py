"""The vocabulary of live membership (:mod:`router.membership`): the re-planning policy, a member's
state, a reconfiguration's phases, and what :class:`router.membership.Membership` and its driver
(:mod:`router.membership_driver`) tell each other (events in, actions out). Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from helix import wire
from helix.plan import Plan
from helix.spec import NodeSpec
from router.agent_events import AgentEvent

Range = tuple[int, int]


@dataclass(frozen=True, slots=True)
class MembershipPolicy:
    """When the coordinator re-plans (the module doc); ``helix serve``'s ``--replan-*`` flags."""

    grace_s: float = 5.0  # after a death, wait this long before re-planning (the node may come back)
    min_interval_s: float = 10.0  # at most one re-plan starts per this many seconds
    replan_time_limit_s: float = 5.0  # the planner's time limit (planner.replan.ReplanOptions.time_limit_s)
    load_timeout_s: float = 120.0  # every SET_LAYERS (and task re-load) answered within this, or the change is dropped
    drain_s: float = 30.0  # RELEASE_LAYERS' drain: requests still on released layers after it are re-routed
    retry_s: float = 15.0  # after a failed reconfiguration


class MemberState(StrEnum):
    JOINING = "joining"  # its agent is connecting, or lacks the layers the plan gives it, or no plan holds it yet
    SERVING = "serving"  # connected and holding its range of the routed plan
    STANDBY = "standby"  # connected; the routed plan was made with it and gives it no layers
    LEAVING = "leaving"  # it said LEAVING: it drains, then stops
    DEAD = "dead"  # its heartbeats stopped


class Phase(StrEnum):
    PLANNING = "planning"
    LOADING = "loading"
    TASKS = "tasks"
    RELEASING = "releasing"


@dataclass(slots=True)
class Member:
    node: str
    spec: NodeSpec
    state: MemberState
    since: float  # when it entered its state
    connected: bool = False
    own: Range = (0, 0)  # the range its agent serves as its own
    held: tuple[Range, ...] = ()  # every span its agent holds


@dataclass(slots=True)
class Reconfig:
    version: int
    nodes: tuple[str, ...]  # the membership it plans for
    reasons: list[str]
    started: float  # when the current phase started
    phase: Phase = Phase.PLANNING
    plan: Plan | None = None
    changed: tuple[str, ...] = ()  # nodes given SET_LAYERS
    pending: set[str] = field(default_factory=set)  # nodes whose answer is awaited


# -- what the driver tells the membership (besides the agents' events) ------------------------------


@dataclass(frozen=True, slots=True)
class Replanned:
    version: int
    plan: Plan  # its stats["replan"] records the moves


@dataclass(frozen=True, slots=True)
class ReplanFailed:
    version: int
    reason: str
    infeasible: bool  # the nodes cannot hold the model


@dataclass(frozen=True, slots=True)
class TasksReloaded:
    version: int
    error: str = ""


MembershipEvent = AgentEvent | Replanned | ReplanFailed | TasksReloaded


# -- what it asks the driver to do --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartReplan:
    """Run ``planner.replan`` of ``plan`` over the membership ``nodes``; answer Replanned / ReplanFailed."""

    version: int
    nodes: tuple[NodeSpec, ...]
    plan: Plan


@dataclass(frozen=True, slots=True)
class Send:
    node: str
    message: wire.SetLayers | wire.ReleaseLayers


@dataclass(frozen=True, slots=True)
class ReloadTasks:
    """Send every registered task to ``nodes`` again (their layers changed); answer TasksReloaded."""

    version: int
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SwitchPlan:
    """Route by ``plan`` (made for StartReplan ``version``'s nodes) from now on."""

    version: int
    plan: Plan


@dataclass(frozen=True, slots=True)
class Dial:
    node: str
    address: str


@dataclass(frozen=True, slots=True)
class Forget:
    node: str


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Why the cluster cannot serve the model ("" once it can again)."""

    reason: str


Action = StartReplan | Send | ReloadTasks | SwitchPlan | Dial | Forget | Unavailable
