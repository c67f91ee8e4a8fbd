"""The live PET migrator's moves (router.pet_migration.PetMigrator) do not wait for drains: a move
returns once routing switched, the source is freed apart once its requests there are over, a task
moved back before its source drained is not freed there (nor copied again), and a PET being drained
still counts in its node's bytes.

The core and the agents are fabricated here (who runs what, the agents' answers): the policy under
test is the migrator's order of copy, switch, drain and free. Under real agents and streaming load,
tests/router/test_live_pet_migration.py checks every answer while PETs move.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from types import SimpleNamespace
from typing import Any

from helix import wire
from router.core_interfaces import QuietObserver
from router.pet_balancer import BalancePolicy, Move
from router.pet_migration import PetMigrator
from router.task_placement import TaskPlacement
from router.tasks import Task, TaskRegistry, TaskState

LAYERS = {"cpu-0": (16, 30), "cpu-1": (0, 16), "cpu-2": (0, 16)}
PET_BYTES = 1000


class Router:
    """What the migrator reads of the core's router; ``running[(task, node)]``: requests in flight."""

    def __init__(self) -> None:
        self.task_nodes = TaskPlacement()
        self.topology = SimpleNamespace(placement=LAYERS)
        self.dead: set[str] = set()
        self.draining: set[str] = set()
        self.running: dict[tuple[str, str], int] = {}

    def in_flight(self, task: str, node: str) -> int:
        return self.running.get((task, node), 0)

    def task_unroutable(self, task: str) -> str:
        return ""

    def routable_placement(self) -> dict[str, tuple[int, int]]:
        return {n: r for n, r in self.topology.placement.items() if n not in self.dead | self.draining}


class Driver:
    def __init__(self) -> None:
        self.core = SimpleNamespace(router=Router(), observer=QuietObserver())

    def locked(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.core)


def serving() -> tuple[Any, Router, list[tuple[str, str, str]]]:
    """A migrator's coordinator: task "t" held by cpu-1 (and cpu-0); the agents' LOAD/UNLOAD answers, logged."""
    driver = Driver()
    router = driver.core.router
    registry = TaskRegistry(["base"], LAYERS, placement=router.task_nodes)
    registry.tasks["t"] = Task("t", "/tasks/t", "lora", 0, state=TaskState.READY,
                               nbytes={"cpu-0": PET_BYTES, "cpu-1": PET_BYTES})  # fmt: skip
    router.task_nodes.assign("t", {"cpu-0", "cpu-1"})
    asked: list[tuple[str, str, str]] = []

    async def ask(nodes: Collection[str], msg: wire.LoadTask | wire.UnloadTask) -> list[wire.TaskStatus]:
        op = "load" if isinstance(msg, wire.LoadTask) else "unload"
        asked.extend((op, msg.task_id, n) for n in nodes)
        await asyncio.sleep(0)
        return [wire.TaskStatus(n, msg.task_id, op, True, nbytes=PET_BYTES if op == "load" else 0) for n in nodes]

    registry._ask = ask  # type: ignore[method-assign]
    return SimpleNamespace(driver=driver, tasks=registry), router, asked


async def settle(migrator: PetMigrator) -> None:
    for _ in range(200):
        if not migrator.describe()["draining"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the drains did not end: {migrator.describe()}")


def test_a_move_switches_without_waiting_for_the_sources_drain_and_frees_it_once_drained() -> None:
    async def run() -> None:
        coordinator, router, asked = serving()
        migrator = PetMigrator(coordinator, BalancePolicy(), now=0.0)
        router.running[("t", "cpu-1")] = 2  # two requests of t still run through cpu-1
        # returns at the switch (a migrator that waited for the drain would time out here)
        assert await asyncio.wait_for(migrator.migrate(Move("t", "cpu-1", "cpu-2", 10, copy=True)), 5)
        assert router.task_nodes.holders("t") == {"cpu-0", "cpu-2"}  # switched: new requests go to cpu-2
        assert asked == [("load", "t", "cpu-2")] and migrator.describe()["draining"] == 1
        view = migrator.view({})
        assert view.draining_bytes == {"cpu-1": PET_BYTES}  # still there until freed
        await asyncio.sleep(0.2)
        assert "cpu-1" in coordinator.tasks.tasks["t"].nbytes and migrator.migrations == 0  # not while they run
        router.running[("t", "cpu-1")] = 0
        await settle(migrator)
        assert asked[-1] == ("unload", "t", "cpu-1") and "cpu-1" not in coordinator.tasks.tasks["t"].nbytes
        assert migrator.migrations == 1 and migrator.view({}).draining_bytes == {}

    asyncio.run(run())


def test_a_task_moved_back_before_its_source_drained_is_neither_copied_again_nor_freed_there() -> None:
    async def run() -> None:
        coordinator, router, asked = serving()
        migrator = PetMigrator(coordinator, BalancePolicy(), now=0.0)
        router.running[("t", "cpu-1")] = 1
        assert await asyncio.wait_for(migrator.migrate(Move("t", "cpu-1", "cpu-2", 10, copy=True)), 5)
        router.running[("t", "cpu-2")] = 1  # a request of t started on cpu-2
        # the balancer sees cpu-1 no longer holding t (routing), so it asks for a copy; the PET is still there
        assert await asyncio.wait_for(migrator.migrate(Move("t", "cpu-2", "cpu-1", 10, copy=True)), 5)
        assert router.task_nodes.holders("t") == {"cpu-0", "cpu-1"}
        assert asked == [("load", "t", "cpu-2")]  # no second load on cpu-1
        router.running[("t", "cpu-1")] = router.running[("t", "cpu-2")] = 0
        await settle(migrator)
        assert asked == [("load", "t", "cpu-2"), ("unload", "t", "cpu-2")]  # cpu-2 freed, cpu-1 kept
        assert set(coordinator.tasks.tasks["t"].nbytes) == {"cpu-0", "cpu-1"}

    asyncio.run(run())
