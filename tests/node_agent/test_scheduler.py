"""The iteration-level scheduler as a pure policy: outputs are fabricated, no tensors run."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from helix.errors import CapacityError, EngineError
from node_agent.kv_account import KVAccount
from node_agent.scheduler import Batch, Scheduler, SchedulerConfig


def make(capacity: int = 1000, **kw: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw), KVAccount(capacity))  # type: ignore[arg-type]


def run_step(s: Scheduler, max_tokens: dict[str, int], generated: dict[str, int]) -> Batch:
    """Fabricate a step's outputs: a decode or last prompt chunk yields a token fed straight back."""
    batch = s.schedule()
    s.update(batch)
    finished = []
    for w in batch.work:
        if w.ends_prompt_or_decodes:
            generated[w.request_id] = generated.get(w.request_id, 0) + 1
            if generated[w.request_id] == max_tokens[w.request_id]:
                finished.append(w.request_id)
            else:
                s.add_input(w.request_id, 1)
    for rid in finished:
        s.remove(rid)
    return batch


def test_fcfs_admission_and_max_batch_size() -> None:
    s = make(max_batch_size=2, token_budget=64, chunk_size=8)
    for rid in "abc":
        s.add(rid, prompt_tokens=4, max_tokens=4, pending_tokens=4)
    batch = s.schedule()
    assert batch.admitted == ["a", "b"] and list(s.running) == ["a", "b"]
    # the step's 8 prefill tokens: the oldest prompt whole, then the next one's; c waits for a slot
    assert [(w.request_id, w.num_tokens) for w in batch.work] == [("a", 4), ("b", 4)]
    s.update(batch)
    s.remove("a")
    assert s.schedule().admitted == ["c"]


def test_chunk_size_prefill_tokens_per_step_plus_all_decodes_within_budget() -> None:
    s = make(max_batch_size=8, token_budget=10, chunk_size=6)
    for rid in "xyz":
        s.add(rid, prompt_tokens=1, max_tokens=50, pending_tokens=1)
    s.add("long", prompt_tokens=30, max_tokens=5, pending_tokens=30)
    max_tokens, generated = {"long": 5, "x": 50, "y": 50, "z": 50}, {}
    seen_decodes_with_chunk = False
    for _ in range(40):
        batch = run_step(s, max_tokens, generated)
        assert batch.num_tokens <= 10
        prefill = [w for w in batch.work if w.is_prefill]
        decodes = [w for w in batch.work if not w.is_prefill]
        assert all(w.num_tokens == 1 for w in decodes)
        assert sum(w.num_tokens for w in prefill) <= 6
        if prefill and prefill[0].request_id == "long" and len(decodes) == 3 and not prefill[0].ends_prompt_or_decodes:
            seen_decodes_with_chunk = True
            assert prefill[0].num_tokens == 6  # 3 decodes + 6 ≤ 10: capped by chunk size, not budget
    assert seen_decodes_with_chunk
    assert generated["long"] == 5


def test_chunked_step_packs_short_prompts_fcfs_up_to_chunk_size() -> None:
    s = make(max_batch_size=8, token_budget=64, chunk_size=10)
    for rid, n in [("a", 4), ("b", 3), ("c", 8)]:
        s.add(rid, prompt_tokens=n, max_tokens=5, pending_tokens=n)
    generated: dict[str, int] = {}
    first = run_step(s, dict.fromkeys("abc", 5), generated)
    # a and b whole, then c's first 3 tokens: 10 prefill tokens, FCFS
    assert _work(first) == [("a", 4, True), ("b", 3, True), ("c", 3, True)]
    assert [w.ends_prompt_or_decodes for w in first.work] == [True, True, False]
    second = run_step(s, dict.fromkeys("abc", 5), generated)
    assert _work(second) == [("a", 1, False), ("b", 1, False), ("c", 5, True)]


def test_chunked_step_takes_only_pending_input_then_the_next_prompt() -> None:
    s = make(max_batch_size=4, token_budget=64, chunk_size=8)
    s.add("down1", prompt_tokens=40, max_tokens=2)  # a later stage: hidden states arrive in pieces
    s.add("down2", prompt_tokens=10, max_tokens=2)
    s.add_input("down1", 3)
    s.add_input("down2", 10)
    assert _work(s.schedule()) == [("down1", 3, True), ("down2", 5, True)]


def test_token_budget_caps_the_prefill_chunk() -> None:
    s = make(max_batch_size=4, token_budget=5, chunk_size=100)
    s.add("p", prompt_tokens=12, max_tokens=1, pending_tokens=12)
    sizes = []
    while s.has_unfinished:
        batch = run_step(s, {"p": 1}, {})
        sizes.append(batch.num_tokens)
    assert sizes == [5, 5, 2]


def test_unchunked_prefill_runs_the_whole_prompt() -> None:
    s = make(max_batch_size=4, token_budget=8, chunk_size=None)
    s.add("p", prompt_tokens=300, max_tokens=2, pending_tokens=300)
    batch = s.schedule()
    assert batch.work[0].num_tokens == 300 and batch.work[0].ends_prompt_or_decodes


def _work(batch: Batch) -> list[tuple[str, int, bool]]:
    return [(w.request_id, w.num_tokens, w.is_prefill) for w in batch.work]


def test_unchunked_step_runs_several_whole_prompts_within_budget_fcfs() -> None:
    s = make(max_batch_size=8, token_budget=100, chunk_size=None)
    for rid, n in [("a", 30), ("b", 40), ("c", 50), ("d", 10)]:
        s.add(rid, prompt_tokens=n, max_tokens=5, pending_tokens=n)
    generated: dict[str, int] = {}
    first = run_step(s, dict.fromkeys("abcd", 5), generated)
    # a + b = 70 fit; c (50) does not fit the 30 left, and d may not overtake it (FCFS)
    assert _work(first) == [("a", 30, True), ("b", 40, True)]
    assert all(w.ends_prompt_or_decodes for w in first.work) and first.num_prefill_chunks == 2
    second = run_step(s, dict.fromkeys("abcd", 5), generated)
    # the two decodes first, then c and d together: 2 + 50 + 10 <= 100
    assert _work(second) == [("a", 1, False), ("b", 1, False), ("c", 50, True), ("d", 10, True)]


def test_unchunked_prefills_are_bounded_by_max_batch_size_and_kv_reservation() -> None:
    s = make(capacity=1000, max_batch_size=2, token_budget=4096, chunk_size=None)
    for rid in "abc":
        s.add(rid, prompt_tokens=100, max_tokens=10, pending_tokens=100)
    assert _work(s.schedule()) == [("a", 100, True), ("b", 100, True)]  # c waits: max batch 2
    s = make(capacity=250, max_batch_size=8, token_budget=4096, chunk_size=None)
    for rid in "abc":
        s.add(rid, prompt_tokens=100, max_tokens=10, pending_tokens=100)  # reserves 110 each
    batch = s.schedule()
    assert batch.admitted == ["a", "b"] and _work(batch) == [("a", 100, True), ("b", 100, True)]


def test_unchunked_oldest_prompt_runs_even_over_budget_but_alone() -> None:
    s = make(max_batch_size=4, token_budget=64, chunk_size=None)
    s.add("long", prompt_tokens=300, max_tokens=2, pending_tokens=300)
    s.add("short", prompt_tokens=5, max_tokens=2, pending_tokens=5)
    assert _work(s.schedule()) == [("long", 300, True)]


def test_unchunked_prefill_runs_only_the_pending_part_of_a_prompt() -> None:
    s = make(max_batch_size=4, token_budget=64, chunk_size=None)
    s.add("down1", prompt_tokens=40, max_tokens=2)  # a later stage: hidden states arrive in pieces
    s.add("down2", prompt_tokens=10, max_tokens=2)
    s.add_input("down1", 16)
    s.add_input("down2", 10)
    batch = s.schedule()
    assert _work(batch) == [("down1", 16, True), ("down2", 10, True)]
    assert [w.ends_prompt_or_decodes for w in batch.work] == [False, True]


def test_request_level_batch_prefills_together_then_decodes_together() -> None:
    s = make(max_batch_size=3, token_budget=4096, chunk_size=None, request_level=True)
    max_tokens = {"a": 2, "b": 4, "c": 3, "late": 1}
    for rid, n in [("a", 50), ("b", 7), ("c", 120)]:
        s.add(rid, prompt_tokens=n, max_tokens=max_tokens[rid], pending_tokens=n)
    generated: dict[str, int] = {}
    first = run_step(s, max_tokens, generated)
    assert _work(first) == [("a", 50, True), ("b", 7, True), ("c", 120, True)]
    s.add("late", prompt_tokens=3, max_tokens=1, pending_tokens=3)
    steps = [_work(run_step(s, max_tokens, generated)) for _ in range(3)]
    assert steps == [[("a", 1, False), ("b", 1, False), ("c", 1, False)],
                     [("b", 1, False), ("c", 1, False)], [("b", 1, False)]]  # late waits for the batch
    assert _work(run_step(s, max_tokens, generated)) == [("late", 3, True)]
    assert generated == max_tokens


def test_kv_reservation_blocks_admission_until_release() -> None:
    s = make(capacity=100, max_batch_size=8, token_budget=64, chunk_size=None)
    s.add("a", prompt_tokens=40, max_tokens=20, pending_tokens=40)  # reserves 60
    s.add("b", prompt_tokens=30, max_tokens=20, pending_tokens=30)  # 50: does not fit beside a
    s.add("c", prompt_tokens=1, max_tokens=1, pending_tokens=1)  # fits, but FCFS: no overtaking
    assert s.schedule().admitted == ["a"]
    assert s.kv_usage().reserved_tokens == 60 and s.kv_usage().free_tokens == 40
    s.remove("a")
    assert s.schedule().admitted == ["b", "c"]


def test_request_that_can_never_fit_is_refused() -> None:
    s = make(capacity=100)
    with pytest.raises(CapacityError, match="needs 101 KV tokens"):
        s.add("huge", prompt_tokens=81, max_tokens=20)
    assert not s.has_unfinished


def test_request_level_baseline_admits_only_into_an_empty_batch() -> None:
    s = make(max_batch_size=4, token_budget=64, chunk_size=None, request_level=True)
    s.add("a", prompt_tokens=2, max_tokens=3, pending_tokens=2)
    assert s.schedule().admitted == ["a"]
    s.add("b", prompt_tokens=2, max_tokens=3, pending_tokens=2)
    max_tokens, generated = {"a": 3, "b": 3}, {}
    run_step(s, max_tokens, generated)
    assert list(s.running) == ["a"]  # b waits although there is room
    while "a" in s:
        run_step(s, max_tokens, generated)
    assert s.schedule().admitted == ["b"]


def test_schedule_is_pure_until_update() -> None:
    s = make(max_batch_size=4, token_budget=16, chunk_size=4)
    s.add("a", prompt_tokens=10, max_tokens=2, pending_tokens=10)
    first = s.schedule()
    assert s.schedule().work == first.work


def test_requests_without_input_are_skipped() -> None:
    s = make(max_batch_size=4, token_budget=16, chunk_size=4)
    s.add("downstream", prompt_tokens=10, max_tokens=2)  # hidden states not arrived yet
    assert not s.schedule()
    s.add_input("downstream", 3)
    assert s.schedule().work[0].num_tokens == 3


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_never_deadlocks(seed: int) -> None:
    rng = random.Random(seed)
    s = make(capacity=300, max_batch_size=5, token_budget=24, chunk_size=rng.choice([None, 4, 16]))
    max_tokens: dict[str, int] = {}
    generated: dict[str, int] = {}
    for i in range(40):
        prompt, out = rng.randint(1, 200), rng.randint(1, 80)
        max_tokens[str(i)] = out
        s.add(str(i), prompt_tokens=prompt, max_tokens=out, pending_tokens=prompt)
    steps = 0
    while s.has_unfinished:
        batch = run_step(s, max_tokens, generated)
        assert batch, "a step with unfinished requests scheduled nothing: deadlock"
        assert s.kv.reserved_tokens <= 300
        steps += 1
    assert generated == max_tokens


def test_config_validation() -> None:
    with pytest.raises(EngineError, match="token_budget"):
        SchedulerConfig(max_batch_size=8, token_budget=4)
    with pytest.raises(EngineError, match="chunk_size"):
        SchedulerConfig(chunk_size=0)


def test_the_scheduler_and_its_kv_account_import_no_torch() -> None:
    """A simulator or a coordinator may drive the real scheduler without an engine."""
    code = "import sys, node_agent.scheduler, node_agent.kv_account; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
