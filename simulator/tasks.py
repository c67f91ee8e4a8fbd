"""Fine-tuned tasks in the simulator (docs/pets.md, docs/simulator.md): which task each request runs,
and which tasks an iteration's spans touch.

:class:`TaskMix` is the workload's task mix: ``SimConfig.task_mix`` (PET type -> tasks, e.g.
``{"lora": 64}``; ``helix simulate --tasks``), or, when it is None, the cluster file's ``tasks:``
(:mod:`helix.task_memory`: their PET types). Every request runs one task drawn evenly from the
mix (seeded apart from the lengths and arrivals, so a base-only run draws nothing and keeps its
figures); an empty mix leaves every request on the base model. A node prices the tasks of its
iteration with :func:`span_tasks` and :meth:`helix.perf_model.NodeCurves.iteration_ms`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from helix.errors import ConfigError
from helix.perf_model import TaskGroup
from helix.profile import ModelProfile
from helix.spec import ClusterSpec
from helix.task_memory import task_memory
from helix.tasks import PET_TYPES

TASK_SEED_OFFSET = 104729  # the task draws' generator: seed + this (lengths and arrivals use their own)


class TaskMix:
    """Tasks named ``{type}-{i}`` by PET type, drawn evenly for each request."""

    def __init__(self, mix: Mapping[str, int], seed: int = 0) -> None:
        self.pet_of: dict[str, str] = {f"{pet}-{i}": pet for pet, n in mix.items() for i in range(n)}
        self.names = list(self.pet_of)
        self.rng = np.random.default_rng(seed + TASK_SEED_OFFSET)
        self._buf: list[int] = []

    def draw(self) -> str:
        """The task of the next request."""
        if not self._buf:
            self._buf = self.rng.integers(0, len(self.names), 4096).tolist()[::-1]
        return self.names[self._buf.pop()]

    @classmethod
    def resolve(cls, mix: Mapping[str, int] | None, cluster: ClusterSpec, model: ModelProfile,
                seed: int) -> TaskMix | None:  # fmt: skip
        """The run's mix: ``mix``, or the cluster's tasks when it is None; None when it has no task."""
        if mix is None:
            memory = task_memory(cluster, model.num_layers, model.dtype_bytes)
            mix = memory.pet_types if memory is not None else {}
        return cls(mix, seed) if sum(mix.values()) > 0 else None


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
