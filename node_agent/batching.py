"""Which requests join an agent's steps when they run many fine-tuned tasks: PetS's coordinated batching
(§2.3.1 of ``../shared/seeds/002_37011a6ad67ebb7d.txt``, issue 19), adapted to iteration-level batching.

PetS prices a batch as α (the shared op: every query through the base weights) plus, for every task
in it, β of the task's PET type (its op on the task's rows), and chooses batches with two dynamic
programs: per task, *mini-batches* by β; then *macro-batches* of mini-batches by α. Helix's engine
pads nothing and forms every step anew, but the tension is the same: a step pays one PET op per
task it touches, on every layer (on this project's CPU engine 32 decodes over 32 tasks of mixed
types cost 1.6× the same decodes on the base model, over 4 tasks 1.2×; docs/pets.md), and the
running set decides which tasks every decode step touches. So a policy here chooses which waiting
requests are admitted (:func:`admission_order`) and, for β-only, which ready requests a step runs
(:func:`beta_only_ready`):

* ``fcfs`` (the default): the scheduler as it was (:mod:`node_agent.scheduler`): admission in arrival
  order, every ready request in every step. Nothing here runs.
* ``alpha`` (PetS's α-only; TurboTransformers' smart batching): task-blind. Waiting requests by prompt
  length (shortest first), into every free slot (with β = 0 every request adds the same α).
* ``beta`` (PetS's β-only: mini-batches run as they are): admission task by task, the lowest β per
  row first, α unused; a step runs the ready requests of one task, the one whose rows cost least
  per row by β (plus any request passed over too long).
* ``coordinated``: mini-batches by β, combined by α. Every ready request runs in every step (a task
  a step skips costs its β again in the step that runs it); admission takes a task's waiting
  requests together (its mini-batch), tasks already running first (β then costs only the rows it
  adds), then the mini-batch whose rows add least per row to the running set's decode step
  (α's growth plus the task's β: large mini-batches of cheap PET types first), into every free slot.

**Mini-batches without padding.** PetS's Bellman split of a task's length-sorted queue (its eq. 3)
trades padding against β's batching; here rows are not padded and β is concave in rows (a LoRA
task's op costs 0.025 ms a layer at one row, 0.073 at 16: docs/notes/pet-costs.md), so the split
keeps a task's waiting requests together: one mini-batch per task, cut to the free slots. And α is
concave (a decode step of 32 requests costs 2.8× one of 1), so PetS's α program makes the largest
macro-batch the step allows: admission fills every free slot. (Leaving a slot free for a cheaper
mini-batch later only defers the request: run alone or later it still pays its task's β, and the
run takes more steps: the cost model priced 48 requests over 16 tasks 7 % slower so, and 256 to
1,024 over 128 tasks no faster.)

**Starvation bound.** A request is *passed over* in a step when it could have joined and did not:
ready and not run, or among the waiting requests FCFS would have admitted into the free slots and
not admitted. Once passed over ``max_passed_over_steps`` steps since it last joined one, it is
*forced*: admitted before any other (oldest first) and run in every step it is ready. So no request is passed over more than that many steps, unless
more forced requests than a step holds wait at once (they then go oldest first).

**The cost models** (:class:`StepCostModel`) come from the node's profile (``helix profile``): α from
the shared op's curves (``prefill_ms_per_layer``, ``decode_ms_per_layer``, ``step_overhead_ms``), β
from ``pet_ms_per_layer``, both over the stage's layers (:mod:`helix.perf_model` reads them). Pure:
no torch, no clock; the scheduler keeps the state (who was passed over) and calls these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, TypeVar

from helix.errors import EngineError
from helix.perf_model import NodeCurves

DEFAULT_MAX_PASSED_OVER_STEPS = 16
TaskKey = tuple[str | None, str | None]  # (task name, PET type); (None, None): the base model


class BatchingMode(StrEnum):
    FCFS = "fcfs"
    ALPHA = "alpha"
    BETA = "beta"
    COORDINATED = "coordinated"


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """α and β of one stage, in ms over its ``layers`` (module docstring)."""

    curves: NodeCurves
    layers: int

    def alpha_ms(self, prompt_tokens: float, decodes: float) -> float:
        """The shared op of a step of ``prompt_tokens`` and ``decodes``: every layer, then the per-step cost."""
        c = self.curves
        return self.layers * (c.prefill.at(prompt_tokens) + c.decode_ms(decodes)) \
            + c.fixed_ms(prompt_tokens + decodes, 0, 0.0)

    def beta_ms(self, pet_type: str | None, rows: float) -> float:
        """One task's PET op on ``rows`` of a step, every layer; 0 for the base model or an unmeasured type."""
        curve = self.curves.pet.get(pet_type) if self.curves.pet and pet_type else None
        return self.layers * curve.at(rows) if curve is not None else 0.0


@dataclass(frozen=True, slots=True)
class BatchingPolicy:
    """A mode, its starvation bound and (for every mode but ``fcfs``) the cost models."""

    mode: BatchingMode = BatchingMode.FCFS
    max_passed_over_steps: int = DEFAULT_MAX_PASSED_OVER_STEPS
    costs: StepCostModel | None = None

    def __post_init__(self) -> None:
        if self.max_passed_over_steps < 1:
            raise EngineError(f"max_passed_over_steps must be >= 1, got {self.max_passed_over_steps}")
        if self.mode is not BatchingMode.FCFS and self.costs is None:
            raise EngineError(f"batching mode {self.mode}: needs the node's cost models (α and β from its profile)")

    @property
    def fcfs(self) -> bool:
        return self.mode is BatchingMode.FCFS

    def forced(self, request: Candidate) -> bool:
        return request.passed_over >= self.max_passed_over_steps


FCFS = BatchingPolicy()  # the default: the scheduler as it was


class Candidate(Protocol):
    """What the policy reads of a request (the scheduler's ``SequenceState``)."""

    @property
    def request_id(self) -> str: ...
    @property
    def task(self) -> str | None: ...
    @property
    def pet_type(self) -> str | None: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def passed_over(self) -> int: ...


C = TypeVar("C", bound=Candidate)


def task_key(request: Candidate) -> TaskKey:
    return request.task, request.pet_type


def admission_order(policy: BatchingPolicy, waiting: Sequence[C], running: Iterable[Candidate],
                    slots: int) -> list[C]:  # fmt: skip
    """The waiting requests (in arrival order) to admit into ``slots`` free places, in the order to
    admit them: forced ones first, then by the policy's mode (module docstring)."""
    if slots <= 0 or not waiting:
        return []
    forced = [w for w in waiting if policy.forced(w)][:slots]
    rest = [w for w in waiting if not policy.forced(w)]
    slots -= len(forced)
    mode = policy.mode
    if mode is BatchingMode.FCFS or not rest or slots <= 0:
        return forced + rest[:slots]
    costs = policy.costs
    assert costs is not None  # BatchingPolicy checks it
    rows: dict[TaskKey, int] = {}
    for key in (*map(task_key, running), *map(task_key, forced)):
        rows[key] = rows.get(key, 0) + 1
    if mode is BatchingMode.ALPHA:
        shortest = sorted(rest, key=lambda w: w.prompt_tokens)[:slots]  # β = 0: each adds the same α
        return forced + _fill([[w] for w in shortest], rows, slots, lambda pet_type, n: 0.0, costs)
    groups = list(_mini_batches(rest).values())
    if mode is BatchingMode.BETA:
        groups.sort(key=lambda g: costs.beta_ms(g[0].pet_type, len(g)) / len(g))
        return forced + [w for g in groups for w in g][:slots]
    return forced + _fill(groups, rows, slots, costs.beta_ms, costs)


def _mini_batches(requests: Iterable[C]) -> dict[TaskKey, list[C]]:
    """Each task's requests, in order: one mini-batch per task (module docstring)."""
    out: dict[TaskKey, list[C]] = {}
    for r in requests:
        out.setdefault(task_key(r), []).append(r)
    return out


def _fill(groups: list[list[C]], rows: dict[TaskKey, int], slots: int, beta: Callable[[str | None, float], float],
          costs: StepCostModel) -> list[C]:  # fmt: skip
    """Macro-batching by α: add the group that adds least per row to the running set's decode step
    (α's growth plus the task's β, cut to the free slots) until the slots are full."""
    picked: list[C] = []
    running = sum(rows.values())
    groups = [g for g in groups if g]
    while groups and slots > 0:
        alpha = costs.alpha_ms(0, running)
        best, best_cost = 0, float("inf")
        for i, g in enumerate(groups):
            m, key = min(len(g), slots), task_key(g[0])
            n = rows.get(key, 0)
            cost = (costs.alpha_ms(0, running + m) - alpha + beta(key[1], n + m) - beta(key[1], n)) / m
            if cost < best_cost:
                best, best_cost = i, cost
        group = groups.pop(best)
        m, key = min(len(group), slots), task_key(group[0])
        picked += group[:m]
        rows[key] = rows.get(key, 0) + m
        running, slots = running + m, slots - m
    return picked


def beta_only_ready(policy: BatchingPolicy, ready: Sequence[C], rows_of: Callable[[C], int]) -> list[C]:
    """β-only's step: the forced ready requests and those of the one task whose rows (``rows_of``:
    what each would run) cost least per row by β; ``ready`` in admission order, kept in it."""
    costs = policy.costs
    assert costs is not None
    groups = _mini_batches(r for r in ready if not policy.forced(r))
    if not groups:
        return list(ready)

    def per_row(group: list[C]) -> float:
        n = sum(rows_of(r) for r in group)
        return costs.beta_ms(group[0].pet_type, n) / max(n, 1)

    chosen = min(groups, key=lambda k: per_row(groups[k]))
    return [r for r in ready if policy.forced(r) or task_key(r) == chosen]
