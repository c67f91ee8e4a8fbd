"""The short simulation the planner's simulated refinement asks for (``planner.simulated.RunSimulation``).

The planner may not import the simulator (the simulator imports the planner's flows), so
``helix plan``'s serving search receives :func:`run_short` from the command line's composition
root (``helix.cli.WIRING``); benches and tests pass it to ``make_plan(simulator=...)`` themselves.
"""

from __future__ import annotations

from collections.abc import Callable

from helix.plan import Plan
from helix.profile import ProfileSet
from helix.spec import ClusterSpec
from planner.simulated import ShortRun, SimRun
from simulator.engine import SimConfig, simulate


def run_short(cluster: ClusterSpec, profiles: ProfileSet, plan: Plan, run: ShortRun,
              progress: Callable[[float], None]) -> SimRun:
    """An offline run of ``plan`` as ``run`` asks (its flows, window and seed), the simulator's defaults otherwise."""
    result = simulate(cluster, profiles, plan,
                      SimConfig(warmup_s=run.warmup_s, duration_s=run.measure_s, seed=run.seed, flows=run.flows),
                      progress=progress)  # fmt: skip
    return SimRun(result.decode_tok_s, result.prompt_latency_s["p50"], result.decode_latency_s["p50"])
