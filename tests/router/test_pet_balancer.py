"""PET migration's balancer (issue 19 part 3, PetS Algorithm 3) on fabricated request counts.

The layers: cpu-1 and cpu-2 both hold [0, 16) (a replica group), cpu-0 holds [16, 30) alone, so
only tasks on cpu-1 and cpu-2 can move, and only between them.
"""

from __future__ import annotations

import pytest

from router.kv import KVEstimator
from router.pet_balancer import (
    BalancePolicy,
    LoadView,
    Move,
    PetBalancer,
    QueueMeter,
    imbalance,
    next_interval,
    plan_moves,
)

LAYERS = {"cpu-0": (16, 30), "cpu-1": (0, 16), "cpu-2": (0, 16)}
GROUP = ["cpu-1", "cpu-2"]
SPLIT = {"a": "cpu-1", "b": "cpu-1", "c": "cpu-1", "d": "cpu-2", "e": "cpu-2"}  # one node of the group each


def view(counts: dict[str, float], *, on: dict[str, str] = SPLIT, base: dict[str, float] | None = None,
         **kw: object) -> LoadView:  # fmt: skip
    """Each task's requests counted on its node of the group and on cpu-0; ``base``: the base model's, by node."""
    counted = {(t, on[t]): c for t, c in counts.items()} | {(t, "cpu-0"): c for t, c in counts.items()}
    counted |= {("", n): c for n, c in (base or {}).items()}
    holders = {t: frozenset({n, "cpu-0"}) for t, n in on.items()}
    return LoadView(counted, LAYERS, list(on), holders, **kw)  # type: ignore[arg-type]


def test_the_busiest_nodes_tasks_move_to_the_idlest_while_the_spread_shrinks() -> None:
    exact = BalancePolicy(noise_z=0.0)  # Algorithm 3 as listed: any spread is an imbalance
    moves = plan_moves(GROUP, view({"a": 50, "b": 30, "c": 10, "d": 5, "e": 5}), exact)
    # 90 vs 10: moving a or b leaves a spread of 20 (b, the fewer requests, goes); then c evens it at 50 each
    assert moves == [Move("b", "cpu-1", "cpu-2", 30, copy=True), Move("c", "cpu-1", "cpu-2", 10, copy=True)]
    # a spread within two standard deviations of chance (60 vs 40: 2 x sqrt(100) = 20) is left alone
    assert [m.task for m in plan_moves(GROUP, view({"a": 50, "b": 30, "c": 10, "d": 5, "e": 5}),
                                       BalancePolicy())] == ["b"]  # fmt: skip
    close = view({"a": 9, "b": 3, "d": 6})  # 12 vs 6: within chance of 9 vs 9
    assert [m.task for m in plan_moves(GROUP, close, exact)] == ["b"] and not plan_moves(GROUP, close, BalancePolicy())


def test_an_idle_or_oversized_task_does_not_stop_the_balancing() -> None:
    counts = {"a": 50, "b": 30, "c": 0, "d": 5, "e": 5}  # PetS's least-requested rule would stop at c at once
    assert [m.task for m in plan_moves(GROUP, view(counts), BalancePolicy(noise_z=0))] == ["b"]
    bytes_ = {(t, n): 100 for t in SPLIT for n in LAYERS}
    policy = BalancePolicy(noise_z=0, node_task_bytes={"cpu-2": 300})  # cpu-2 holds d and e: room for one more
    moves = plan_moves(GROUP, view({"a": 50, "b": 30, "c": 10, "d": 5, "e": 5}, task_bytes=bytes_), policy)
    assert [m.task for m in moves] == ["b"]
    tight = BalancePolicy(noise_z=0, node_task_bytes={"cpu-2": 250})
    assert plan_moves(GROUP, view({"a": 50, "b": 30, "d": 5, "e": 5}, task_bytes=bytes_), tight) == []
    # a PET moved away from cpu-2 and not yet freed there (its requests still draining) takes the room
    assert plan_moves(GROUP, view({"a": 50, "b": 30, "c": 10, "d": 5, "e": 5}, task_bytes=bytes_,
                                  draining_bytes={"cpu-2": 100}), policy) == []  # fmt: skip


def test_a_task_every_node_holds_moves_by_an_unload_and_the_base_load_stays() -> None:
    everywhere = LoadView({("a", "cpu-1"): 40, ("a", "cpu-2"): 10, ("", "cpu-1"): 10, ("", "cpu-2"): 10},
                          LAYERS, ["a"], {})  # fmt: skip
    assert plan_moves(GROUP, everywhere, BalancePolicy()) == []  # moving a's 40 only swaps the sides
    both = LoadView({("a", "cpu-1"): 30, ("b", "cpu-1"): 20, ("", "cpu-1"): 10, ("", "cpu-2"): 20},
                    LAYERS, ["a", "b"], {})  # fmt: skip
    assert plan_moves(GROUP, both, BalancePolicy()) == [Move("b", "cpu-1", "cpu-2", 20, copy=False)]


def test_loads_are_per_unit_of_capacity() -> None:
    counts = {"a": 40, "b": 20, "d": 30}
    assert plan_moves(GROUP, view(counts, capacity={"cpu-1": 1.0, "cpu-2": 1.0}), BalancePolicy())
    assert plan_moves(GROUP, view(counts, capacity={"cpu-1": 2.0, "cpu-2": 1.0}), BalancePolicy()) == []  # 30 vs 30


def test_phi_and_the_adaptive_interval() -> None:
    policy = BalancePolicy(theta=0.9, interval_s=8.0, min_interval_s=1.0, max_interval_s=10.0, step_s=1.5,
                           min_requests=8)
    assert imbalance([10.0, 90.0]) == pytest.approx(1 / 9) and imbalance([0.0, 0.0]) == 1.0
    assert next_interval(8.0, 0.5, policy) == 4.0 and next_interval(1.5, 0.5, policy) == 1.0
    assert next_interval(8.0, 0.95, policy) == 9.5 and next_interval(9.5, 0.95, policy) == 10.0

    balancer = PetBalancer(policy, now=0.0)
    assert not balancer.due(7.9) and balancer.due(8.0)
    skewed = balancer.step(8.0, view({"a": 50, "b": 30, "c": 10, "d": 5, "e": 5}))
    assert skewed.phi == pytest.approx(10 / 90) and len(skewed.moves) == 1 and skewed.interval_s == 4.0
    assert not balancer.due(11.9) and balancer.due(12.0)
    even = balancer.step(12.0, view({"a": 20, "d": 19}))
    assert even.phi == pytest.approx(19 / 20) and even.moves == [] and even.interval_s == 5.5
    quiet = balancer.step(17.5, view({"a": 5, "d": 0}))  # below min_requests: not judged
    assert quiet.phi == 1.0 and quiet.moves == [] and quiet.interval_s == 5.5 and not quiet.judged  # it stays
    # a request is counted once in each group of replicas it crosses: each group must count min_requests
    two = {"a1": (0, 8), "a2": (0, 8), "b1": (8, 16), "b2": (8, 16)}
    counts = {("t", "a1"): 4.0, ("t", "b1"): 4.0, ("u", "a2"): 3.0}  # 7 counted in group a, 4 in group b
    few = PetBalancer(policy, now=0.0).step(8.0, LoadView(counts, two, ["t", "u"], {}))
    assert not few.judged  # 11 in all, but no group counted 8
    enough = PetBalancer(policy, now=0.0).step(8.0, LoadView({**counts, ("t", "a1"): 5.0, ("u", "b2"): 4.0},
                                                             two, ["t", "u"], {}))  # fmt: skip
    assert enough.judged
    with pytest.raises(ValueError, match="theta"):
        BalancePolicy(theta=0.0)


def test_the_mean_queue_is_a_time_average_of_the_requests_in_flight_per_node() -> None:
    kv = KVEstimator({"cpu-0": 1e6, "cpu-1": 1e6, "cpu-2": 1e6})
    kv.reserve("r1", [("cpu-1", 16), ("cpu-0", 14)], 10)
    kv.reserve("r2", [("cpu-1", 16), ("cpu-0", 14)], 10)
    kv.reserve("r3", [("cpu-2", 16), ("cpu-0", 14)], 10)
    assert kv.requests_by_node() == {"cpu-0": 3, "cpu-1": 2, "cpu-2": 1}
    kv.release("r2")
    assert kv.requests_by_node() == {"cpu-0": 2, "cpu-1": 1, "cpu-2": 1}

    meter = QueueMeter()
    meter.sample(0.0, {"cpu-1": 4, "cpu-2": 0})
    assert meter.mean() == {}  # one sample spans no time
    meter.sample(1.0, {"cpu-1": 2, "cpu-2": 2})  # 4 and 0 held for 1 s
    meter.sample(4.0, {"cpu-1": 0})  # then 2 and 2 for 3 s
    assert meter.mean() == pytest.approx({"cpu-1": (4 * 1 + 2 * 3) / 4, "cpu-2": (0 * 1 + 2 * 3) / 4})
    meter.restart()
    meter.sample(6.0, {"cpu-1": 1})  # the last sample (cpu-1: 0, cpu-2 gone) held for 2 s
    assert meter.mean() == {"cpu-1": 0.0}


def test_queues_judge_the_balance_and_confirm_a_spread_the_counts_alone_call_chance() -> None:
    counts = {"a": 6, "b": 4, "c": 2, "d": 4, "e": 3}  # 12 vs 7 of 19: within chance (2 x sqrt(19) = 8.7)
    assert plan_moves(GROUP, view(counts), BalancePolicy()) == []
    queues = {"cpu-1": 14.0, "cpu-2": 1.5, "cpu-0": 15.5}  # cpu-1 holds the queue
    saturated = view(counts, queue=queues, window_s=10.0)  # 15.5 in flight, 19 counted in 10 s: 8.2 s each
    assert [m.task for m in plan_moves(GROUP, saturated, BalancePolicy())] == ["c"]  # 10 vs 9: the spread shrinks most
    # requests in flight longer than max_interval_s (82 s each over a window of 100 s): the queues hold the
    # popularity of rounds ago, and the counts judge alone
    assert plan_moves(GROUP, view(counts, queue=queues, window_s=100.0), BalancePolicy()) == []
    # queues a fraction of a request apart, or within theta of each other, confirm nothing
    assert plan_moves(GROUP, view(counts, queue={"cpu-1": 1.2, "cpu-2": 0.4}, window_s=10.0), BalancePolicy()) == []
    assert plan_moves(GROUP, view(counts, queue={"cpu-1": 20.0, "cpu-2": 18.5}, window_s=10.0), BalancePolicy()) == []
    # nor do queues that say the other way round
    assert plan_moves(GROUP, view(counts, queue={"cpu-1": 1.0, "cpu-2": 9.0}, window_s=10.0), BalancePolicy()) == []

    policy = BalancePolicy(interval_s=2.0, min_interval_s=1.0, min_requests=8, settle_s=10.0)
    balancer = PetBalancer(policy, now=0.0)
    first = balancer.step(2.0, saturated)
    assert first.phi == pytest.approx(1.5 / 14.0) and [m.task for m in first.moves] == ["c"]  # phi by the queues
    # then cpu-2 holds the queue: 6 vs 11, and c going back would even it best (9 vs 8), but it moved 1 s ago
    flipped = view({"a": 3, "b": 3, "c": 3, "d": 4, "e": 4}, on={**SPLIT, "c": "cpu-2"},
                   queue={"cpu-1": 1.0, "cpu-2": 12.0}, window_s=10.0)  # fmt: skip
    assert [m.task for m in balancer.step(3.0, flipped).moves] == ["d"]  # c settles; d, next best, goes
    assert [m.task for m in balancer.step(12.5, flipped).moves] == ["c"]  # c has settled; d has not
    with pytest.raises(ValueError, match="settle_s"):
        BalancePolicy(settle_s=-1.0)


def test_helix_serve_flags_make_the_placement_and_balance_policies() -> None:
    import argparse

    from helix.errors import ConfigError
    from router.commands import _options, add_serve_arguments
    from router.task_placement import PlacementPolicy

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    plain = _options(parser.parse_args(["--cluster", "c.yaml", "--plan", "p.json"]))
    assert plain.task_placement is PlacementPolicy.ALL and plain.pet_balance is None
    options = _options(parser.parse_args(["--cluster", "c.yaml", "--plan", "p.json", "--task-placement", "spread",
                                          "--pet-balance", "--pet-balance-interval-s", "2", "30",
                                          "--pet-node-bytes", "cpu-1=4096"]))  # fmt: skip
    policy = options.pet_balance
    assert options.task_placement is PlacementPolicy.SPREAD and policy.node_task_bytes == {"cpu-1": 4096}
    assert (policy.min_interval_s, policy.interval_s, policy.max_interval_s, policy.theta) == (2.0, 10.0, 30.0, 0.9)
    with pytest.raises(ConfigError, match="NODE=BYTES"):
        _options(parser.parse_args(["--cluster", "c", "--plan", "p", "--pet-balance", "--pet-node-bytes", "cpu-1"]))


def test_a_nodes_queue_counts_the_requests_waiting_at_the_coordinator_for_it() -> None:
    from router.request import RequestStatus
    from tests.factories import demo_router, joined_core, request

    replicas = {n: (0, 30) for n in ("cpu-0", "cpu-1", "cpu-2")}  # one replica group
    flows = {**{("coordinator", n): 1.0 for n in replicas}, **{(n, "coordinator"): 1.0 for n in replicas}}
    core = joined_core(demo_router(30 * 20, placement=replicas, flows=flows))  # a request of 10 + 10 fills a node
    core.router.task_nodes.assign("sql", {"cpu-0"})
    for i in range(3):
        core.add_request(request(f"sql{i}", task="sql"), now=0.0)
    core.add_request(request("base1"), now=0.0)
    core.add_request(request("base2"), now=0.0)
    core.add_request(request("base3"), now=0.0)
    core.schedule(0.0)
    assert [r.request_id for r in core.waiting] == ["sql1", "sql2", "base3"]
    assert all(core.requests[r].status is RequestStatus.WAITING for r in ("sql1", "sql2", "base3"))
    # in flight: one on each node; waiting: two for sql's one holder, one for any of the three
    assert core.queues_by_node() == pytest.approx({"cpu-0": 1 + 2 + 1 / 3, "cpu-1": 1 + 1 / 3, "cpu-2": 1 + 1 / 3})
    core.router.task_nodes.move("sql", "cpu-0", "cpu-1", replicas)  # the waiting ones follow the task
    assert core.queues_by_node() == pytest.approx({"cpu-0": 1 + 1 / 3, "cpu-1": 1 + 2 + 1 / 3, "cpu-2": 1 + 1 / 3})
    core.router.mark_dead("cpu-2")  # a dead node takes nothing
    assert core.queues_by_node() == pytest.approx({"cpu-0": 1 + 0.5, "cpu-1": 1 + 2 + 0.5, "cpu-2": 1})
