"""The coordinator's task registry (PetS's task manager): which fine-tuned tasks are served, and
loading and unloading them on every agent.

A task is a name, a PET type and a directory of parameters (:mod:`helix.tasks`); its parent is
the base model the cluster serves. :class:`TaskRegistry` runs in the coordinator's asyncio loop:

* **load** (``POST /v1/load_lora_adapter`` or the cluster file's ``tasks:``): the directory's
  descriptor is read here (a bad path or config is refused before any agent is asked), then every
  live agent gets LOAD_TASK and reads the tensors of its own layers from the path. The task is
  served once every live agent answered TASK_STATUS ok; if one refuses (its error names the file
  and the tensor), the agents that loaded it unload it again and the task is not registered:
  nothing already serving changes. An agent that (re)connects later gets LOAD_TASK for every
  registered task before the coordinator routes through it again; a node whose layers a re-plan
  changes gets them again for its new layers before the switch (:meth:`TaskRegistry.reload`).
* **unload**: new requests naming the task get 404 at once; the agents unbind it only after the
  task's last request in flight finished (:meth:`TaskRegistry.finished`).

Which agents hold a task is :class:`router.task_placement.TaskPlacement`'s record (``placement``,
shared with the router, which routes a task's requests through its holders only): a load goes to
the nodes the :class:`~router.task_placement.PlacementPolicy` (``policy``; default every node) or
the caller names, a reconnecting agent gets the tasks it holds, a re-plan's reload makes the nodes
whose layers changed hold every task again. :meth:`TaskRegistry.copy_to` and
:meth:`TaskRegistry.free_on` load and unload one task on one node (PET migration,
:mod:`router.pet_migration`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from helix import wire
from helix.errors import HelixError, NoRouteError, PETError, RequestError, UnknownTaskError
from helix.tasks import TASK_NAME_PATTERN, read_descriptor
from router.task_placement import PlacementPolicy, TaskPlacement

log = logging.getLogger(__name__)

TASK_LOAD_TIMEOUT_S = 300.0  # an agent reads and binds its slice of a task within this


class TaskState(StrEnum):
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"


@dataclass(slots=True)
class Task:
    """One registered task."""

    name: str
    path: str  # absolute: every agent reads it
    pet_type: str
    created_s: int
    state: TaskState = TaskState.LOADING
    in_flight: int = 0  # requests admitted and not yet finished
    nbytes: dict[str, int] = field(default_factory=dict)  # node -> bytes of the task it holds
    drained: asyncio.Event | None = None  # set when an unloading task's last request finished


SendTask = Callable[[str, "wire.LoadTask | wire.UnloadTask"], None]  # node, message (AgentsIO.send_task)


class TaskRegistry:
    """The tasks the coordinator serves; see the module docstring."""

    def __init__(self, base_names: Collection[str], nodes: Iterable[str], *, max_lora_rank: int = 0,
                 load_timeout_s: float = TASK_LOAD_TIMEOUT_S, placement: TaskPlacement | None = None,
                 policy: PlacementPolicy = PlacementPolicy.ALL) -> None:  # fmt: skip
        self.base_names = set(base_names)
        self.nodes = sorted(nodes)
        self.placement = placement if placement is not None else TaskPlacement()
        self.policy = policy
        self.layers: Mapping[str, tuple[int, int]] = {}  # node -> the layers the plan gives it (for ``policy``)
        self.max_lora_rank = max_lora_rank
        self.load_timeout_s = load_timeout_s
        self.tasks: dict[str, Task] = {}
        self.send: SendTask | None = None
        self.alive: Callable[[], set[str]] = set
        self._waiting: dict[tuple[str, str], dict[str, asyncio.Future[wire.TaskStatus]]] = {}

    # -- queries --------------------------------------------------------------------------------

    def servable(self, name: str) -> Task | None:
        """The task ``name`` if new requests may use it now."""
        task = self.tasks.get(name)
        return task if task is not None and task.state is TaskState.READY else None

    def ready(self) -> list[Task]:
        return [t for t in self.tasks.values() if t.state is TaskState.READY]

    # -- requests in flight ---------------------------------------------------------------------

    def started(self, name: str) -> None:
        self.tasks[name].in_flight += 1

    def finished(self, name: str) -> None:
        task = self.tasks.get(name)
        if task is None:
            return
        task.in_flight -= 1
        if task.in_flight == 0 and task.drained is not None:
            task.drained.set()

    # -- load / unload --------------------------------------------------------------------------

    def check_new(self, name: str, path: str | Path) -> str:
        """Refuse a name that is taken or malformed, or a directory that holds no task; its PET type."""
        if not re.fullmatch(TASK_NAME_PATTERN, name):
            raise RequestError(f"task name {name!r} must match {TASK_NAME_PATTERN}", param="lora_name")
        if name in self.base_names:
            raise RequestError(f"{name!r} is the base model's name; give the task another", param="lora_name")
        if name in self.tasks:
            raise RequestError(f"task {name!r} is already {self.tasks[name].state}; unload it first to replace it",
                               param="lora_name")  # fmt: skip
        return read_descriptor(path).pet_type

    async def load(self, name: str, path: str | Path, nodes: Collection[str] | None = None) -> Task:
        """Register ``name`` and load it on the live agents that are to hold it (``nodes``, or as the
        placement policy says); raises and registers nothing if one refuses."""
        absolute = str(Path(path).expanduser().resolve())
        pet_type = self.check_new(name, absolute)
        if nodes is not None and (unknown := sorted(set(nodes) - set(self.nodes))):
            raise RequestError(f"task {name!r}: no node {', '.join(map(repr, unknown))} in the plan (nodes: "
                               f"{', '.join(self.nodes)})", param="nodes")  # fmt: skip
        held = frozenset(nodes) if nodes is not None else self.placement.initial(self.policy, self.layers)
        targets = [n for n in self.nodes if n in self.alive() and (held is None or n in held)]
        if not targets:
            raise NoRouteError(f"task {name!r}: no agent that is to hold it is connected to load it on")
        task = self.tasks[name] = Task(name, absolute, pet_type, int(time.time()))
        self.placement.assign(name, held)
        statuses = await self._ask(targets, wire.LoadTask(name, absolute, self.max_lora_rank))
        failed = [s for s in statuses if not s.ok]
        if failed or self.tasks.get(name) is not task:
            loaded = [s.node_id for s in statuses if s.ok]
            for node in loaded:
                self._send(node, wire.UnloadTask(name))
            self.tasks.pop(name, None)
            self.placement.forget(name)
            reason = failed[0].error if failed else "unloaded while loading"
            raise PETError(f"task {name!r} was not loaded: {reason}")
        task.nbytes = {s.node_id: s.nbytes for s in statuses}
        task.state = TaskState.READY
        log.info("task %s (%s) loaded from %s on %s", name, pet_type, absolute, ", ".join(targets))
        return task

    async def unload(self, name: str) -> Task:
        """Stop admitting requests for ``name``; once its requests in flight finished, unbind it everywhere."""
        task = self.tasks.get(name)
        if task is None or task.state is TaskState.UNLOADING:
            raise UnknownTaskError(f"task {name!r} is not loaded (loaded: {', '.join(sorted(self.tasks)) or 'none'})",
                                   task=name)  # fmt: skip
        if task.state is TaskState.LOADING:
            raise RequestError(f"task {name!r} is still loading; unload it once it is loaded", param="lora_name")
        task.state = TaskState.UNLOADING
        if task.in_flight:
            task.drained = asyncio.Event()
            log.info("task %s: unloading after its %d requests in flight", name, task.in_flight)
            await task.drained.wait()
        nodes = [n for n in self.nodes if n in self.alive()]
        for status in await self._ask(nodes, wire.UnloadTask(name)):
            if not status.ok:
                log.warning("task %s: node %s did not unload it: %s", name, status.node_id, status.error)
        del self.tasks[name]
        self.placement.forget(name)
        log.info("task %s unloaded", name)
        return task

    async def load_all(self, specs: Iterable[tuple[str, str]]) -> None:
        """Load the tasks listed at start, one after the other; a refused one is logged, not fatal."""
        for name, path in specs:
            try:
                await self.load(name, path)
            except HelixError as exc:
                log.error("task %s from the cluster file was not loaded: %s", name, exc.message)

    # -- agents ---------------------------------------------------------------------------------

    def on_agent_alive(self, node: str) -> None:
        """A (re)connected agent gets every registered task it holds (it may have restarted without them)."""
        for task in self.tasks.values():
            if task.state is not TaskState.UNLOADING and self.placement.holds(task.name, node):
                self._send(node, wire.LoadTask(task.name, task.path, self.max_lora_rank))

    async def reload(self, nodes: Collection[str]) -> str:
        """Send every registered task to ``nodes`` again (a re-plan changed their layers: an agent binds a
        task to the layers it holds), which hold them all from now on; the first refusal, or "" when every
        node loaded every task."""
        for task in list(self.tasks.values()):
            if task.state is TaskState.UNLOADING or not nodes:
                continue
            statuses = await self._ask(list(nodes), wire.LoadTask(task.name, task.path, self.max_lora_rank))
            failed = [s for s in statuses if not s.ok]
            if failed:
                return f"task {task.name!r} on {failed[0].node_id}: {failed[0].error}"
            task.nbytes.update({s.node_id: s.nbytes for s in statuses})
            self.placement.add(task.name, nodes)
        return ""

    async def copy_to(self, name: str, node: str) -> wire.TaskStatus:
        """Load the registered task ``name`` on ``node`` (a PET migration's copy; the caller switches routing)."""
        task = self.tasks[name]
        (status,) = await self._ask([node], wire.LoadTask(name, task.path, self.max_lora_rank))
        if status.ok:
            task.nbytes[node] = status.nbytes
        return status

    async def free_on(self, name: str, node: str) -> wire.TaskStatus:
        """Unload ``name`` from ``node`` (no request of it is routed there any more, none runs there)."""
        (status,) = await self._ask([node], wire.UnloadTask(name))
        task = self.tasks.get(name)
        if task is not None:
            task.nbytes.pop(node, None)
        return status

    def on_agent_dead(self, node: str) -> None:
        for waiters in self._waiting.values():
            future = waiters.get(node)
            if future is not None and not future.done():
                future.set_result(wire.TaskStatus(node, "", "load", False, f"node {node!r} died"))

    def on_status(self, status: wire.TaskStatus) -> None:
        """An agent's TASK_STATUS (on the coordinator's loop)."""
        future = self._waiting.get((status.task_id, status.op), {}).get(status.node_id)
        if future is not None and not future.done():
            future.set_result(status)
        elif not status.ok:
            log.error("node %s could not %s task %s: %s", status.node_id, status.op, status.task_id, status.error)

    def _send(self, node: str, msg: wire.LoadTask | wire.UnloadTask) -> None:
        assert self.send is not None, "attach the agents first"
        self.send(node, msg)

    async def _ask(self, nodes: list[str], msg: wire.LoadTask | wire.UnloadTask) -> list[wire.TaskStatus]:
        if not nodes:  # every agent is gone: nothing to ask (asyncio.wait refuses an empty set)
            return []
        op = "load" if isinstance(msg, wire.LoadTask) else "unload"
        key = (msg.task_id, op)
        loop = asyncio.get_running_loop()
        shared = self._waiting.setdefault(key, {})  # an ask of the same (task, op, node) in flight shares its answer
        waiters: dict[str, asyncio.Future[wire.TaskStatus]] = {}
        for node in nodes:
            future = shared.get(node)
            if future is None or future.done():
                future = shared[node] = loop.create_future()
            waiters[node] = future
        try:
            for node in nodes:
                self._send(node, msg)
            done, pending = await asyncio.wait(waiters.values(), timeout=self.load_timeout_s)
            out = [f.result() for f in done]
            out += [wire.TaskStatus(node, msg.task_id, op, False, f"node {node!r} did not answer in "
                                    f"{self.load_timeout_s:.0f} s") for node, f in waiters.items() if f in pending]
            return out
        finally:
            for node, future in waiters.items():
                if shared.get(node) is future:
                    del shared[node]
            if not shared and self._waiting.get(key) is shared:
                del self._waiting[key]
