"""The serving search's last phase: its best placements, and small moves of them, judged by a short run
of our own simulator under both flows (``optimize(..., simulator=...)``; docs/planner-optimizer.md
section 6). The simulator is handed in (:class:`RunSimulation`): it imports the planner, never the
reverse.

The serving model (``planner.serving_model``) scores a placement in tens of milliseconds and is good to
about 10 % of the simulator, but its errors follow the placement's shape (on single24 it underrates
four-wide groups under the judge's flows and overrates long runs of single nodes), so a search that
ranks by it lands on what it overrates. The simulator (``simulator.engine``) runs the mechanisms
themselves; a short offline run costs about a second per flow on single24. So the search ends here:

1. **re-rank**: the model's :data:`SIM_TOP` best distinct placements, best first, are simulated
   offline (:data:`SIM_WARMUP_S` + :data:`SIM_MEASURE_S` simulated seconds, seed :data:`SIM_SEED`)
   routed by their balanced flows (what our router serves) and by the judge's flows
   (``SimConfig.flows = "judge"``: what a max-flow router such as the paper's simulator serves).
   A placement's score is the lower of the two decode tok/s: it has to serve under both;
2. **refine**: the model scores the best simulated placement's neighbourhood
   (``planner.local_search.neighbourhood``: whole-group boundary shifts, a node moved to another
   group, the local search's own moves), keeps the neighbours it rates within
   :data:`SIM_MODEL_SLACK` of that placement (it is good to about that much), and the simulator
   tries them best first; the first that beats the incumbent by :data:`SIM_MIN_GAIN` becomes it.
   The phase stops after :data:`SIM_PATIENCE` neighbours in a row that do not, or at the deadline.

A placement replaces the model's choice only when its simulated score is higher by more than
:data:`SIM_MIN_GAIN` (one seed, the same request lengths for every candidate; smaller differences
are noise). A simulation still running at the deadline is abandoned (the simulator's progress
callback), and none starts when the time left is shorter than the runs so far took. Clusters whose
GPUs have no latency curves (only ``tok_s`` tables) cannot be simulated: the phase is skipped.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from helix.domain import Placement
from helix.errors import HelixError
from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner.budget import Deadline
from planner.capacity import CapacityModel
from planner.flows import balanced_flows
from planner.local_search import Evaluator, Scored, neighbourhood

SIM_WARMUP_S = 60.0  # simulated seconds before the measured window (the offline feeder ramps up) ...
SIM_MEASURE_S = 240.0  # ... and measured: ranks single24's placements as 60 + 600 s does (section 14 of the notes)
SIM_SEED = 0
SIM_TOP = 6  # the model's best placements re-ranked by the simulator
SIM_MODEL_SLACK = 0.1  # neighbours the model rates this much below the incumbent are not simulated
SIM_MIN_GAIN = 0.01  # a simulated gain under this share is noise: the incumbent stays
SIM_PATIENCE = 8  # neighbours simulated in a row without a gain before the phase stops
SIM_NEIGHBOURS = 40  # neighbours the model scores per round (the boundary shifts first, then a sample)
FLOWS = ("plan", "judge")


@dataclass(frozen=True, slots=True)
class Refinement:
    """The phase's settings (``optimize(..., simulate=Refinement(...))``); the defaults are this module's."""

    warmup_s: float = SIM_WARMUP_S
    measure_s: float = SIM_MEASURE_S
    seed: int = SIM_SEED
    top: int = SIM_TOP
    patience: int = SIM_PATIENCE


@dataclass(frozen=True, slots=True)
class ShortRun:
    """What the refinement asks of one simulation: an offline run routed by ``flows`` ("plan": the
    plan's balanced flows; "judge": the judge's), ``warmup_s`` + ``measure_s`` simulated seconds."""

    flows: str
    warmup_s: float
    measure_s: float
    seed: int


@dataclass(frozen=True, slots=True)
class SimRun:
    """One simulation's figures: decode tok/s and p50 prompt and decode latency."""

    decode_tok_s: float
    prompt_p50_s: float
    decode_p50_s: float


class RunSimulation(Protocol):
    """Simulates ``plan`` on ``cluster``; ``progress(simulated_s)`` is called as it goes (and may raise
    to abandon the run). The simulator imports the planner, so the planner never imports it: the
    caller hands this in (``simulator.short_run.run_short``; ``helix plan`` gets it from the command
    line's composition root, ``helix.cli``)."""

    def __call__(self, cluster: ClusterSpec, profiles: ProfileSet, plan: Plan, run: ShortRun,
                 progress: Callable[[float], None]) -> SimRun: ...


@dataclass(frozen=True, slots=True)
class Simulated:
    """One placement's short simulation: decode tok/s under the plan's and the judge's flows, and the
    worse of the two runs' p50 latencies."""

    decode_tok_s: float
    judge_decode_tok_s: float
    prompt_p50_s: float
    decode_p50_s: float

    @property
    def score(self) -> float:
        return min(self.decode_tok_s, self.judge_decode_tok_s)


class _OutOfTime(Exception):
    """Raised from the simulator's progress callback when the deadline has passed."""


def simulable(cluster: ClusterSpec, profiles: ProfileSet) -> bool:
    """Whether every node's GPU has the latency curves the simulator needs."""
    try:
        return all(profiles.throughput(n.gpu, cluster.model).curves() is not None for n in cluster.nodes)
    except (HelixError, KeyError):
        return False


@dataclass(slots=True)
class SimScorer:
    """Simulates placements of one cluster (cached) and keeps how long a candidate takes."""

    cluster: ClusterSpec
    profiles: ProfileSet
    cap: CapacityModel
    simulator: RunSimulation
    partial_handoffs: bool = True
    warmup_s: float = SIM_WARMUP_S
    measure_s: float = SIM_MEASURE_S
    seed: int = SIM_SEED
    cache: dict[frozenset[tuple[str, tuple[int, int]]], Simulated] = field(default_factory=dict)
    candidates: int = 0
    wall_s: float = 0.0

    def cost_s(self) -> float:
        """Mean wall seconds per simulated candidate so far (both flows); 0 before the first."""
        return self.wall_s / self.candidates if self.candidates else 0.0

    def seen(self, pl: Placement) -> bool:
        return frozenset(pl.items()) in self.cache

    def score(self, pl: Placement, deadline: Deadline) -> Simulated | None:
        """Both flows' short simulation of ``pl``, or None when the deadline passed first."""
        key = frozenset(pl.items())
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        t0 = time.monotonic()
        value, edges = balanced_flows(self.cap, pl, partial_handoffs=self.partial_handoffs, deadline=deadline)
        plan = Plan(cluster=self.cluster.name, model=self.cluster.model, method="helix", placement=dict(pl),
                    max_flow_tok_s=value, flows=edges, partial_handoffs=self.partial_handoffs)

        def tick(_t: float) -> None:
            if deadline.expired():
                raise _OutOfTime

        runs = []
        for flows in FLOWS:
            try:
                runs.append(self.simulator(self.cluster, self.profiles, plan,
                                           ShortRun(flows, self.warmup_s, self.measure_s, self.seed), tick))
            except _OutOfTime:
                return None
        self.candidates += 1
        self.wall_s += time.monotonic() - t0
        got = Simulated(runs[0].decode_tok_s, runs[1].decode_tok_s,
                        max(r.prompt_p50_s for r in runs), max(r.decode_p50_s for r in runs))
        self.cache[key] = got
        return got


Report = Callable[[Scored, Simulated, str], None]


@dataclass(slots=True)
class Refined:
    """What the phase ends with: the chosen placement (model-scored) and its simulation, the model's
    own choice's simulation, and how many placements were simulated."""

    best: Scored
    simulated: Simulated
    model_choice: Simulated
    simulations: int
    stop_reason: str  # "patience" | "exhausted" | "time_limit"


def refine(ev: Evaluator, starts: list[Scored], scorer: SimScorer, *, deadline: Deadline, seed: int = 0,
           patience: int = SIM_PATIENCE, report: Report | None = None) -> Refined | None:
    """Re-rank ``starts`` (the model's best, best first) by simulation, then refine the best by
    simulated neighbourhood moves until ``patience`` misses in a row or ``deadline`` (``patience=0``:
    re-rank only). None when not even ``starts[0]`` could be simulated in time."""
    say = report or (lambda s, sim, msg: None)

    def fits() -> bool:  # do not start a candidate the time left cannot finish
        return not deadline.expired() and deadline.remaining() > scorer.cost_s()

    best: tuple[Scored, Simulated] | None = None
    model_choice: Simulated | None = None
    for i, st in enumerate(starts):
        if not fits():
            break
        sim = scorer.score(st.placement, deadline)
        if sim is None:
            break
        if model_choice is None:
            model_choice = sim
        if best is None or sim.score > best[1].score * (1 + SIM_MIN_GAIN):
            best = (st, sim)
            say(st, sim, f"simulated re-ranking ({i + 1} of {len(starts)})")
    if best is None or model_choice is None:
        return None
    rng = random.Random(seed)
    misses = 0
    stop = "time_limit"
    while True:
        if misses >= patience:
            stop = "patience"
            break
        if not fits():
            break
        cur, cur_sim = best
        near = neighbourhood(ev.cap, cur.placement, rng)
        shifts = [pl for pl in near if _is_boundary_shift(cur.placement, pl)]
        rest = [pl for pl in near if not _is_boundary_shift(cur.placement, pl)]
        pool = shifts + rng.sample(rest, min(len(rest), max(0, SIM_NEIGHBOURS - len(shifts))))
        floor = cur.key[0] * (1 - SIM_MODEL_SLACK)
        rated: list[Scored] = []
        for pl in pool:
            if deadline.expired():
                break
            if scorer.seen(pl) or not ev.valid(pl):
                continue
            sc = ev.score(pl)
            if sc.key[0] >= floor:
                rated.append(sc)
        rated.sort(key=lambda s: s.key, reverse=True)
        moved = False
        for sc in rated:
            if misses >= patience or not fits():
                break
            sim = scorer.score(sc.placement, deadline)
            if sim is None:
                break
            if sim.score > cur_sim.score * (1 + SIM_MIN_GAIN):
                best = (sc, sim)
                say(sc, sim, "simulated refinement")
                misses = 0
                moved = True
                break
            misses += 1
        if not moved and misses < patience and fits():
            stop = "exhausted"  # every neighbour the model keeps was simulated
            break
    return Refined(best[0], best[1], model_choice, scorer.candidates, stop)


def _is_boundary_shift(before: Placement, after: Placement) -> bool:
    """Whether ``after`` moves more than one node (a whole-group move of ``group_moves``)."""
    return sum(1 for n in before if before[n] != after.get(n)) > 1
