"""Interleaved weighted round robin (IWRR) over one vertex's out-edges.

One :class:`IWRR` instance per compute node and one for the coordinator (Helix section 4.1).
Weights are the plan's max-flow values on the out-edges. The instance precomputes one cycle
of picks (``cycle_len`` slots) with the *smooth* weighted round robin rule, which spreads each
candidate evenly through the cycle (interleaved, no bursts) and gives every candidate
``round(cycle_len * w / sum(w))`` slots up to one. A pick is then a pointer advance: O(1)
when the next slot is admissible, O(k) over the k distinct candidates when some are masked.

Candidates with zero weight (valid edges the flow does not use) are kept as *fallbacks*:
they are offered, in round-robin order, only when every weighted candidate is excluded
(masked, dead, or already tried), so a pipeline still exists when the planned one is gone.
Deterministic: the same weights and the same sequence of calls give the same picks.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

DEFAULT_CYCLE_LEN = 1000


class IWRR:
    """Picks among ``candidates`` in proportion to ``weights``, skipping excluded ones."""

    __slots__ = ("candidates", "weights", "cycle", "_pos", "_fallbacks", "_fb_pos", "_order")

    def __init__(
        self,
        candidates: Sequence[str],
        weights: Sequence[float],
        *,
        cycle_len: int = DEFAULT_CYCLE_LEN,
        zero_tolerance: float = 1e-9,
    ) -> None:
        if len(candidates) != len(weights):
            raise ValueError("candidates and weights differ in length")
        if len(set(candidates)) != len(candidates):
            raise ValueError("duplicate candidate")
        if any(w < 0 for w in weights):
            raise ValueError("negative weight")
        self.candidates: tuple[str, ...] = tuple(candidates)
        self.weights: dict[str, float] = dict(zip(candidates, weights, strict=True))
        top = max(weights, default=0.0)
        positive = [(c, w) for c, w in zip(candidates, weights, strict=True) if w > zero_tolerance * max(top, 1.0)]
        self._fallbacks: tuple[str, ...] = tuple(c for c in candidates if c not in dict(positive))
        self._fb_pos = 0
        self.cycle: tuple[str, ...] = _smooth_cycle(positive, cycle_len) if positive else ()
        self._order = _next_slots(self.cycle)
        self._pos = 0

    def __len__(self) -> int:
        return len(self.candidates)

    def pick(self, excluded: Container[str] = (), admissible: Callable[[str], bool] | None = None) -> str | None:
        """The next candidate in IWRR order that is not ``excluded`` and passes ``admissible``.

        Advances the pointer past the returned slot. Returns None when no candidate (weighted
        or fallback) qualifies. Cost: O(1) when the next slot qualifies, else O(k) over the
        k distinct candidates (their next slots are precomputed for every position).
        """
        if self.cycle:
            pos = self._pos
            c = self.cycle[pos]
            if c not in excluded and (admissible is None or admissible(c)):
                self._pos = pos + 1 if pos + 1 < len(self.cycle) else 0
                return c
            for c, slot in self._order[pos]:
                if c not in excluded and (admissible is None or admissible(c)):
                    self._pos = slot + 1 if slot + 1 < len(self.cycle) else 0
                    return c
        fbs = self._fallbacks
        for k in range(len(fbs)):
            j = (self._fb_pos + k) % len(fbs)
            c = fbs[j]
            if c not in excluded and (admissible is None or admissible(c)):
                self._fb_pos = (j + 1) % len(fbs)
                return c
        return None

    def share(self, candidate: str) -> float:
        """The candidate's planned share of this vertex's picks (weight / total weight)."""
        total = sum(self.weights.values())
        return self.weights.get(candidate, 0.0) / total if total > 0 else 0.0


def _smooth_cycle(items: list[tuple[str, float]], length: int) -> tuple[str, ...]:
    """One cycle of smooth weighted round robin (nginx's rule) over real weights."""
    total = sum(w for _, w in items)
    current = [0.0] * len(items)
    out: list[str] = []
    for _ in range(max(length, len(items))):
        best = 0
        for i, (_, w) in enumerate(items):
            current[i] += w
            if current[i] > current[best]:
                best = i
        current[best] -= total
        out.append(items[best][0])
    return tuple(out)


def _next_slots(cycle: tuple[str, ...]) -> tuple[tuple[tuple[str, int], ...], ...]:
    """For every position: the other candidates with their next slot after it, nearest first."""
    n = len(cycle)
    if n == 0:
        return ()
    nxt: dict[str, int] = {}
    # walk the doubled cycle backwards so every position sees the next occurrence (wrapping)
    out: list[tuple[tuple[str, int], ...]] = [()] * n
    for i in range(2 * n - 1, -1, -1):
        if i < n:
            here = cycle[i]
            out[i] = tuple(sorted(((c, s % n) for c, s in nxt.items() if c != here), key=lambda cs: (cs[1] - i) % n))
        nxt[cycle[i % n]] = i
    return tuple(out)
