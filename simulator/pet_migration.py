"""Fine-tuned tasks' placement and PET migration in a simulated run (``helix simulate --task-placement``,
``--pet-balance``; PetS section 2.3.2, docs/pets.md): the live coordinator's policies at simulated times.

What is the server's, run as it is: the core's :class:`router.task_placement.TaskPlacement` (a task's
requests are routed only through the nodes holding its PET: :meth:`router.policy.Router.route` masks the
others), :meth:`~router.task_placement.TaskPlacement.initial` under the run's
:class:`~router.task_placement.PlacementPolicy` for where each task starts, and
:class:`router.pet_balancer.PetBalancer` (PetS Algorithm 3) judging each window's counts.

What :class:`TaskBalance` plays, for the live migrator (:mod:`router.pet_migration`, whose shell is bound to
asyncio and the task registry):

* **counting** (:class:`TaskCounter`): every attempt, at its first token, once for each node of its
  pipeline under its task, as the live ``TaskLoadObserver`` counts it; every :data:`TICK_S`, each
  node's requests in flight (the core's KV reservations) into a ``QueueMeter``, as live;
* **a round**, when the balancer is due (looked at every :data:`TICK_S`) and no move is under way: a
  :class:`~router.pet_balancer.LoadView` of the window's counts, the routable nodes' layers, the tasks'
  holders and their PET bytes per node (nodes of a replica group taken as equally fast, as live); a
  judged window's counts are spent, an unjudged one's go on into the next;
* **a move**, one after the other: *copy* (the target loads the PET for its layers, :func:`pet_layer_bytes`
  per layer at ``load_gb_per_s``, while it serves; nothing when the target still holds it, switched away
  and not yet freed), *switch* (between two core steps the task's holders change; undone when the task
  would have no route), then, apart, *drain* (requests in flight on the source finish there: polled every
  :data:`DRAIN_POLL_S`) and *free*. As live, the next move and the next round start once the task is
  switched, the drains going on meanwhile (a PET being drained counts in its node's bytes);
  ``SimConfig.pet_serial_drains`` (``--pet-serial-drains``) makes them wait for the source to be freed:
  what the live migrator did before, when a task whose requests generate for minutes held the balance
  still for minutes.

:meth:`TaskBalance.report` gives the moves, the rounds and, per ``bucket_s``, the balance ``phi`` of the
worst replica group (its least-counted node's requests over its most-counted's) whether or not PETs move.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from helix.errors import ConfigError
from helix.profile import ModelProfile
from helix.task_memory import SPARSE_ENTRY_BYTES
from helix.tasks import MAX_DIFF_DENSITY, MAX_MASK_COMPLEMENT_DENSITY
from router.pet_balancer import LoadView, Move, PetBalancer, QueueMeter, TaskLoadObserver
from router.policy import Router
from router.task_placement import PlacementPolicy, replica_groups
from simulator.results import SimConfig
from simulator.tasks import TaskMix

if TYPE_CHECKING:
    from simulator.engine import Simulation

TICK_S = 0.25  # the coordinator's watcher ticks the migrator this often (router.coordinator's tick)
DRAIN_POLL_S = 0.05  # a move looks this often whether the source's requests of the task are over (live: the same)
LORA_RANK, LORA_MODULES = 16, 4  # a simulated LoRA task: rank 16 on q, k, v and o
ADAPTER_BOTTLENECK, ADAPTERS = 64, 2  # a simulated adapter task: two bottlenecks of 64 (attention and MLP)
BITFIT_BIASES = 14  # a simulated BitFit task's biases per layer, in hidden sizes (LLaMA: q k v o, gate up down, norms)


def pet_layer_bytes(pet: str, model: ModelProfile) -> float:
    """The bytes one layer of a simulated task of PET type ``pet`` takes on a node (the simulated tasks have no
    files; counted by :mod:`helix.task_memory`'s rules: dense at ``dtype_bytes``, a diff or mask at its
    largest density and 8 bytes a non-zero)."""
    h, d = model.hidden_size, model.dtype_bytes
    weights = model.layer_weight_bytes / d  # values in one layer's weights
    return {
        "lora": LORA_MODULES * LORA_RANK * 2 * h * d,
        "adapter": ADAPTERS * 2 * ADAPTER_BOTTLENECK * h * d,
        "bitfit": BITFIT_BIASES * h * d,
        "diff": weights * MAX_DIFF_DENSITY * SPARSE_ENTRY_BYTES,
        "mask": weights * MAX_MASK_COMPLEMENT_DENSITY * SPARSE_ENTRY_BYTES,
    }[pet]


class TaskCounter:
    """Each attempt counted per (task, node) at its first token, as ``helix serve`` counts them
    (:class:`router.pet_migration.TaskLoadObserver`): for the balancer's window and per ``bucket_s``
    (the balance over time)."""

    def __init__(self, bucket_s: float) -> None:
        self.bucket_s = bucket_s
        self.window: dict[tuple[str, str], float] = {}
        self.buckets: list[dict[str, int]] = []  # bucket -> node -> requests counted there

    def count(self, task: str, nodes: Sequence[str], now: float) -> None:
        b = int(now / self.bucket_s)
        while len(self.buckets) <= b:
            self.buckets.append({})
        bucket = self.buckets[b]
        for node in nodes:
            self.window[(task, node)] = self.window.get((task, node), 0.0) + 1.0
            bucket[node] = bucket.get(node, 0) + 1


@dataclass(slots=True)
class MoveRecord:
    """One PET move the balancer asked for, and how it went."""

    task: str
    src: str
    dst: str
    requests: float  # the task's requests counted on the source in the window
    asked_s: float
    copy_s: float = 0.0  # the target's load time (0: it held the PET)
    switched_s: float | None = None
    freed_s: float | None = None
    outcome: str = "copying"  # copying | draining | moved | undone: why


class TaskBalance:
    """Tasks' holders and PET migration in ``sim`` (see the module doc); None from :meth:`build` when unused."""

    def __init__(self, sim: Simulation, tasks: TaskMix, model: ModelProfile, config: SimConfig) -> None:
        self.sim, self.tasks, self.model = sim, tasks, model
        self.policy = config.pet_balance
        self.load_gb_per_s = config.pet_load_gb_per_s
        self.serial_drains = config.pet_serial_drains
        self.counter = TaskCounter(config.bucket_s)
        self.queues = QueueMeter()
        sim.core.observer = TaskLoadObserver(sim.core.observer, self.counter.count)
        self.layer_bytes = {t: pet_layer_bytes(pet, model) for t, pet in tasks.pet_of.items()}
        self.balancer = PetBalancer(self.policy, 0.0) if self.policy is not None else None
        self.rounds: list[dict[str, Any]] = []
        self.moves: list[MoveRecord] = []
        self._queue: list[Move] = []
        self._moving = False
        self.end = float("inf")
        router = sim.core.router
        placement = PlacementPolicy(config.task_placement)
        for task in tasks.names:  # as the registry loads the run's tasks one after the other
            router.task_nodes.assign(task, router.task_nodes.initial(placement, router.topology.placement))

    @classmethod
    def build(cls, sim: Simulation, tasks: TaskMix | None, model: ModelProfile, config: SimConfig) -> TaskBalance | None:
        """The run's task balance: when tasks are placed, moved or skewed; a ConfigError when asked without tasks."""
        asked = {"--task-placement": config.task_placement != "all", "--pet-balance": config.pet_balance is not None,
                 "--task-popularity": config.task_popularity.zipf_s is not None}  # fmt: skip
        if tasks is None:
            for flag, on in asked.items():
                if on:
                    raise ConfigError("needs fine-tuned tasks: give --tasks (e.g. lora:64) or a cluster file with tasks",
                                      field=flag)  # fmt: skip
            return None
        return cls(sim, tasks, model, config) if any(asked.values()) else None

    # -- rounds -------------------------------------------------------------------------------------

    def start(self, end: float) -> None:
        self.end = end
        if self.balancer is not None:
            self.sim.at(TICK_S, self._tick)

    def _tick(self) -> None:
        now, balancer = self.sim.now, self.balancer
        assert balancer is not None
        self.queues.sample(now, self.sim.core.queues_by_node())
        if not self._moving and balancer.due(now):
            self._round(now, balancer)
        if now + TICK_S <= self.end:
            self.sim.at(now + TICK_S, self._tick)

    def _round(self, now: float, balancer: PetBalancer) -> None:
        counts = dict(self.counter.window)
        result = balancer.step(now, self.view(counts))
        if result.judged:  # else the window goes on: too few requests to judge the balance by
            self.counter.window = {}
            self.queues.restart()
        self.rounds.append({"at_s": now, "phi": result.phi, "judged": result.judged, "moves": len(result.moves),
                            "interval_s": result.interval_s})  # fmt: skip
        if result.moves:
            self._queue = list(result.moves)
            self._moving = True
            self._next()

    def view(self, counts: dict[tuple[str, str], float]) -> LoadView:
        """The window's counts (and mean queues) and who holds what, as the core's router sees them now."""
        router: Router = self.sim.core.router
        layers = router.routable_placement()
        task_bytes = {(t, n): int(b * (e - s)) for t, b in self.layer_bytes.items() for n, (s, e) in layers.items()}
        draining: dict[str, int] = {}
        for m in self.moves:
            if m.outcome == "draining" and m.src in layers:
                draining[m.src] = draining.get(m.src, 0) + task_bytes[(m.task, m.src)]
        return LoadView(counts, layers, self.tasks.names, router.task_nodes.restricted(), task_bytes,
                        draining_bytes=draining, queue=self.queues.mean(), window_s=self.queues.span_s)  # fmt: skip

    def _draining(self, task: str, node: str) -> bool:
        """Whether ``node`` still holds ``task``'s PET: switched away from it, not yet freed."""
        return any(m.outcome == "draining" and m.task == task and m.src == node for m in self.moves)

    # -- a move: copy, switch, drain, free ------------------------------------------------------------

    def _next(self) -> None:
        if not self._queue:
            self._moving = False
            return
        move = self._queue.pop(0)
        now = self.sim.now
        record = MoveRecord(move.task, move.src, move.dst, move.requests, now)
        self.moves.append(record)
        if move.copy and not self._draining(move.task, move.dst):
            s, e = self.sim.core.router.topology.placement[move.dst]
            record.copy_s = self.layer_bytes[move.task] * (e - s) / (self.load_gb_per_s * 1e9)
        self.sim.at(now + record.copy_s, functools.partial(self._switch, move, record))

    def _switch(self, move: Move, record: MoveRecord) -> None:
        sim = self.sim
        router = sim.core.router
        before = router.task_nodes.holders(move.task)
        router.task_nodes.move(move.task, move.src, move.dst, router.topology.placement)
        why = router.task_unroutable(move.task)
        if why:
            router.task_nodes.assign(move.task, before)
            record.outcome = f"undone: {why}"
            self._next()
            return
        record.switched_s, record.outcome = sim.now, "draining"
        sim.to_coordinator([])  # the task's waiting requests may start on the target now
        self._drain(move, record, then_next=self.serial_drains)
        if not self.serial_drains:
            self._next()

    def _drain(self, move: Move, record: MoveRecord, then_next: bool) -> None:
        router = self.sim.core.router
        if router.task_nodes.holds(move.task, move.src):  # moved back meanwhile (drains overlapped): nothing to free
            record.outcome = "moved, then back before the source drained"
            if then_next:
                self._next()
            return
        if router.in_flight(move.task, move.src):
            self.sim.at(self.sim.now + DRAIN_POLL_S, functools.partial(self._drain, move, record, then_next))
            return
        record.freed_s, record.outcome = self.sim.now, "moved"
        if then_next:
            self._next()

    # -- results ------------------------------------------------------------------------------------

    def balance_over_time(self) -> list[tuple[float, float]]:
        """Per ``bucket_s``: (its end, the worst replica group's phi over the requests counted in it)."""
        groups = [g for g in replica_groups(self.sim.core.router.topology.placement) if len(g) > 1]
        out = []
        for i, bucket in enumerate(self.counter.buckets):
            phis = [min(bucket.get(n, 0) for n in g) / top for g in groups if (top := max(bucket.get(n, 0) for n in g))]
            out.append(((i + 1) * self.counter.bucket_s, min(phis, default=1.0)))
        return out

    def report(self, now: float) -> dict[str, Any]:
        """What the run's tasks did: placement, popularity, moves, rounds, the balance over time."""
        t = self.counter.bucket_s
        return {
            "placement": self.sim.cfg.task_placement,
            "popularity": self.tasks.popularity.describe(),
            "pet_balance": self.policy is not None,
            "moves": [asdict(m) for m in self.moves],
            "moves_done": sum(m.switched_s is not None for m in self.moves),  # routing switched to the target
            "rounds": self.rounds,
            "phi_over_time": [(end, phi) for end, phi in self.balance_over_time() if end <= now + t],
            "holders": {task: sorted(nodes) for task, nodes in sorted(self.sim.core.router.task_nodes.restricted().items())},
        }

