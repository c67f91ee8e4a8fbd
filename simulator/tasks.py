"""Fine-tuned tasks in the simulator (docs/pets.md, docs/simulator.md): which task each request runs,
and which tasks an iteration's spans touch.

:class:`TaskMix` is the workload's task mix: ``SimConfig.task_mix`` (PET type -> tasks, e.g.
``{"lora": 64}``; ``helix simulate --tasks``), or, when it is None, the cluster file's ``tasks:``
(:mod:`helix.task_memory`: their PET types). Every request runs one task drawn from the mix (seeded
apart from the lengths and arrivals, so a base-only run draws nothing and keeps its figures): evenly,
or by a :class:`Popularity` (``helix simulate --task-popularity zipf:S``): Zipf with exponent ``S``
over a ranking of the tasks reshuffled every ``shift_s`` simulated seconds (each ranking seeded by
the run's seed and the shift's index). An empty mix leaves every request on the base model. A node
prices the tasks of its iteration with :func:`span_tasks` and
:meth:`helix.perf_model.NodeCurves.iteration_ms`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from helix.errors import ConfigError
from helix.perf_model import TaskGroup
from helix.profile import ModelProfile
from helix.spec import ClusterSpec
from helix.task_memory import task_memory
from helix.tasks import PET_TYPES

TASK_SEED_OFFSET = 104729  # the task draws' generator: seed + this (lengths and arrivals use their own)
RANKING_SEED_OFFSET = 7919  # a shift's ranking: seeded by (seed + this, the shift's index)


@dataclass(frozen=True, slots=True)
class Popularity:
    """How requests pick their task: Zipf with exponent ``zipf_s`` over a ranking reshuffled every
    ``shift_s`` simulated seconds (None: never); ``zipf_s`` None: evenly."""

    zipf_s: float | None = None
    shift_s: float | None = None

    def describe(self) -> str:
        if self.zipf_s is None:
            return "even"
        return f"zipf:{self.zipf_s:g}" + (f", reshuffled every {self.shift_s:g} s" if self.shift_s else "")


class TaskMix:
    """Tasks named ``{type}-{i}`` by PET type, drawn for each request by the run's :class:`Popularity`."""

    def __init__(self, mix: Mapping[str, int], seed: int = 0, popularity: Popularity | None = None) -> None:
        self.pet_of: dict[str, str] = {f"{pet}-{i}": pet for pet, n in mix.items() for i in range(n)}
        self.names = list(self.pet_of)
        self.seed = seed
        self.popularity = popularity or Popularity()
        self.rng = np.random.default_rng(seed + TASK_SEED_OFFSET)
        self._buf: list[int] = []
        self._uniform: list[float] = []
        self._shift = -1  # the shift whose ranking is in _ranked (Zipf)
        self._ranked: list[str] = []  # task names, most popular first
        zipf = self.popularity.zipf_s
        weights = np.arange(1, len(self.names) + 1, dtype=float) ** -(zipf or 0.0)
        self._cdf = np.cumsum(weights / weights.sum())

    def draw(self, now: float = 0.0) -> str:
        """The task of the next request, sent at simulated time ``now``."""
        if self.popularity.zipf_s is None:
            if not self._buf:
                self._buf = self.rng.integers(0, len(self.names), 4096).tolist()[::-1]
            return self.names[self._buf.pop()]
        if not self._uniform:
            self._uniform = self.rng.random(4096).tolist()[::-1]
        rank = int(np.searchsorted(self._cdf, self._uniform.pop(), side="right"))
        return self.ranking(now)[min(rank, len(self.names) - 1)]

    def ranking(self, now: float) -> list[str]:
        """The tasks, most popular first, at simulated time ``now`` (even popularity: the mix's order)."""
        shift_s = self.popularity.shift_s
        shift = int(now // shift_s) if shift_s else 0
        if self.popularity.zipf_s is None:
            return self.names
        if shift != self._shift:
            order = np.random.default_rng((self.seed + RANKING_SEED_OFFSET, shift)).permutation(len(self.names))
            self._ranked, self._shift = [self.names[i] for i in order], shift
        return self._ranked

    def shares(self, now: float) -> dict[str, float]:
        """Each task's share of the requests at ``now``."""
        probs = np.diff(self._cdf, prepend=0.0).tolist()
        return dict(zip(self.ranking(now), probs, strict=True))

    @classmethod
    def resolve(cls, mix: Mapping[str, int] | None, cluster: ClusterSpec, model: ModelProfile,
                seed: int, popularity: Popularity | None = None) -> TaskMix | None:  # fmt: skip
        """The run's mix: ``mix``, or the cluster's tasks when it is None; None when it has no task."""
        if mix is None:
            memory = task_memory(cluster, model.num_layers, model.dtype_bytes)
            mix = memory.pet_types if memory is not None else {}
        return cls(mix, seed, popularity) if sum(mix.values()) > 0 else None


def parse_popularity(text: str, shift_s: float | None) -> Popularity:
    """``--task-popularity`` (``even`` or ``zipf:S``, S > 0) and ``--popularity-shift-s`` (> 0; Zipf only)."""
    zipf: float | None = None
    if text != "even":
        kind, _, exponent = text.partition(":")
        try:
            zipf = float(exponent) if kind == "zipf" else math.nan
        except ValueError:
            zipf = math.nan
        if not zipf > 0 or math.isinf(zipf):
            raise ConfigError(f"expected even or zipf:S with an exponent S > 0 (e.g. zipf:1.1), got {text!r}",
                              field="--task-popularity")  # fmt: skip
    if shift_s is not None:
        if not shift_s > 0 or math.isinf(shift_s):
            raise ConfigError(f"must be a positive number of seconds, got {shift_s}", field="--popularity-shift-s")
        if zipf is None:
            raise ConfigError("reshuffles a skewed popularity: give --task-popularity zipf:S too",
                              field="--popularity-shift-s")  # fmt: skip
    return Popularity(zipf, shift_s)


def parse_task_mix(text: str) -> dict[str, int]:
    """``--tasks``: ``N`` (N LoRA tasks), ``TYPE:N,...`` (e.g. ``lora:32,adapter:8``), ``0``: none."""
    try:
        if ":" not in text:
            n = int(text)
            mix = {"lora": n} if n else {}
        else:
            mix = {pet.strip(): int(n) for pet, n in (part.split(":") for part in text.split(","))}
    except ValueError:
        raise ConfigError(f"expected N or TYPE:N,... (e.g. lora:32,adapter:8), got {text!r}", field="--tasks") from None
    for pet, n in mix.items():
        if pet not in PET_TYPES or n < 0:
            raise ConfigError(f"{pet}:{n}: a PET type ({', '.join(PET_TYPES)}) and a count >= 0", field="--tasks")
    return mix


def span_tasks(rows_by_start: Mapping[int, Mapping[str, int]], starts: Sequence[int],
               pet_of: Mapping[str, str]) -> list[list[TaskGroup]]:  # fmt: skip
    """Per span of an iteration (``starts``: the sorted first layers requests entered at; a span
    runs every request that entered at or before it), its tasks as (PET type, 1, rows) each;
    ``rows_by_start``: the rows of each task among the requests that entered at a start."""
    rows: dict[str, int] = {}
    out: list[list[TaskGroup]] = []
    for start in starts:
        for task, n in rows_by_start.get(start, {}).items():
            rows[task] = rows.get(task, 0) + n
        out.append([(pet_of[task], 1.0, float(n)) for task, n in rows.items()])
    return out


def group_tasks(rows_by_group: Mapping[int | tuple[int, int], Mapping[str, int]],
                members: Sequence[Sequence[int | tuple[int, int]]],
                pet_of: Mapping[str, str]) -> list[list[TaskGroup]]:  # fmt: skip
    """Per span of an iteration whose requests run different ranges (``members``: the groups of
    requests a span runs), its tasks as (PET type, 1, rows) each; ``rows_by_group``: the rows of each
    task among a group's requests."""
    out: list[list[TaskGroup]] = []
    for groups in members:
        rows: dict[str, int] = {}
        for group in groups:
            for task, n in rows_by_group.get(group, {}).items():
                rows[task] = rows.get(task, 0) + n
        out.append([(pet_of[task], 1.0, float(n)) for task, n in rows.items()])
    return out
