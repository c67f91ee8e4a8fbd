"""A membership trace (``helix simulate --membership TRACE.yaml``): when nodes die, leave and join during
a simulated run, and how their replay is timed (:mod:`simulator.membership` replays it).

```yaml
policy: {grace_s: 5, min_interval_s: 10}  # optional: router.membership_types.MembershipPolicy's fields
detect_s: 1.8            # a death is noticed this long after it (helix serve --dead-after-s)
load_gb_per_s: 2.0       # a node loads new layers' weights at this rate
events:
  - {at_s: 120, kill: a100-0}                               # dies (no drain)
  - {at_s: 200, leave: l4-1}                                # leaves gracefully (SIGTERM: drains)
  - {at_s: 300, join: {id: l4-9, gpu: L4, region: us-east}}  # joins, holding no layers (helix agent --join)
```

A join names what ``POST /v1/cluster/join`` takes (a node of the cluster file's form: id, GPU type, region
(default: the coordinator's), address); a killed or departed node may join again under its id. :func:`load_membership_trace` checks the
file (pydantic, ``extra="forbid"``) and the events against the cluster, the plan and the profiles: every
problem is a :class:`~helix.errors.ConfigError` naming the file and the field (``events[2].kill``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from helix.errors import ConfigError
from helix.loading import load_model
from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec, NodeSpec
from router.membership_types import MembershipPolicy

DETECT_S = 1.8  # helix serve's --dead-after-s: an agent silent this long is dead
LOAD_GB_PER_S = 2.0  # an assumption (local NVMe read and host-to-device copy); set it from your disks
DRAIN_TIMEOUT_S = 30.0  # helix agent's --drain-timeout-s: a leaving agent finishes its requests within this


class TraceEvent(BaseModel):
    """One membership change at ``at_s`` simulated seconds: exactly one of ``kill``, ``leave``, ``join``."""

    model_config = ConfigDict(extra="forbid")

    at_s: float = Field(ge=0, description="simulated seconds from the start of the run")
    kill: str | None = Field(default=None, description="this node dies: its agent stops at once")
    leave: str | None = Field(default=None, description="this node leaves: it drains, then stops")
    join: NodeSpec | None = Field(default=None, description="this node joins, holding no layers")

    @model_validator(mode="after")
    def _one_change(self) -> TraceEvent:
        if sum(x is not None for x in (self.kill, self.leave, self.join)) != 1:
            raise ValueError("an event is exactly one of kill: NODE, leave: NODE or join: {id, gpu, region}")
        return self

    @property
    def node(self) -> str:
        return self.join.id if self.join is not None else self.kill or self.leave or ""

    @property
    def what(self) -> str:
        return "join" if self.join is not None else "kill" if self.kill is not None else "leave"


class MembershipTrace(BaseModel):
    """The file: the events and how their replay is timed (the module doc)."""

    model_config = ConfigDict(extra="forbid")

    events: list[TraceEvent] = Field(description="membership changes, in any order (replayed by time)")
    policy: dict[str, float] = Field(default={}, description="MembershipPolicy fields: when the coordinator re-plans")
    detect_s: float = Field(default=DETECT_S, ge=0, description="seconds from a death until the coordinator notices")
    load_gb_per_s: float = Field(default=LOAD_GB_PER_S, gt=0, description="GB/s a node loads new layers' weights at")
    drain_timeout_s: float = Field(default=DRAIN_TIMEOUT_S, ge=0,
                                   description="a leaving node refuses what it still runs after this")  # fmt: skip
    replan_s: float | None = Field(default=None, ge=0, description="simulated seconds a re-plan takes (default: the "
                                   "policy's replan_time_limit_s, which the planner runs to)")  # fmt: skip
    _source: str = PrivateAttr(default="")  # the file it was read from

    def membership_policy(self) -> MembershipPolicy:
        known = {f.name for f in dataclasses.fields(MembershipPolicy)}
        for key, value in self.policy.items():
            if key not in known:
                raise ConfigError(f"unknown setting (known: {', '.join(sorted(known))})", source=self._source,
                                  field=f"policy.{key}")  # fmt: skip
            if value < 0:
                raise ConfigError(f"must be at least 0, got {value}", source=self._source, field=f"policy.{key}")
        return MembershipPolicy(**self.policy)

    @property
    def replan_duration_s(self) -> float:
        return self.replan_s if self.replan_s is not None else self.membership_policy().replan_time_limit_s

    def ordered(self) -> list[tuple[int, TraceEvent]]:
        """The events with their index in the file, by time (ties: in file order)."""
        return sorted(enumerate(self.events), key=lambda ie: (ie[1].at_s, ie[0]))

    def check(self, cluster: ClusterSpec, plan: Plan, profiles: ProfileSet) -> None:
        """ConfigError for an event the cluster cannot take: a kill or leave of a node not serving then, a join
        of a taken id or an unknown GPU type (as ``POST /v1/cluster/join`` refuses it)."""
        self.membership_policy()
        up = set(plan.placement)
        gone: dict[str, float] = {}  # node -> when the coordinator knows it is gone, at the latest
        for i, ev in self.ordered():
            where = f"events[{i}].{ev.what}"
            if ev.join is None:
                if ev.node not in up:
                    raise ConfigError(f"node {ev.node!r} is not up at {ev.at_s:g} s (up then: {', '.join(sorted(up))})",
                                      source=self._source, field=where)  # fmt: skip
                up.discard(ev.node)
                gone[ev.node] = ev.at_s + self.detect_s + (self.drain_timeout_s if ev.leave is not None else 0.0)
                continue
            if ev.node == cluster.coordinator.id or ev.node in up:
                raise ConfigError(f"node id {ev.node!r} is taken at {ev.at_s:g} s", source=self._source,
                                  field=f"{where}.id")  # fmt: skip
            if ev.at_s < gone.get(ev.node, 0.0):
                raise ConfigError(f"node {ev.node!r} joins again at {ev.at_s:g} s, before the coordinator may know it "
                                  f"is gone ({gone[ev.node]:g} s: detect_s after it stopped, after drain_timeout_s "
                                  "when it left)", source=self._source, field=f"{where}.id")  # fmt: skip
            if ev.join.gpu not in profiles.gpus:
                raise ConfigError(f"GPU type {ev.join.gpu!r} has no profile here (known: "
                                  f"{', '.join(sorted(profiles.gpus))})", source=self._source, field=f"{where}.gpu")  # fmt: skip
            up.add(ev.node)


def load_membership_trace(path: str | Path, cluster: ClusterSpec, plan: Plan, profiles: ProfileSet) -> MembershipTrace:
    """Read and check a membership trace (the module doc)."""
    trace = load_model(MembershipTrace, path)
    trace._source = str(path)
    trace.check(cluster, plan, profiles)
    return trace
