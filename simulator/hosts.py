"""Nodes that share one host's cores (``SimConfig.host_cores``), shared as the OS shares them.

Processor sharing: an iteration starts at once, and while ``n`` iterations run on ``c`` cores
each advances at ``min(1, c / n)`` of its speed. Every start or finish changes the share, so the
running iterations' remaining work is brought up to date and their ends are scheduled again
(an end scheduled earlier goes stale: :attr:`SimNode.version` no longer matches).
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

    def start(self, node: SimNode, work_s: float, now: float, schedule_end: ScheduleEnd) -> None:
        """``node`` starts an iteration of ``work_s`` seconds of its own speed."""
        self._advance(now)
        node.remaining = work_s
        self.running.append(node)
        self._reschedule(now, schedule_end)

    def finish(self, node: SimNode, now: float, schedule_end: ScheduleEnd) -> None:
        """``node``'s iteration ended: the others get its share."""
        self._advance(now)
        self.running.remove(node)
        self._reschedule(now, schedule_end)

    def _rate(self) -> float:
        return min(1.0, self.cores / len(self.running)) if self.running else 1.0

    def _advance(self, now: float) -> None:
        done = (now - self.since) * self._rate()
        for node in self.running:
            node.remaining -= done
        self.since = now

    def _reschedule(self, now: float, schedule_end: ScheduleEnd) -> None:
        rate = self._rate()
        for node in self.running:
            node.version += 1
            schedule_end(now + max(0.0, node.remaining) / rate, node)
