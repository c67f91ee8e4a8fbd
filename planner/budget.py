"""The time budget of one planning run, and why a search stopped.

One :class:`Deadline` is made when ``helix plan`` starts and handed to every phase (the
stage-pattern MILPs, the bound, the serving-model evaluation, the local search, the paper's
MILP): each phase asks it how long it may still run (``remaining`` / ``solver_limit`` for a
HiGHS time limit) and whether to stop (``expired``), and makes a shorter child deadline for
a share of the time (``within`` / ``share``). A child never outlives its parent. The clock
is injectable so the propagation is unit-tested with a fake clock.

A search stops for one of three reasons (:data:`STOP_REASONS`, the plan's ``stop_reason``):

* ``bound_met`` — the incumbent meets the proven upper bound within :data:`BOUND_REL_TOL`
  (nothing better exists);
* ``stalled`` — the incumbent has not improved for the stall window
  (:func:`stall_window_s`: ``max(STALL_MIN_S, STALL_FRACTION * time limit)`` by default,
  ``--stall-window`` on the command line, 0 = never);
* ``time_limit`` — the time limit ran out first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]

BOUND_MET = "bound_met"
STALLED = "stalled"
TIME_LIMIT = "time_limit"
STOP_REASONS = (BOUND_MET, STALLED, TIME_LIMIT)

BOUND_REL_TOL = 1e-4  # the incumbent "meets" the bound within this relative gap
STALL_MIN_S = 3.0  # the default stall window: at least this long ...
STALL_FRACTION = 0.25  # ... or this share of the time limit, whichever is longer
MIN_SOLVER_S = 0.01  # the shortest time limit handed to a solver (HiGHS rejects 0)


def stall_window_s(time_limit_s: float, stall_s: float | None = None) -> float | None:
    """The stall window for a time limit: ``stall_s`` if given (0 or less: never stall),
    else ``max(STALL_MIN_S, STALL_FRACTION * time_limit_s)``."""
    if stall_s is not None:
        return stall_s if stall_s > 0 else None
    return max(STALL_MIN_S, STALL_FRACTION * time_limit_s)


def describe_stop(reason: str | None, stall_s: float | None = None) -> str:
    """One line for a stop reason, for the command's output."""
    if reason == BOUND_MET:
        return "stopped early (bound_met): the plan meets the proven upper bound"
    if reason == STALLED:
        window = f" for {stall_s:g} s" if stall_s else ""
        return f"stopped early (stalled): no improvement{window}, the stall window (--stall-window)"
    if reason == TIME_LIMIT:
        return "stopped at the time limit (time_limit)"
    return ""


@dataclass(slots=True)
class Deadline:
    """A point in time (on ``clock``) by which a phase must be done; children end no later."""

    at: float
    clock: Clock = time.monotonic
    parent: Deadline | None = None
    stop: Callable[[], bool] | None = None  # an extra reason to stop early (e.g. a stalled search)

    @classmethod
    def after(cls, seconds: float, clock: Clock = time.monotonic) -> Deadline:
        return cls(clock() + max(0.0, seconds), clock)

    def now(self) -> float:
        return self.clock()

    def expired(self) -> bool:
        if self.clock() >= self.at or (self.stop is not None and self.stop()):
            return True
        return self.parent is not None and self.parent.expired()

    def remaining(self) -> float:
        """Seconds left (0 when expired or stopped)."""
        return 0.0 if self.expired() else max(0.0, self.at - self.clock())

    def within(self, seconds: float, *, stop: Callable[[], bool] | None = None) -> Deadline:
        """A child deadline ``seconds`` from now, capped by this one."""
        return Deadline(min(self.at, self.clock() + max(0.0, seconds)), self.clock, self, stop)

    def share(self, fraction: float, *, stop: Callable[[], bool] | None = None) -> Deadline:
        """A child deadline after ``fraction`` of the time that is left."""
        return self.within(fraction * self.remaining(), stop=stop)

    def until(self, at: float) -> Deadline:
        """A child deadline at ``at`` on this clock, capped by this one."""
        return Deadline(min(self.at, at), self.clock, self)

    def solver_limit(self, cap_s: float | None = None) -> float:
        """The time limit to hand a solver now: what is left, at most ``cap_s``."""
        left = self.remaining()
        if cap_s is not None:
            left = min(left, cap_s)
        return max(MIN_SOLVER_S, left)


@dataclass(slots=True)
class StallWatch:
    """Tracks when the incumbent last improved; :meth:`stalled` once the window has passed."""

    clock: Clock
    window_s: float | None
    last_improved: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.last_improved = self.clock()

    def improved(self) -> None:
        self.last_improved = self.clock()

    def stalled(self) -> bool:
        return self.window_s is not None and self.clock() - self.last_improved >= self.window_s


def bound_met(value: float, bound: float | None) -> bool:
    return bound is not None and value >= bound * (1 - BOUND_REL_TOL)
