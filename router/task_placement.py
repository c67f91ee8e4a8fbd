"""Which nodes hold which fine-tuned task's PET: the coordinator's task -> nodes assignment.

Every node holding a layer need not hold every task's PET for it (PetS section 2.3.2: instances
hold different tasks). :class:`TaskPlacement` is the one record of who holds what. A task absent
from it is held by *every* node (the default, and what Helix did before: every agent loads every
task for the layers it holds); a task assigned a set of nodes is held by those only, and the router
routes its requests only through them (:meth:`router.policy.Router.route` masks the others as it
masks dead and KV-full nodes). An agent holds a task for all the layers it holds, so holding is per
node, not per layer.

Who writes it: the task registry (:mod:`router.tasks`: a load under a restricting policy, an
unload) and the PET migrator (:mod:`router.pet_migration`: a task moved between nodes holding the
same layers). Each change replaces one task's entry whole, so a reader never sees half of one.

:func:`replica_groups` names the nodes that hold the same layers (PetS's interchangeable
instances); :meth:`TaskPlacement.initial` picks a new task's holders under a :class:`PlacementPolicy`:
``all`` (every node), or ``spread`` (one node of each replica group, the one holding the fewest
tasks, and every node whose layers no other node holds). Pure: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from enum import StrEnum


class PlacementPolicy(StrEnum):
    """Where a newly registered task is loaded."""

    ALL = "all"  # every node (the default)
    SPREAD = "spread"  # one node of each group holding the same layers, and every node no other replicates


def replica_groups(placement: Mapping[str, tuple[int, int]]) -> list[list[str]]:
    """The nodes of ``placement`` grouped by the layer range they hold (sorted; singletons included)."""
    groups: dict[tuple[int, int], list[str]] = {}
    for node in sorted(placement):
        start, end = placement[node]
        groups.setdefault((int(start), int(end)), []).append(node)
    return [groups[r] for r in sorted(groups)]


class TaskPlacement:
    """Task -> the nodes holding its PET; a task not listed is held by every node."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[str, frozenset[str]] = {}

    # -- queries ----------------------------------------------------------------------------------

    def holders(self, task: str) -> frozenset[str] | None:
        """The nodes holding ``task``; None: every node (the base model, or a task nobody restricted)."""
        return self._held.get(task) if task else None

    def holds(self, task: str, node: str) -> bool:
        held = self._held.get(task) if task else None
        return held is None or node in held

    def restricted(self) -> dict[str, frozenset[str]]:
        """Every task held by some nodes only, with its holders (a copy)."""
        return dict(self._held)

    # -- changes ----------------------------------------------------------------------------------

    def assign(self, task: str, nodes: Collection[str] | None) -> None:
        """``task`` is held by ``nodes`` from now on (None: by every node)."""
        if nodes is None:
            self._held.pop(task, None)
        else:
            self._held[task] = frozenset(nodes)

    def add(self, task: str, nodes: Collection[str]) -> None:
        """``nodes`` hold ``task`` too (a no-op for a task every node holds)."""
        held = self._held.get(task)
        if held is not None:
            self._held[task] = held | frozenset(nodes)

    def move(self, task: str, src: str, dst: str, everyone: Collection[str]) -> None:
        """``task`` leaves ``src`` for ``dst`` (``everyone``: the nodes a task held by all means)."""
        held = self._held.get(task)
        base = frozenset(everyone) if held is None else held
        self._held[task] = (base - {src}) | {dst}

    def forget(self, task: str) -> None:
        """``task`` is unloaded: no entry is kept."""
        self._held.pop(task, None)

    # -- a new task -------------------------------------------------------------------------------

    def initial(self, policy: PlacementPolicy, placement: Mapping[str, tuple[int, int]]) -> frozenset[str] | None:
        """Where a new task goes under ``policy`` (None: every node)."""
        if policy is PlacementPolicy.ALL:
            return None
        load = dict.fromkeys(placement, 0)  # tasks held by every node weigh the same on all: not counted
        for held in self._held.values():
            for node in held & load.keys():
                load[node] += 1
        return frozenset(min(group, key=lambda n: (load[n], n)) for group in replica_groups(placement))
