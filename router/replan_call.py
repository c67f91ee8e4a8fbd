"""What the coordinator's re-planner process runs (:class:`helix.processes.WorkerProcess`, started by
:mod:`router.membership_driver`): a re-plan's membership from the cluster file, and ``planner.replan``
over it. The planner (numpy, HiGHS, pulp) is imported in that process only: what comes back to the
coordinator (:class:`ReplanResult`) holds helix's types only, so unpickling it imports no planner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec, NodeSpec

if TYPE_CHECKING:
    from planner.replan import Replan


@dataclass(frozen=True, slots=True)
class ReplanResult:
    """A re-plan as the coordinator uses it: the membership's cluster and its new plan, and what the
    planner decided (``incremental`` or ``from-scratch``) with how many layers the nodes must load."""

    cluster: ClusterSpec
    plan: Plan
    decision: str
    layers_moved: int


def replan_membership(base: ClusterSpec, nodes: Sequence[NodeSpec], profiles: ProfileSet, current: Plan,
                      time_limit_s: float, replan: Callable[..., object] | None = None) -> ReplanResult:  # fmt: skip
    """The cluster of ``nodes`` (``base``'s nodes less those not among them, plus those ``base`` lacks) and
    its re-plan from ``current`` within ``time_limit_s``; ``replan``: the re-planner, ``replan(cluster,
    profiles, current, options)`` (default ``planner.replan.replan``)."""
    from planner.replan import ReplanOptions, with_nodes, without_nodes
    from planner.replan import replan as default_replan

    keep = {n.id for n in nodes}
    cluster = with_nodes(without_nodes(base, [n for n in base.node_ids if n not in keep]),
                         [n for n in nodes if n.id not in base.node_ids])  # fmt: skip
    r: Replan = (replan or default_replan)(cluster, profiles, current, ReplanOptions(time_limit_s=time_limit_s))  # type: ignore[assignment]
    return ReplanResult(cluster, r.plan, r.decision, r.layers_moved)
