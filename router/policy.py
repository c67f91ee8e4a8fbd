"""The routing facade the coordinator (and the simulator) drive: plan in, pipelines out.

:class:`Router` owns one :class:`~router.iwrr.IWRR` per vertex (weights = the plan's flows),
the :class:`~router.pipeline.Topology` of the placement and a
:class:`~router.kv.KVEstimator`. ``route(request)`` builds the request's pipeline hop by hop
(IWRR, skipping dead nodes and nodes whose KV would pass the watermark) and reserves its KV;
``finish(request_id)`` releases it. Pure and step-driven: no sockets, no clocks.

Nodes are masked two ways: ``dead`` (gone: not routed, not reached) and ``draining`` (leaving, or
whose layers move: not routed, but still finishing the requests they run). A re-plan builds a new
router and :meth:`Router.adopt` hands it the old one's requests in flight.

A request for a fine-tuned task is routed only through the nodes holding the task's PET
(``task_nodes``, :class:`router.task_placement.TaskPlacement`: by default every node holds every
task); :meth:`Router.task_unroutable` says why a task has no route through them.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass

from helix.domain import Pipeline
from helix.errors import ConfigError, NoRouteError
from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from router.iwrr import IWRR
from router.kv import DEFAULT_WATERMARK, KVEstimator
from router.pipeline import Chooser, Topology, build_pipeline
from router.task_placement import TaskPlacement


@dataclass(slots=True)
class RouteRequest:
    """What routing needs to know about a request."""

    request_id: object
    prompt_tokens: int
    expected_output_tokens: float | None = None  # None: the estimator's default
    task: str = ""  # a fine-tuned task: routed only through nodes holding it ("": the base model)


def plan_flows(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet | None) -> dict[tuple[str, str], float]:
    """The plan's flow per edge; computed with ``planner.graph`` when the plan carries none."""
    if plan.flows:
        return {(e.src, e.dst): e.tok_s for e in plan.flows}
    if profiles is None:
        raise ConfigError("the plan has no flows; give the profiles so they can be computed", field="flows")
    from planner.capacity import CapacityModel
    from planner.graph import evaluate

    result = evaluate(
        CapacityModel.build(cluster, profiles), dict(plan.placement), partial_handoffs=plan.partial_handoffs, with_cut=False
    )
    return {(e.src, e.dst): e.tok_s for e in result.flows}


def kv_capacity_from_profiles(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet) -> dict[str, float]:
    """KV entries each placed node holds, from ``kv_capacity_tokens_by_layers``."""
    out: dict[str, float] = {}
    for node, (s, e) in plan.placement.items():
        tp = profiles.throughput(cluster.node(node).gpu, cluster.model)
        if tp.kv_capacity_tokens_by_layers is not None:
            out[node] = tp.kv_capacity_tokens_by_layers[e - s - 1]
    return out


class Router:
    """Per-request pipelines by IWRR over the plan's flows, with KV high-watermark masking."""

    def __init__(
        self,
        topology: Topology,
        flows: Mapping[tuple[str, str], float],
        kv: KVEstimator,
        *,
        mask_kv: bool = True,
        chooser: Chooser | None = None,
        task_nodes: TaskPlacement | None = None,
    ) -> None:
        self.topology = topology
        self.task_nodes = task_nodes if task_nodes is not None else TaskPlacement()
        self.kv = kv
        self.mask_kv = mask_kv
        self.dead: set[str] = set()
        self.draining: set[str] = set()
        self.pipelines: dict[object, Pipeline] = {}
        self.task_of: dict[object, str] = {}  # request id -> its fine-tuned task, while its pipeline is held
        self.iwrr: dict[str, IWRR] = {
            v: IWRR(succ, [flows.get((v, c), 0.0) for c in succ]) for v, succ in topology.successors.items()
        }
        self._choose: Chooser = chooser if chooser is not None else self._iwrr_choose

    def _iwrr_choose(self, vertex: str, excluded: Container[str], ok: Callable[[str], bool]) -> str | None:
        return self.iwrr[vertex].pick(excluded, ok)

    @classmethod
    def from_plan(
        cls,
        plan: Plan,
        cluster: ClusterSpec,
        profiles: ProfileSet | None = None,
        *,
        kv_capacity: Mapping[str, float] | None = None,
        watermark: float = DEFAULT_WATERMARK,
        expected_output_tokens: float = 232.0,
        num_layers: int | None = None,
        **kwargs: object,
    ) -> Router:
        """A router for ``plan`` on ``cluster``. KV capacities come from ``kv_capacity``
        (entries per node) or else from the profiles; flows from the plan or the profiles."""
        if num_layers is None:
            if profiles is None:
                raise ConfigError("give the profiles or num_layers", field="num_layers")
            num_layers = profiles.models[cluster.model].num_layers
        if kv_capacity is None:
            kv_capacity = kv_capacity_from_profiles(plan, cluster, profiles) if profiles is not None else {}
        links = set(cluster.resolved_links())
        topology = Topology(
            cluster.coordinator.id, num_layers, plan.placement, links, partial_handoffs=plan.partial_handoffs
        )
        kv = KVEstimator(kv_capacity, watermark=watermark, expected_output_tokens=expected_output_tokens)
        return cls(topology, plan_flows(plan, cluster, profiles), kv, **kwargs)  # type: ignore[arg-type]

    # -- routing ----------------------------------------------------------------------------

    def route(self, request: RouteRequest) -> Pipeline:
        """Build ``request``'s pipeline and reserve its KV; NoRouteError if none exists now."""
        kv = self.kv
        tokens = kv.tokens_for(request.prompt_tokens, request.expected_output_tokens)
        dead = self._masked(request.task)
        if self.mask_kv:
            fits = kv.fits

            def admissible(node: str, start: int, end: int) -> bool:
                return node not in dead and fits(node, tokens * (end - start))
        else:

            def admissible(node: str, start: int, end: int) -> bool:
                return node not in dead

        pipeline = build_pipeline(self.topology, self._choose, admissible)
        kv.reserve(request.request_id, [(s.node, s.layer_end - s.layer_start) for s in pipeline.stages], tokens)
        self.pipelines[request.request_id] = pipeline
        if request.task:
            self.task_of[request.request_id] = request.task
        return pipeline

    def finish(self, request_id: object) -> None:
        """The request is done (or cancelled): release its KV reservation. Idempotent."""
        self.kv.release(request_id)
        self.pipelines.pop(request_id, None)
        self.task_of.pop(request_id, None)

    def in_flight(self, task: str, node: str) -> int:
        """Requests for ``task`` holding a pipeline through ``node`` (a migrated PET is freed there at 0)."""
        pipelines = self.pipelines
        return sum(1 for rid, t in self.task_of.items() if t == task and node in pipelines[rid].nodes)

    def pipeline_of(self, request_id: object) -> Pipeline | None:
        return self.pipelines.get(request_id)

    def adopt(self, old: Router) -> None:
        """Take over ``old``'s requests in flight (a re-plan switched routers): their pipelines, and their
        KV reservations on the nodes this router knows, so they are released here when they finish; and
        the tasks' holders (one record for the coordinator's life)."""
        self.task_nodes = old.task_nodes
        self.pipelines.update(old.pipelines)
        self.task_of.update(old.task_of)
        self.kv.adopt(old.kv)

    # -- cluster state ----------------------------------------------------------------------

    def mark_dead(self, node: str) -> list[object]:
        """Stop routing through ``node``; returns the requests in flight on it (to re-route)."""
        self.dead.add(node)
        return [rid for rid, p in self.pipelines.items() if node in p.nodes]

    def mark_alive(self, node: str) -> None:
        self.dead.discard(node)

    def _masked(self, task: str = "") -> set[str]:
        """Nodes not routed through: dead, draining, and for ``task`` the nodes not holding its PET."""
        masked = self.dead | self.draining if self.draining else self.dead
        held = self.task_nodes.holders(task)
        return masked if held is None else masked | (self.topology.placement.keys() - held)

    def routable_placement(self) -> dict[str, tuple[int, int]]:
        """The layers of every node routed through (neither dead nor draining), by node."""
        masked = self._masked()
        return {n: r for n, r in self.topology.placement.items() if n not in masked}

    def describe_down(self) -> str:
        """The nodes not routed through and the layers no routable node holds (NoRouteError's message)."""
        why = f"nodes down: {', '.join(sorted(self._masked())) or 'none'}"
        missing = ", ".join(f"[{s}, {e})" for s, e in self.uncovered())
        return f"{why}; no live node holds layers {missing}" if missing else why

    def task_unroutable(self, task: str) -> str:
        """Why no request for ``task`` can be routed now (its holders down, or holding too few layers;
        a NoRouteError's message naming the task); "" when one can (KV aside), or for a task every node holds."""
        held = self.task_nodes.holders(task)
        if held is None or self.has_route(task):
            return ""
        down = sorted(held & self._masked())
        holders = ", ".join(sorted(held)) or "no node"
        missing = ", ".join(f"[{s}, {e})" for s, e in self.uncovered(task))
        why = f"no live node holding it holds layers {missing}" if missing else "they form no complete pipeline"
        down_note = f" (down: {', '.join(down)})" if down else ""
        return f"task {task!r} has no route: it is held by {holders}{down_note}; {why}"

    def uncovered(self, task: str = "") -> list[tuple[int, int]]:
        """The layer ranges no routable node of the placement holds (what a route lacks; for ``task``:
        no routable node holding it)."""
        masked = self._masked(task)
        held = [r for n, r in self.topology.placement.items() if n not in masked]
        out: list[tuple[int, int]] = []
        for layer in range(self.topology.num_layers):
            if not any(s <= layer < e for s, e in held):
                if out and out[-1][1] == layer:
                    out[-1] = (out[-1][0], layer + 1)
                else:
                    out.append((layer, layer + 1))
        return out

    def report_kv(self, node: str, *, used: float, reserved: float | None = None, capacity: float | None = None) -> None:
        self.kv.report(node, used=used, reserved=reserved, capacity=capacity)

    def can_ever_fit(self, tokens: int) -> bool:
        """Whether some live pipeline could hold ``tokens`` if its nodes' KV were empty."""
        kv, dead = self.kv, self._masked()

        def admissible(node: str, start: int, end: int) -> bool:
            cap = kv.nodes[node].capacity if node in kv.nodes else None
            return node not in dead and (cap is None or tokens * (end - start) <= kv.watermark * cap)

        try:
            build_pipeline(self.topology, lambda v, ex, ok: _first(self.topology.successors[v], ex, ok), admissible)
        except NoRouteError:
            return False
        return True

    def has_route(self, task: str = "") -> bool:
        """Whether a complete pipeline exists through live nodes (holding ``task``), ignoring KV."""
        dead = self._masked(task)
        try:
            build_pipeline(self.topology, lambda v, ex, ok: _first(self.topology.successors[v], ex, ok),
                           lambda n, s, e: n not in dead)
        except NoRouteError:
            return False
        return True


def _first(cands: tuple[str, ...], excluded: Container[str], ok: Callable[[str], bool]) -> str | None:
    for c in cands:
        if c not in excluded and ok(c):
            return c
    return None
