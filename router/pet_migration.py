"""PET migration in the live coordinator (PetS section 2.3.2): the balancer's moves carried out.

:class:`PetMigrator` runs on the coordinator's asyncio loop (ticked by
:meth:`router.coordinator.Coordinator.watch_kv`):

* **counting**: :class:`TaskLoadObserver` wraps the core's observer and counts every attempt, at
  its first token, once for each node of its pipeline under its task (the base model's as ""); every
  tick samples each node's requests in flight (the KV reservations the core holds for them) into a
  :class:`~router.pet_balancer.QueueMeter`: PetS's mean queue ``L``;
* **deciding**: when :class:`router.pet_balancer.PetBalancer` is due, the window's counts, the
  routable nodes' layers, the tasks' holders and their bytes per node make a
  :class:`~router.pet_balancer.LoadView`; the balancer says which PETs move. Nodes holding the same
  layers are taken as equally fast (PetS's identical instances): the plan's flows are no measure of
  their speed, as a max flow need not split among replicas in proportion to their capacity (the
  demo's cpu-1 and cpu-2 on [0, 16) get 53 and 816 tok/s when cpu-0 is the bottleneck);
* **moving**: the round's moves one after the other, each (1) *copy*: the target loads the task
  for its layers (LOAD_TASK over the task registry's path, :meth:`router.tasks.TaskRegistry.copy_to`)
  unless its PET is still there (a move back before the source was freed); (2) *switch*: between two
  core steps the task's holders change (:meth:`router.task_placement.TaskPlacement.move`), so new
  requests go to the target, unless the task would be left without a route (then the switch is undone
  and the copy freed). Then, apart from the moves and rounds that follow: (3) *drain*: requests in
  flight on the source finish there; (4) *free*: once none of the task's requests holds a pipeline
  through the source, the source unloads it (UNLOAD_TASK), unless the task was moved back meanwhile.
  The next move and the next round do not wait for drains: a task whose requests generate for minutes
  would otherwise hold the balance still for minutes (the simulator measured drains of 140 s, against
  a popularity that shifts every 60 s). A PET being drained still counts in its node's bytes.

No request is lost or answered by the wrong task: a request is routed only through nodes that
hold its task (the source until the switch, the target after it, both loaded meanwhile), and the
source keeps the PET until its last request there is over. A task unloaded meanwhile is not moved
(and a copy made for it is freed).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from router.core import CoordinatorCore
from router.driver import CoreDriver
from router.pet_balancer import (
    BalancePolicy,
    LoadView,
    Move,
    PetBalancer,
    QueueMeter,
    Round,
    TaskLoadObserver,
)
from router.tasks import TaskRegistry, TaskState

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05  # how often a move looks whether the source's requests of the task are over
DRAIN_LIMIT_S = 900.0  # a source still running the task's requests after this keeps the PET (logged)


class Serving(Protocol):
    """What the migrator needs of the coordinator (:class:`router.coordinator.Coordinator`)."""

    driver: CoreDriver
    tasks: TaskRegistry


class PetMigrator:
    """Counts, decides and moves PETs (see the module doc)."""

    def __init__(self, serving: Serving, policy: BalancePolicy, *, now: float | None = None) -> None:
        self.serving = serving
        self.balancer = PetBalancer(policy, time.monotonic() if now is None else now)
        self.migrations = 0  # moves completed (the source freed)
        self.switches = 0  # moves whose routing switched to the target (their drains may go on)
        self.last: Round | None = None
        self._counts: dict[tuple[str, str], float] = {}
        self.queues = QueueMeter()
        self._lock = threading.Lock()  # counts come from the transport's I/O thread
        self._moving: asyncio.Future[None] | None = None  # the round's copies and switches
        self._drains: dict[asyncio.Task[None], Move] = {}  # switched moves whose sources are still draining
        self._freeing: set[tuple[str, str]] = set()  # (task, node): an unload under way
        core = serving.driver.core
        core.observer = TaskLoadObserver(core.observer, self.count)

    def count(self, task: str, nodes: Sequence[str], now: float = 0.0) -> None:
        with self._lock:
            for node in nodes:
                key = (task, node)
                self._counts[key] = self._counts.get(key, 0.0) + 1.0

    def tick(self) -> None:
        """On the loop, a few times a second: start a round when one is due and no copy or switch is under way
        (drains go on meanwhile)."""
        now = time.monotonic()
        self.queues.sample(now, self.serving.driver.locked(lambda core: core.queues_by_node()))
        if (self._moving is not None and not self._moving.done()) or not self.balancer.due(now):
            return
        with self._lock:
            counts = dict(self._counts)
        self.last = self.balancer.step(now, self.view(counts))
        if self.last.judged:  # else the window goes on: too few requests to judge the balance by
            self.queues.restart()
            with self._lock:
                for key, n in counts.items():
                    self._counts[key] -= n
                self._counts = {k: n for k, n in self._counts.items() if n > 0}
        if self.last.judged:
            per_node: dict[str, float] = {}
            for (_, node), n in counts.items():
                per_node[node] = per_node.get(node, 0.0) + n
            log.info("PET balance: phi %.2f, requests by node %s, next round in %.1f s; moving %s", self.last.phi,
                     {n: int(c) for n, c in sorted(per_node.items())}, self.last.interval_s,
                     ", ".join(f"{m.task} {m.src}->{m.dst}" for m in self.last.moves) or "nothing")  # fmt: skip
        if self.last.moves:
            self._moving = asyncio.ensure_future(self._move_all(self.last.moves))

    def view(self, counts: dict[tuple[str, str], float]) -> LoadView:
        """The window's counts (and mean queues) and who holds what, as the core and the registry see them now."""

        def look(core: CoordinatorCore) -> tuple[dict[str, tuple[int, int]], dict[str, frozenset[str]]]:
            return core.router.routable_placement(), core.router.task_nodes.restricted()

        layers, holders = self.serving.driver.locked(look)
        ready = self.serving.tasks.ready()
        task_bytes = {(t.name, n): b for t in ready for n, b in t.nbytes.items()}
        draining: dict[str, int] = {}
        for task, node in {(m.task, m.src) for m in self._drains.values()}:
            draining[node] = draining.get(node, 0) + task_bytes.get((task, node), 0)
        return LoadView(counts, layers, [t.name for t in ready], holders, task_bytes, draining_bytes=draining,
                        queue=self.queues.mean(), window_s=self.queues.span_s)

    async def _move_all(self, moves: Sequence[Move]) -> None:
        for move in moves:
            try:
                await self.migrate(move)
            except Exception:  # a failed move leaves the task where it was; never kill the loop
                log.exception("PET migration of %s from %s to %s failed", move.task, move.src, move.dst)

    def _ready(self, task: str) -> bool:
        entry = self.serving.tasks.tasks.get(task)
        return entry is not None and entry.state is TaskState.READY

    async def migrate(self, move: Move) -> bool:
        """Copy ``move.task`` to ``move.dst`` and switch its routing; the source's drain and free go on in a
        task of their own (:meth:`drain_and_free`). False when the task stayed where it was."""
        registry, driver, task = self.serving.tasks, self.serving.driver, move.task
        if not self._ready(task):
            return False
        copied = False
        if move.copy and not self._still_on(task, move.dst):
            status = await registry.copy_to(task, move.dst)
            if not status.ok:
                log.warning("PET migration: %s could not load task %s: %s", move.dst, task, status.error)
                return False
            copied = True
            if not self._ready(task):  # unloaded meanwhile
                await registry.free_on(task, move.dst)
                return False

        def switch(core: CoordinatorCore) -> str:
            router = core.router
            before = router.task_nodes.holders(task)
            router.task_nodes.move(task, move.src, move.dst, router.topology.placement)
            why = router.task_unroutable(task)
            if why:
                router.task_nodes.assign(task, before)
            return why

        why = driver.locked(switch)
        if why:
            log.warning("PET migration of %s from %s to %s undone: %s", task, move.src, move.dst, why)
            if copied:
                await registry.free_on(task, move.dst)
            return False
        self.switches += 1
        drain = asyncio.ensure_future(self._drain(move))
        self._drains[drain] = move
        drain.add_done_callback(lambda done: self._drains.pop(done, None))
        return True

    def _still_on(self, task: str, node: str) -> bool:
        """Whether ``node`` still holds ``task``'s PET (switched away, not yet freed)."""
        entry = self.serving.tasks.tasks.get(task)
        return entry is not None and node in entry.nbytes and (task, node) not in self._freeing

    async def _drain(self, move: Move) -> None:
        try:
            await self.drain_and_free(move)
        except Exception:  # the PET stays on the source; never kill the loop
            log.exception("PET migration: freeing %s on %s failed", move.task, move.src)

    async def drain_and_free(self, move: Move) -> None:
        """Once no request of ``move.task`` runs through ``move.src``, unload it there, unless the task
        was moved back to it meanwhile."""
        registry, driver, task = self.serving.tasks, self.serving.driver, move.task
        deadline = time.monotonic() + DRAIN_LIMIT_S
        while True:
            if registry.placement.holds(task, move.src):  # moved back before it drained: nothing to free
                return
            if not driver.locked(lambda core: core.router.in_flight(task, move.src)):
                break
            if time.monotonic() > deadline:
                log.warning("PET migration: %s still runs requests of task %s; keeping its PET", move.src, task)
                return
            await asyncio.sleep(DRAIN_POLL_S)
        if self._ready(task):
            self._freeing.add((task, move.src))
            try:
                await registry.free_on(task, move.src)
            finally:
                self._freeing.discard((task, move.src))
        self.migrations += 1
        log.info("PET migration: task %s moved from %s to %s", task, move.src, move.dst)

    def describe(self) -> dict[str, object]:
        """For ``/health``: the last round's balance, the interval to the next, the moves so far."""
        last = self.last
        return {"phi": None if last is None else round(last.phi, 3), "interval_s": self.balancer.interval_s,
                "migrations": self.migrations, "switched": self.switches, "draining": len(self._drains)}  # fmt: skip
