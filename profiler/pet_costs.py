"""Measuring what fine-tuned tasks cost a step: ``pet_ms_per_layer``, per PET type (docs/pets.md).

On one probe stage (the longer middle stage of :func:`profiler.measure.measure_device`),
``pet_tasks`` random tasks of each type (:mod:`node_agent.pet_samples`: LoRA rank 8 on q/k/v/o, ...)
are bound, and for every ``rows`` in ``pet_rows`` two steps of the same shape are timed back to
back: ``pet_tasks`` prompts of ``rows`` tokens on the base model, and the same prompts each on a
task of its own. The shared op runs alike in both; the difference is what the tasks' ops cost::

    pet_ms_per_layer[type](rows) = median(task step - base step) / (layers * pet_tasks)

a point per ``rows``, the median over ``repeats`` rounds (after an untimed one; the two steps'
order alternates by round, as the context probe's do), never below 0 (``helix profile`` then
makes each curve non-decreasing, :func:`profiler.nodes.combine`). A task's rows are its prompt
tokens or decodes alike: its op costs by rows. What the engine does once per step for its tasks
(grouping the rows by task) is spread over the probe's layers: a few microseconds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

PROBE_TASK = "probe-{pet}-{i}"


def measure_pet_costs(engine: Any, pet_types: tuple[str, ...], pet_rows: tuple[int, ...], pet_tasks: int,
                      repeats: int, clock: Callable[[], float],
                      note: Callable[[str], None]) -> dict[str, list[list[float]]]:  # fmt: skip
    """PET type -> ``[[rows, ms per layer per task], ...]`` on ``engine`` (module docstring); the
    engine holds no request before or after."""
    import torch

    from node_agent.pet_samples import sample_pet
    from node_agent.sampling import SamplingParams

    if not pet_types or not pet_rows or pet_tasks < 1:
        return {}
    config, layers = engine.config, engine.layer_end - engine.layer_start
    sampling = SamplingParams(max_tokens=1)
    counter = iter(range(1 << 30))

    def timed(rows: int, tasks: list[str | None]) -> float:
        rids = []
        for task in tasks:
            rid = f"pet-probe-{next(counter)}"
            engine.add_request(rid, sampling, prompt_len=rows, task=task)
            engine.push_hidden(rid, torch.randn(rows, config.hidden_size))
            rids.append(rid)
        t0 = clock()
        engine.step()
        took = clock() - t0
        for rid in rids:
            engine.cancel(rid)
        return took

    base: list[str | None] = [None] * pet_tasks
    out: dict[str, list[list[float]]] = {}
    for pet in pet_types:
        names: list[str | None] = [PROBE_TASK.format(pet=pet, i=i) for i in range(pet_tasks)]
        for i, name in enumerate(names):
            engine.add_task(name, sample_pet(pet, config, seed=i, start=engine.layer_start, end=engine.layer_end))
        diffs: list[list[float]] = [[] for _ in pet_rows]
        for rnd in range(repeats + 1):
            note(f"{pet} tasks: round {rnd + 1} of {repeats + 1}" if rnd else f"{pet} tasks: untimed first round")
            for j, rows in enumerate(pet_rows):
                if rnd % 2:
                    with_tasks, alone = timed(rows, names), timed(rows, base)
                else:
                    alone, with_tasks = timed(rows, base), timed(rows, names)
                if rnd:
                    diffs[j].append(with_tasks - alone)
        for name in names:
            engine.remove_task(name)
        out[pet] = [[float(rows), round(max(0.0, statistics.median(d)) * 1000 / (layers * pet_tasks), 6)]
                    for rows, d in zip(pet_rows, diffs, strict=True)]  # fmt: skip
    return out
