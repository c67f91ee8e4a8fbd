"""Bisection of a flow between a reachable and an unreachable one, by a feasibility test that may
prove either or give up: what every proven bound of :mod:`planner.bounds` and
:mod:`planner.link_bound` narrows with."""

from __future__ import annotations

from collections.abc import Callable

from planner.budget import Deadline

Feasible = Callable[[float], bool | None]  # True: reachable, False: proven unreachable, None: undecided


def bisect_unreachable(feasible: Feasible, lo: float, hi: float, *, rel_tol: float, deadline: Deadline) -> float:
    """The smallest flow proven unreachable, bisecting ``[lo, hi]`` (``hi`` already proven unreachable)
    until it is within ``rel_tol`` of ``hi``, the test gives up or ``deadline`` expires."""
    while hi - lo > rel_tol * hi and not deadline.expired():
        mid = (lo + hi) / 2
        res = feasible(mid)
        if res is False:
            hi = mid
        elif res is True:
            lo = mid
        else:
            break
    return hi
