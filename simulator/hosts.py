"""Nodes that share one host's cores (``SimConfig.host_cores``), shared as the OS shares them.

Processor sharing: an iteration starts at once, and while ``n`` iterations run on ``c`` cores
each advances at ``min(1, c / n)`` of its speed. Every start or finish changes the share, so the
running iterations' remaining work is brought up to date and their ends are scheduled again
(an end scheduled earlier goes stale: :attr:`SimNode.version` no longer matches).

Crowding: iterations that run at the same moment also share the host's caches and memory
bandwidth, so each is slower than alone even with a core to itself. A profile measured with
``together`` co-located nodes stepping at once (``helix profile --concurrent``) prices that
crowded iteration; its ``alone`` curves price the same iteration with the host to itself
(:class:`helix.profile.SteppingAlone`). An iteration's work is its alone price, and while ``k =
min(n, c)`` iterations run at once it advances ``1 + (crowded / alone - 1) * min(1, (k - 1) /
(together - 1))`` times slower (linear in the other steppers, the profile's crowding reached
when ``together`` step at once). Without ``alone`` curves the crowded price is the work at
every ``k``: the model before crowding was measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from simulator.nodes import SimNode

ScheduleEnd = Callable[[float, SimNode], None]  # (time, node): the node's iteration ends then


@dataclass(slots=True)
class SharedHost:
    cores: int
    running: list[SimNode] = field(default_factory=list)
    since: float = 0.0  # when the running iterations' remaining work was last brought up to date

    def start(self, node: SimNode, work_s: float, now: float, schedule_end: ScheduleEnd,
              alone_s: float | None = None) -> None:  # fmt: skip
        """``node`` starts an iteration of ``work_s`` seconds of its own speed as the profile prices it,
        ``alone_s`` of them with the host to itself (None: the same)."""
        self._advance(now)
        alone = work_s if alone_s is None else min(alone_s, work_s)
        node.remaining = alone
        node.crowding = work_s / alone - 1.0 if alone > 0 else 0.0
        self.running.append(node)
        self._reschedule(now, schedule_end)

    def finish(self, node: SimNode, now: float, schedule_end: ScheduleEnd) -> None:
        """``node``'s iteration ended: the others get its share."""
        self._advance(now)
        self.running.remove(node)
        self._reschedule(now, schedule_end)

    def _rate(self, node: SimNode) -> float:
        """Alone-seconds of work ``node``'s iteration does per second now."""
        n = len(self.running)
        share = min(1.0, self.cores / n)
        k = min(n, self.cores)
        if k < 2 or node.crowding <= 0.0:
            return share
        return share / (1.0 + node.crowding * min(1.0, (k - 1) / max(1, node.together - 1)))

    def _advance(self, now: float) -> None:
        elapsed = now - self.since
        for node in self.running:
            node.remaining -= elapsed * self._rate(node)
        self.since = now

    def _reschedule(self, now: float, schedule_end: ScheduleEnd) -> None:
        for node in self.running:
            node.version += 1
            schedule_end(now + max(0.0, node.remaining) / self._rate(node), node)
