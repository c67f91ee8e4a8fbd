"""What one planning run is asked for: the method, the objective and the search's settings.

:class:`PlannerOptions` is made once (``planner.api.make_plan`` makes it from ``helix plan``'s flags
or a caller's keywords) and read by the method it names. :class:`Method` and :class:`Objective`
are string enums whose values are the strings of ``--method`` / ``--objective`` and of plan.json's
``method`` / ``objective``. A bad value raises a ConfigError naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, TypeVar

from helix.errors import ConfigError
from planner.baselines import BASELINES

if TYPE_CHECKING:  # the simulated refinement imports the solvers; the options stay light
    from planner.simulated import Refinement

E = TypeVar("E", bound=StrEnum)


class Method(StrEnum):
    """How a placement is found."""

    HELIX = "helix"  # our optimizer (planner.optimize)
    PAPER_MILP = "paper-milp"  # the paper's MILP (planner.milp)
    PETALS = "petals"  # the paper's baselines (planner.baselines)
    SWARM = "swarm"
    SEPARATE = "separate"
    UNIFORM = "uniform"

    @property
    def is_baseline(self) -> bool:
        return self.value in BASELINES

    @classmethod
    def parse(cls, value: str) -> Method:
        return _parse(cls, value, "method", "--method")


class Objective(StrEnum):
    """What the ``helix`` method optimizes (the other methods maximize the max flow)."""

    SERVING = "serving"  # the serving model's estimate of decode tokens/s (planner.serving_model)
    MAX_FLOW = "max-flow"  # the max flow of the cluster graph (planner.graph)

    @classmethod
    def parse(cls, value: str) -> Objective:
        return _parse(cls, value, "objective", "--objective")


def _parse(enum: type[E], value: str, what: str, flag: str) -> E:
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(m.value for m in enum)
        raise ConfigError(f"unknown {what} {value!r} (choose from {choices})", field=flag) from None


@dataclass(frozen=True, slots=True)
class PlannerOptions:
    """One planning run's settings (``helix plan``'s flags; ``planner.api.make_plan``'s keywords)."""

    method: Method = Method.HELIX
    objective: Objective = Objective.SERVING  # helix only
    time_limit_s: float = 60.0  # the whole run, loading and the final check included
    threads: int = 2  # solver threads (paper-milp)
    partial_handoffs: bool = True  # a node may start mid-way through the previous node's layers
    prune_links: float = 0.0  # drop the slowest share, in [0, 1), of every node's links (paper-milp, helix)
    stop_at_bound: bool = False  # stop once the max flow meets the proven bound
    solver: str = "highs"  # paper-milp's MILP solver: highs, cbc or gurobi (planner.solvers)
    seed: int = 0  # the local search's random seed (helix)
    stall_s: float | None = None  # helix: stop after this long without a gain (None: planner.budget's default)
    simulate: bool | Refinement = True  # helix, serving: end with the simulated refinement (planner.simulated)

    def __post_init__(self) -> None:
        # strings are accepted where the enums are expected (keywords, notebooks, tests)
        object.__setattr__(self, "method", Method.parse(self.method))
        object.__setattr__(self, "objective", Objective.parse(self.objective))
