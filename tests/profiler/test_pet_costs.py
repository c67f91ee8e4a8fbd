"""What fine-tuned tasks cost a step, measured the way the shared op is (profiler.pet_costs): a positive
per-task cost for LoRA on SmolLM2, nodes combined point by point, and the profile field it fills."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from helix.profile import ThroughputProfile
from profiler.nodes import combine
from profiler.pet_costs import measure_pet_costs


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """SmolLM2 converted once, where the other suites find it (a module fixture: before the isolated cache)."""
    from node_agent.gguf_convert import cached_model_dir

    return cached_model_dir()


def test_the_profiler_measures_what_lora_tasks_cost_on_smollm2(smollm2_dir: Path) -> None:
    import torch

    from node_agent.engine import StageEngine
    from node_agent.scheduler import SchedulerConfig

    torch.set_num_threads(1)
    sched = SchedulerConfig(max_batch_size=16, token_budget=256, chunk_size=None)
    engine = StageEngine(smollm2_dir, 1, 9, kv_capacity_tokens=4096, scheduler=sched)  # 8 layers
    notes: list[str] = []
    curves = measure_pet_costs(engine, ("lora",), (1, 16), 16, 3, time.thread_time, notes.append)
    lora = curves["lora"]
    assert [rows for rows, _ in lora] == [1.0, 16.0]
    # a task's LoRA op costs a layer something, well below the layer's shared op (2.5 ms for these 16 rows): at
    # one row a task's op is ~15 % of the step, clear of the machine's noise; at 16 rows ~5 %, which a median of
    # three may not always resolve (never below 0)
    assert 0 < lora[0][1] < 1.0 and 0 <= lora[1][1] < 1.0, lora
    assert notes[-1] == "lora tasks: round 4 of 4"
    assert not engine.has_unfinished and not engine.tasks  # every probe request and task is gone


def test_nodes_combine_their_task_curves_and_the_profile_reads_them() -> None:
    base = {"num_layers": 2, "prefill_ms_per_layer": [[0.0, 0.0], [8.0, 1.0]], "decode_ms_per_layer": [[0.0, 0.0], [1.0, 0.5]]}
    nodes = [base | {"pet_ms_per_layer": {"lora": [[1.0, ms], [16.0, 2 * ms]], "diff": [[1.0, 0.3], [16.0, 0.2]]}}
             for ms in (0.01, 0.03, 0.02)]  # fmt: skip
    out = combine([*nodes[:2], nodes[2] | {"pet_ms_per_layer": {"lora": [[1.0, 0.02], [16.0, 0.04]]}}])
    assert out["pet_ms_per_layer"] == {"lora": [[1.0, 0.02], [16.0, 0.04]]}  # only the types every node measured
    assert combine(nodes)["pet_ms_per_layer"]["diff"] == [[1.0, 0.25], [16.0, 0.25]]  # made non-decreasing
    assert "pet_ms_per_layer" not in combine([base, nodes[0]])
    tp = ThroughputProfile(max_layers=2, prefill_ms_per_layer=[(0, 0), (8, 1.0)], decode_ms_per_layer=[(0, 0), (1, 0.5)],
                           pet_ms_per_layer={"lora": [(1, 0.02), (16, 0.04)]})  # fmt: skip
    curves = tp.curves()
    assert curves is not None and curves.task_ms([("lora", 2.0, 8.0)]) == 2 * (0.02 + 0.02 * 7 / 15)
    old = ThroughputProfile(max_layers=2, prefill_ms_per_layer=[(0, 0), (8, 1.0)], decode_ms_per_layer=[(0, 0), (1, 0.5)])
    assert old.pet_ms_per_layer is None and old.curves().pet is None  # type: ignore[union-attr]  # an old profile: 0
