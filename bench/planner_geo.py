"""The planner bench's geo section (issue 17): ``python bench/planner.py --only geo [--quick] [--rounds N]``.

For every generated geo cluster (``bench/geo_clusters.py``: ``GEO_SEEDS`` and the issue's 24-node cluster),
LLaMA-2 70B with the paper's throughput tables, regions joined by slow links:

* ``helix --objective max-flow`` in 60 s on ``--threads`` threads: max flow, the proven (link-aware) bound
  and the gap; the same planner with 600 s (round 1 only; ``--quick`` skips it): the 60 s plan must reach at
  least what the 600 s one finds;
* the baselines petals, swarm and uniform (partial hand-offs): our max flow over the best of them (>= 1.3x);
* the default (serving) objective's plan (60 s, with the simulated refinement, as ``helix plan`` runs it)
  and the max-flow plan, each simulated by our simulator (offline, 300 + 600 s; ``--quick`` 120 + 300 s, seed =
  the round) routed by the plan's flows: serving over max-flow decode tokens/s (>= 1).

Rounds (``bench/harness.py``): round r plans with search seed r - 1 and simulates with seed r - 1; the verdicts
are on the medians. The table of round 1 shows every cluster's figures.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from harness import RoundLog, Target, report
from rich.table import Table

from helix.plan import Plan
from helix.profile import load_profiles_for
from helix.spec import load_cluster

LIMIT_S = 60.0
LONG_LIMIT_S = 600.0
BASELINES = ("petals", "swarm", "uniform")
# simulated warm-up and measured seconds: on geo clusters a request's round trip is seconds per token, so the
# decode rate still climbs for minutes (geo-s2-n32's max-flow plan: 32, 124, 217 tok/s after 30 + 120,
# 60 + 300, 300 + 600 s; 199 after 600 + 600); the comparison is made where both plans have levelled off
SIM_FULL = (300.0, 600.0)
SIM_QUICK = (120.0, 300.0)


def _simulate(cluster: Any, profiles: Any, plan: Plan, *, quick: bool, seed: int) -> float:
    from simulator.engine import SimConfig, simulate

    warmup, duration = SIM_QUICK if quick else SIM_FULL
    return simulate(cluster, profiles, plan, SimConfig(warmup_s=warmup, duration_s=duration, seed=seed)).decode_tok_s


def _depth(plan: Plan) -> str:
    st = plan.stats
    return f"{st.get('depth_min', 0):.0f}/{st.get('depth_mean', 0):.1f}/{st.get('depth_max', 0):.0f}"


def bench_geo(threads: int, quick: bool, rounds: int, *, out: Any, err: Any, run_timed: Any) -> None:
    """Run the geo section (module docstring), tables to ``out``, status lines to ``err``;
    ``run_timed(label, cluster, profiles, **kw)`` plans with a progress line and returns ``(plan or error
    text, progress)`` (bench/planner.py's)."""
    import geo_clusters

    from simulator.short_run import run_short

    log = RoundLog()
    targets: dict[str, Target] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = geo_clusters.write_geo_clusters(Path(tmp))
        table = Table(title=f"geo clusters · LLaMA-2 70B · max-flow objective {LIMIT_S:.0f} s, {threads} threads "
                            "(round 1)")
        for col in ("cluster", "nodes", "60 s tok/s", "bound", "gap", "600 s tok/s", "depth 60 s",
                    "best baseline", "÷ best", "sim serving", "sim max-flow", "serving ÷ max-flow"):
            table.add_column(col, justify="left" if col == "cluster" else "right")
        for path in paths:
            cluster = load_cluster(path)
            profiles = load_profiles_for(cluster)
            name = cluster.name
            base: dict[str, float] = {}
            for method in BASELINES:
                plan, _ = run_timed(f"{name}: {method}", cluster, profiles, method=method)
                if isinstance(plan, Plan):
                    base[method] = plan.max_flow_tok_s
            best_name, best = max(base.items(), key=lambda kv: kv[1], default=("—", 0.0))
            long: float | None = None
            if not quick:
                plan, _ = run_timed(f"{name}: helix max-flow {LONG_LIMIT_S:.0f} s", cluster, profiles, method="helix",
                                    objective="max-flow", time_limit_s=LONG_LIMIT_S, threads=threads)
                long = plan.max_flow_tok_s if isinstance(plan, Plan) else None
            row: list[str] = []
            for r in range(rounds):
                mf, _ = run_timed(f"{name}: helix max-flow {LIMIT_S:.0f} s, round {r + 1}/{rounds}", cluster, profiles,
                                  method="helix", objective="max-flow", time_limit_s=LIMIT_S, threads=threads, seed=r)
                sv, _ = run_timed(f"{name}: helix serving {LIMIT_S:.0f} s, round {r + 1}/{rounds}", cluster, profiles,
                                  method="helix", objective="serving", time_limit_s=LIMIT_S, threads=threads, seed=r,
                                  simulator=run_short)
                if not isinstance(mf, Plan):
                    out.print(f"[red]{name}: max-flow plan failed: {mf}[/]")
                    continue
                flow, bound = mf.max_flow_tok_s, mf.upper_bound_tok_s
                gap = 100.0 * (1 - flow / bound) if bound else None
                log.record(r, f"{name}: max flow 60 s", flow, "tok/s")
                log.record(r, f"{name}: gap to the bound", round(gap, 2) if gap is not None else None, "%")
                log.record(r, f"{name}: ÷ best baseline ({best_name})", flow / best if best else None, "×")
                if long is not None:
                    log.record(r, f"{name}: 60 s ÷ 600 s", flow / long if long else None, "×")
                sim_mf = sim_sv = None
                if isinstance(sv, Plan):
                    with err.status(f"{name}: simulating both plans (seed {r})"):
                        sim_mf = _simulate(cluster, profiles, mf, quick=quick, seed=r)
                        sim_sv = _simulate(cluster, profiles, sv, quick=quick, seed=r)
                    log.record(r, f"{name}: simulated serving ÷ max-flow plan",
                               sim_sv / sim_mf if sim_mf else None, "×")
                if r == 0:
                    row = [name, str(len(cluster.nodes)), f"{flow:.1f}", f"{bound:.1f}" if bound else "—",
                           f"{gap:.1f}%" if gap is not None else "—", f"{long:.1f}" if long is not None else "skipped",
                           _depth(mf), f"{best:.1f} ({best_name})", f"{flow / best:.2f}x" if best else "—",
                           f"{sim_sv:.1f}" if sim_sv is not None else "—", f"{sim_mf:.1f}" if sim_mf is not None else "—",
                           f"{sim_sv / sim_mf:.2f}x" if sim_sv and sim_mf else "—"]
                    out.print(f"[dim]{name}: bound {mf.bound_method}; max-flow plan {mf.status}, {mf.wall_s:.1f} s; "
                              f"serving plan {_depth(sv) if isinstance(sv, Plan) else sv}[/]")
            if row:
                table.add_row(*row)
            targets[f"{name}: gap to the bound"] = Target("<=", 10.0, unit="%")
            targets[f"{name}: ÷ best baseline ({best_name})"] = Target(">=", 1.3)
            if long is not None:
                targets[f"{name}: 60 s ÷ 600 s"] = Target(">=", 1.0 - 1e-6)
            targets[f"{name}: simulated serving ÷ max-flow plan"] = Target(">=", 1.0)
    out.print(table)
    report(out, log, f"geo clusters, {rounds} round(s) (round r: search and simulation seed r - 1), {threads} threads",
           targets)

