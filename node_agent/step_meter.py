"""What an agent tells its coordinators about its engine steps: each step's wall time, the
requests it batched and their tokens, counted since the agent started in the buckets the wire
fixes (:data:`helix.wire.STEP_STATS_BOUNDS`). The coordinator exposes them as Prometheus
histograms per node; the counts are cumulative, so a lost heartbeat loses nothing.

The engine thread records every step that ran something and publishes an immutable snapshot
(:attr:`StepMeter.stats`) that the I/O thread puts in the next HEARTBEAT: three bisects and one
small snapshot per step, no extra message.
"""

from __future__ import annotations

from bisect import bisect_left

from helix import wire


class StepMeter:
    """Per-bucket step counts (engine thread writes; ``stats`` is safe to read from any thread)."""

    __slots__ = ("_counts", "_totals", "stats")

    def __init__(self) -> None:
        self._counts = {name: [0] * (len(bounds) + 1) for name, bounds in wire.STEP_STATS_BOUNDS.items()}
        self._totals = dict.fromkeys(wire.STEP_STATS_BOUNDS, 0.0)
        self.stats = wire.StepStats()

    def record(self, seconds: float, sequences: int, tokens: int) -> None:
        """One step that ran ``sequences`` requests' ``tokens`` tokens in ``seconds`` of wall time."""
        for name, value in (("seconds", seconds), ("sequences", sequences), ("tokens", tokens)):
            self._counts[name][bisect_left(wire.STEP_STATS_BOUNDS[name], value)] += 1  # value <= bound
            self._totals[name] += value
        self.stats = wire.StepStats(**{name: wire.Distribution(tuple(counts), self._totals[name])
                                       for name, counts in self._counts.items()})
