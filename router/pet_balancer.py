"""Balancing load by moving fine-tuned tasks' PETs between nodes (PetS section 2.3.2, Algorithm 3).

Nodes holding the same layers (a *replica group*, :func:`router.task_placement.replica_groups`)
are interchangeable for a request, except that a request for a task runs only on the nodes
holding its PET (:class:`router.task_placement.TaskPlacement`). When tasks' popularity is skewed,
a node holding the popular ones is overloaded while its replica idles. The coordinator counts each
task's requests per node over a window (:class:`LoadView`; counted at each attempt's first token by
:class:`TaskLoadObserver`, in ``helix serve`` and in the simulator alike); :class:`PetBalancer` then, per replica
group:

* computes the group's balance ``phi = L_min / L_max`` from PetS's ``L``, each node's mean queue:
  the requests in flight on it (queued or running) and those waiting at the coordinator for it
  (:meth:`router.core.CoordinatorCore.queues_by_node`), averaged over the window (:class:`QueueMeter`,
  sampled by the caller), when the queues are fresh: a request's mean time in flight (Little's law)
  within ``max_interval_s``; a queue of requests that stay longer holds the popularity of rounds ago.
  Otherwise ``L`` is the requests counted on the node over the window; both per unit of capacity;
* if ``phi < theta``, moves tasks greedily from the most to the least loaded node by the counts
  (Algorithm 3): of the tasks on the node with the most requests, the one whose move shrinks the
  spread of the counts ``max - min`` the most (its requests counted as the target's from now on),
  repeating while the spread shrinks and is more than chance (``noise_z`` standard deviations of
  the difference of two Poisson counts) or the queues say the same (the busier node's mean queue a
  whole request longer and ``theta`` times longer than the idler's: a node saturated by a popular
  task holds a queue long before a few requests a second add up to a spread beyond chance), at
  most ``max_moves`` moves a round, each task once and not again within ``settle_s``, never past a
  node's memory limit for PETs
  (``node_task_bytes``; a PET moved away whose source has not drained yet still counts there).
  Every request counted on a node is its load (the base model's, and those of tasks moved away
  since: they ran there); only the tasks it holds move;
* adapts the interval to the next round (PetS): ``phi < theta`` halves it (not below
  ``min_interval_s``), otherwise it grows by ``step_s`` (not above ``max_interval_s``).

Departures from the paper's listing, to move fewer PETs for the same balance: line 6 moves the
*least* requested task of the busiest node, which stops at once when that task had no request (the
spread does not shrink) and takes many small moves where one would do; here the move chosen is the
one that shrinks the spread most. A round moves nothing when ``phi >= theta``. And the spread must
exceed chance: PetS counted thousands of queries a window, where chance is negligible; at tens of
requests a window the counts' noise alone moves a popular task back and forth (measured:
bench/pets_migration.py).

A move to a node that already holds the task (every node holds a task no one restricted) is only
the source's unload. Pure and step-driven: the caller passes ``now`` and the counts, and carries
out the moves (:mod:`router.pet_migration`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from router.core_interfaces import CoreObserver
from router.request import Request
from router.task_placement import replica_groups


@dataclass(frozen=True, slots=True)
class BalancePolicy:
    """How often and how far PETs move (PetS's phi, theta and the adaptive interval)."""

    theta: float = 0.9  # a replica group with phi = L_min / L_max below this is rebalanced
    interval_s: float = 10.0  # the first interval between rounds
    min_interval_s: float = 1.0
    max_interval_s: float = 60.0
    step_s: float = 2.0  # the interval grows by this after a balanced round
    max_moves: int = 8  # PET moves per round at most
    min_requests: int = 32  # a window in which a replica group counted fewer requests is not judged (phi = 1; the caller keeps counting)
    noise_z: float = 2.0  # a spread within this many standard deviations of chance (Poisson counts) is no imbalance
    settle_s: float = 10.0  # a task moved less than this ago stays (its queues have not settled; PetS moved every 10 s)
    node_task_bytes: Mapping[str, int] = field(default_factory=dict)  # node -> most PET bytes it holds; absent: no limit

    def __post_init__(self) -> None:
        if not 0 < self.theta <= 1:
            raise ValueError(f"theta must be in (0, 1], got {self.theta}")
        if not 0 < self.min_interval_s <= self.interval_s <= self.max_interval_s:
            raise ValueError("the intervals must satisfy 0 < min_interval_s <= interval_s <= max_interval_s")
        if self.step_s < 0 or self.max_moves < 0 or self.min_requests < 0 or self.noise_z < 0 or self.settle_s < 0:
            raise ValueError("step_s, max_moves, min_requests, noise_z and settle_s must be >= 0")


@dataclass(frozen=True, slots=True)
class Move:
    """Task ``task``'s PET leaves ``src`` for ``dst`` (same layers); ``copy``: ``dst`` must load it first."""

    task: str
    src: str
    dst: str
    requests: float  # requests of the task counted on ``src`` in the window
    copy: bool


@dataclass(slots=True)
class LoadView:
    """What one round sees: the window's counts and who holds what."""

    counts: Mapping[tuple[str, str], float]  # (task, node) -> requests in the window; task "" is the base model
    layers: Mapping[str, tuple[int, int]]  # routable node -> the layers it holds
    tasks: Collection[str]  # the tasks that may move
    holders: Mapping[str, frozenset[str]]  # a task held by some nodes only -> those (absent: every node)
    task_bytes: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (task, node) -> bytes held there
    capacity: Mapping[str, float] = field(default_factory=dict)  # node -> relative capacity (absent: 1)
    draining_bytes: Mapping[str, int] = field(default_factory=dict)  # node -> PET bytes switched away, not yet freed
    queue: Mapping[str, float] = field(default_factory=dict)  # node -> mean requests in flight over the window (PetS's L)
    window_s: float = 0.0  # the span the queues were averaged over


@dataclass(slots=True)
class Round:
    """One round's verdict: the balance seen, the moves to make, the interval to the next round."""

    phi: float
    moves: list[Move]
    interval_s: float
    judged: bool = True  # False: too few requests were counted; the next round's window should include this one's


def imbalance(loads: Iterable[float]) -> float:
    """PetS's phi: the least load over the greatest (1 when nothing is loaded)."""
    values = list(loads)
    top = max(values, default=0.0)
    return min(values) / top if top > 0 else 1.0


def next_interval(interval_s: float, phi: float, policy: BalancePolicy) -> float:
    """Halve the interval while unbalanced, grow it by ``step_s`` while balanced, within the bounds."""
    if phi < policy.theta:
        return max(policy.min_interval_s, interval_s / 2)
    return min(policy.max_interval_s, interval_s + policy.step_s)


class QueueMeter:
    """Each node's mean requests in flight over a window (PetS's ``L``), from samples the caller takes as
    time goes (every sample holds until the next: a time average)."""

    def __init__(self) -> None:
        self._area: dict[str, float] = {}  # node -> requests x seconds since the window began
        self._span_s = 0.0
        self._last: tuple[float, Mapping[str, float]] | None = None

    def sample(self, now: float, in_flight: Mapping[str, float]) -> None:
        if self._last is not None:
            then, before = self._last
            dt = max(0.0, now - then)
            for node, n in before.items():
                self._area[node] = self._area.get(node, 0.0) + n * dt
            self._span_s += dt
        self._last = (now, dict(in_flight))

    def mean(self) -> dict[str, float]:
        """node -> mean requests in flight since the window began ({} before two samples)."""
        if self._span_s <= 0:
            return {}
        nodes = set(self._area) | set(self._last[1] if self._last else ())
        return {n: self._area.get(n, 0.0) / self._span_s for n in nodes}

    @property
    def span_s(self) -> float:
        """The seconds the samples since the window began cover."""
        return self._span_s

    def restart(self) -> None:
        """A new window from the last sample on."""
        self._area, self._span_s = {}, 0.0


class _Group:
    """One replica group's loads, tasks per node and PET bytes per node, as moves change them."""

    def __init__(self, nodes: list[str], view: LoadView, policy: BalancePolicy) -> None:
        self.nodes = nodes
        self.view = view
        self.cap = {n: view.capacity.get(n, 1.0) or 1.0 for n in nodes}
        self.on: dict[str, dict[str, float]] = {n: {} for n in nodes}  # node -> task it holds -> requests there
        self.counted = dict.fromkeys(nodes, 0.0)  # node -> every request counted there (base, tasks moved away)
        self.held = {t: view.holders.get(t) for t in view.tasks}
        for (task, node), count in view.counts.items():
            if node in self.on:
                self.counted[node] += count
                if task and self.holds(task, node):
                    self.on[node][task] = self.on[node].get(task, 0.0) + count
        self.loads = {n: self.counted[n] / self.cap[n] for n in nodes}
        self.used = {n: view.draining_bytes.get(n, 0) + sum(view.task_bytes.get((t, n), 0) for t in view.tasks
                                                           if self.holds(t, n)) for n in nodes}  # fmt: skip
        self.queue = self._fresh_queues(policy)

    def _fresh_queues(self, policy: BalancePolicy) -> dict[str, float]:
        """The nodes' mean queues per unit of capacity, when they say what the window's popularity does: a
        request's mean time in flight (Little: queued / counted x window) within ``max_interval_s``.
        Longer, and the queues hold the popularity of rounds ago ({}: the counts judge alone)."""
        queue, counted = self.view.queue, sum(self.counted.values())
        if not queue or not all(n in queue for n in self.nodes) or counted <= 0 or self.view.window_s <= 0:
            return {}
        in_flight_s = sum(queue[n] for n in self.nodes) / counted * self.view.window_s
        if in_flight_s > policy.max_interval_s:
            return {}
        return {n: queue[n] / self.cap[n] for n in self.nodes}

    def holds(self, task: str, node: str) -> bool:
        held = self.held.get(task)
        return held is None or node in held

    def nbytes(self, task: str, src: str, dst: str) -> int:
        return self.view.task_bytes.get((task, dst), self.view.task_bytes.get((task, src), 0))

    def noise(self, hi: str, lo: str, z: float) -> float:
        """``z`` standard deviations of the two nodes' load difference, requests counted as Poisson."""
        return z * math.sqrt(self.counted[hi] / self.cap[hi] ** 2 + self.counted[lo] / self.cap[lo] ** 2)

    def queues_agree(self, hi: str, lo: str, theta: float) -> bool:
        """Whether the mean queues say ``hi`` is busier than ``lo``: a whole request longer, and ``lo``'s below
        ``theta`` times ``hi``'s (per unit of capacity)."""
        if not self.queue:
            return False
        q_hi, q_lo = self.queue[hi], self.queue[lo]
        return q_hi - q_lo >= 1.0 and q_lo < theta * q_hi

    def balance(self) -> float:
        """The group's phi: by the mean queues when they are fresh (:meth:`_fresh_queues`), else by the counts."""
        return imbalance((self.queue or self.loads).values())

    def spread_after(self, hi: str, lo: str, count: float) -> float:
        after = dict(self.loads)
        after[hi] -= count / self.cap[hi]
        after[lo] += count / self.cap[lo]
        return max(after.values()) - min(after.values())

    def apply(self, move: Move) -> None:
        count = self.on[move.src].pop(move.task)
        self.on[move.dst][move.task] = self.on[move.dst].get(move.task, 0.0) + count
        self.loads[move.src] -= count / self.cap[move.src]
        self.loads[move.dst] += count / self.cap[move.dst]
        self.counted[move.src] -= count
        self.counted[move.dst] += count
        if move.copy:
            self.used[move.dst] += self.nbytes(move.task, move.src, move.dst)
        self.used[move.src] -= self.view.task_bytes.get((move.task, move.src), 0)
        held = self.held.get(move.task)
        self.held[move.task] = (frozenset(self.view.layers) if held is None else held) - {move.src} | {move.dst}


def plan_moves(nodes: list[str], view: LoadView, policy: BalancePolicy, settling: Collection[str] = ()) -> list[Move]:
    """Algorithm 3 on one replica group ``nodes``: the moves, in order (see the module doc); the tasks in
    ``settling`` (moved less than ``settle_s`` ago) stay."""
    group = _Group(nodes, view, policy)
    moved: set[str] = set(settling)
    moves: list[Move] = []
    while len(moves) < policy.max_moves:
        hi = max(nodes, key=lambda n: (group.loads[n], n))
        lo = min(nodes, key=lambda n: (group.loads[n], n))
        spread = group.loads[hi] - group.loads[lo]
        if spread <= group.noise(hi, lo, policy.noise_z) and not group.queues_agree(hi, lo, policy.theta):
            break
        best: tuple[float, float, str] | None = None
        for task, count in group.on[hi].items():
            if not task or count <= 0 or task in moved or task not in group.held:
                continue
            if not group.holds(task, lo):
                limit = policy.node_task_bytes.get(lo)
                if limit is not None and group.used[lo] + group.nbytes(task, hi, lo) > limit:
                    continue
            after = group.spread_after(hi, lo, count)
            if after < spread * (1 - 1e-9) and (best is None or (after, count, task) < best):
                best = (after, count, task)
        if best is None:
            break
        _, count, task = best
        move = Move(task, hi, lo, count, copy=not group.holds(task, lo))
        group.apply(move)
        moved.add(task)
        moves.append(move)
    return moves


class PetBalancer:
    """Decides, round after round, which PETs move (see the module doc). Step-driven: ``due(now)``,
    then ``step(now, view)`` with the counts of the window since the last round."""

    def __init__(self, policy: BalancePolicy, now: float) -> None:
        self.policy = policy
        self.interval_s = policy.interval_s
        self.next_s = now + self.interval_s
        self.moved_at: dict[str, float] = {}  # task -> when a round last moved it

    def due(self, now: float) -> bool:
        return now >= self.next_s

    def step(self, now: float, view: LoadView) -> Round:
        """Judge the window: phi (the worst replica group's), the moves of every group below theta, and
        the next interval (from now)."""
        policy = self.policy
        groups = [g for g in replica_groups(view.layers) if len(g) > 1]
        counted = {tuple(g): sum(c for (_, n), c in view.counts.items() if n in g) for g in groups}
        # every group must have counted min_requests: a request is counted once in each group its pipeline
        # crosses, so a sum over the groups (8 on a cluster of 8 layer ranges) judged windows of 4 requests,
        # whose chance spreads moved tasks back and forth every second
        judged = bool(groups) and min(counted.values()) >= max(policy.min_requests, 1)
        phis = {tuple(g): _Group(g, view, policy).balance() if judged else 1.0 for g in groups}
        settling = {t for t, at in self.moved_at.items() if now - at < policy.settle_s}
        moves = [m for g, phi in phis.items() if phi < policy.theta
                 for m in plan_moves(list(g), view, policy, settling)]  # fmt: skip
        self.moved_at = {t: at for t, at in self.moved_at.items() if t in settling} | {m.task: now for m in moves}
        phi = min(phis.values(), default=1.0)
        if judged:  # a window too small to judge says nothing about the balance: the interval stays
            self.interval_s = next_interval(self.interval_s, phi, policy)
        self.next_s = now + self.interval_s
        return Round(phi, moves, self.interval_s, judged)


class TaskLoadObserver:
    """The core's observer, plus a count of each attempt per (task, node) at its first token."""

    def __init__(self, inner: CoreObserver, count: Callable[[str, Sequence[str], float], None]) -> None:
        self.inner, self.count = inner, count

    def admitted(self, task: str, prompt_tokens: int) -> None:
        self.inner.admitted(task, prompt_tokens)

    def rejected(self, reason: str) -> None:
        self.inner.rejected(reason)

    def token(self, request: Request, edges: tuple[tuple[str, str], ...], moved: int, now: float) -> None:
        if request.attempt_tokens == 0 and request.pipeline is not None:
            self.count(request.params.task, request.pipeline.nodes, now)
        self.inner.token(request, edges, moved, now)

    def rerouted(self) -> None:
        self.inner.rerouted()

    def finished(self, request: Request, now: float) -> None:
        self.inner.finished(request, now)
