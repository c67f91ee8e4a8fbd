"""The planner's CLI commands: ``helix plan`` (``--from``: re-planning, ``planner.replan``), ``helix evaluate``
and ``helix show``.

``helix.cli`` imports this module only when one of these commands runs. Output is for a
person (rich tables on stdout, a live progress line on stderr) unless ``--json``, which
prints only the plan JSON to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from helix.console import print_table
from helix.errors import ConfigError, HelixError
from helix.plan import Plan, load_placement, node_inflow
from helix.profile import ProfileSet, load_profiles_for
from helix.spec import ClusterSpec, load_cluster
from planner.api import (
    METHODS,
    OBJECTIVES,
    baseline_placements,
    evaluate_plan,
    finish_plan,
    load_for_evaluation,
    make_plan,
    serving_estimate,
)
from planner.budget import Clock, Deadline, describe_stop
from planner.capacity import CapacityModel


def _load(path: str) -> tuple[ClusterSpec, ProfileSet]:
    cluster = load_cluster(path)
    return cluster, load_profiles_for(cluster)


# -- helix plan ------------------------------------------------------------------------------


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("cluster", help="cluster YAML (profiles are found from it)")
    p.add_argument("--method", default="helix", choices=METHODS, help="planner (default: helix, our optimizer)")
    p.add_argument("--objective", default=None, choices=OBJECTIVES,
                   help="what the helix method optimizes (default serving; with --from, the plan's)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="solve time limit in seconds (default 60; 10 with --from)")
    p.add_argument("--threads", type=int, default=2, metavar="N", help="solver threads (default 2)")
    p.add_argument("--no-partial", action="store_true", help="no partial-layer hand-offs (next node starts where the last ended)")
    p.add_argument("--prune-links", type=float, default=0.0, metavar="FRAC", help="drop the slowest FRAC of each node's links")
    p.add_argument("--warm-start", metavar="PLAN", help="start the search from this plan file's placement")
    p.add_argument("--stop-at-bound", action="store_true", help="stop as soon as the result meets the proven bound")
    p.add_argument("--stall-window", type=float, default=None, metavar="S",
                   help="helix: stop when the best plan has not improved for S seconds "
                        "(default: max(3, a quarter of the time limit); 0: never)")
    p.add_argument("--solver", default="highs", choices=("highs", "cbc", "gurobi"), help="MILP solver (default highs)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the search")
    p.add_argument("--no-simulate", action="store_true",
                   help="end the serving search without re-ranking its best placements by short simulations")
    p.add_argument("--from", dest="from_plan", metavar="PLAN",
                   help="re-plan: start from this plan; CLUSTER is the new membership (nodes missing from it left, "
                        "nodes new to it join); few layers move, and the moves are listed (docs/planner.md)")
    p.add_argument("--move-cost", type=float, default=0.002, metavar="C",
                   help="--from: the price of one layer a node must load, as a share of the objective (default 0.002)")
    p.add_argument("--fallback-below", type=float, default=0.95, metavar="R",
                   help="--from: use the plan from scratch when the incremental one's objective is below R times "
                        "its (default 0.95; 0: never plan from scratch)")
    p.add_argument("--compare", action="store_true", help="also show the baselines' max flow beside ours")
    p.add_argument("--json", action="store_true", help="print only the plan JSON to stdout")
    p.add_argument("-o", "--output", metavar="PLAN", help="write the plan to this file (.json or .yaml)")


class _ProgressLine:
    """A one-line live status on stderr: incumbent, bound, phase and the elapsed time, which
    ticks between reports (the line is re-rendered several times a second)."""

    def __init__(self, enabled: bool, clock: Clock = time.monotonic, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.enabled = enabled and self.console.is_terminal
        self.clock = clock
        self.t0 = clock()
        self.parts: list[str] = []
        self.status: Any = None

    def __enter__(self) -> _ProgressLine:
        if self.enabled:
            self.status = self.console.status(self)
            self.status.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status is not None:
            self.status.__exit__(None, None, None)

    def __rich__(self) -> Text:
        return Text(self.text())

    def text(self) -> str:
        """The line as it reads now (the elapsed time is computed at every render)."""
        elapsed = f"{self.clock() - self.t0:.0f} s"
        return "planning: " + ", ".join([*self.parts[:-1], elapsed, *self.parts[-1:]] if self.parts else [elapsed])

    def __call__(self, report: Any) -> None:
        inc = _field(report, "incumbent_tok_s", "incumbent", "best")
        bnd = _field(report, "bound_tok_s", "upper_bound_tok_s", "bound")
        est = _field(report, "serving_tok_s")
        parts = []
        if est is not None:
            parts.append(f"serving est. {est:.1f} decode tok/s")
        parts.append(f"max flow {inc:.1f} tok/s" if inc is not None else "no incumbent yet")
        parts.append(f"bound {bnd:.1f}" if bnd is not None else "bound —")
        msg = _field(report, "message", "phase")
        parts.append(msg if isinstance(msg, str) and msg else "solving")
        self.parts = parts
        if self.status is not None:
            self.status.update(self)


def _field(report: Any, *names: str) -> Any:
    for name in names:
        if isinstance(report, dict) and name in report:
            return report[name]
        if hasattr(report, name):
            return getattr(report, name)
    return None


def _warn(lines: list[str]) -> None:
    err = Console(stderr=True, highlight=False)
    for line in lines:
        err.print(f"[bold yellow]warning:[/] {escape(line)}")


def run_plan(args: argparse.Namespace) -> int:
    if args.threads < 1:
        raise ConfigError("must be at least 1", field="--threads")
    if args.time_limit is None:
        args.time_limit = 10.0 if args.from_plan else 60.0
    if args.time_limit <= 0:
        raise ConfigError("must be positive", field="--time-limit")
    deadline = Deadline.after(args.time_limit)  # the limit covers loading and planning
    cluster, profiles = _load(args.cluster)
    if args.from_plan:
        return run_replan(args, cluster, profiles, deadline)
    warm = None
    if args.warm_start:
        loaded, warnings = load_for_evaluation(args.warm_start, cluster, profiles)
        _warn(warnings)
        warm = dict(loaded.placement)
    with _ProgressLine(enabled=not args.json) as progress:
        plan = make_plan(
            cluster,
            profiles,
            method=args.method,
            objective=args.objective or "serving",
            time_limit_s=args.time_limit,
            threads=args.threads,
            partial_handoffs=not args.no_partial,
            prune_links=args.prune_links,
            warm_start=warm,
            stop_at_bound=args.stop_at_bound,
            solver=args.solver,
            seed=args.seed,
            on_progress=progress,
            stall_s=args.stall_window,
            deadline=deadline,
            simulate=not args.no_simulate,
            simulator=getattr(args, "simulator", None),  # handed in by helix.cli (WIRING)
        )
    if args.output:
        plan.save(args.output)
    if args.json:
        sys.stdout.write(plan.to_json() + "\n")
        return 0
    console = Console(highlight=False)
    print_plan(console, plan, cluster, profiles)
    if args.compare:
        print_compare(console, plan, cluster, profiles, partial_handoffs=not args.no_partial)
    if args.output:
        console.print(f"plan written to [bold]{args.output}[/]")
    return 0


def run_replan(args: argparse.Namespace, cluster: ClusterSpec, profiles: ProfileSet, deadline: Deadline) -> int:
    """``helix plan CLUSTER --from PLAN``: re-plan for the new membership, print the moves and the plan."""
    from planner.replan import ReplanOptions, replan  # imported when used: it pulls in the solvers
    from planner.replan_view import print_moves

    current = load_placement(args.from_plan, cluster=cluster.name, model=cluster.model)
    options = ReplanOptions(objective=args.objective, time_limit_s=args.time_limit, move_cost=args.move_cost,
                            fallback_below=args.fallback_below, partial_handoffs=not args.no_partial, seed=args.seed)
    result = replan(cluster, profiles, current, options, deadline=deadline)
    if args.output:
        result.plan.save(args.output)
    if args.json:
        sys.stdout.write(result.plan.to_json() + "\n")
        return 0
    console = Console(highlight=False)
    print_moves(console, result, {n.id: n.gpu for n in cluster.nodes})
    print_plan(console, result.plan, cluster, profiles)
    if args.output:
        console.print(f"plan written to [bold]{args.output}[/] (the moves under stats.replan)")
    return 0


def print_plan(console: Console, plan: Plan, cluster: ClusterSpec, profiles: ProfileSet) -> None:
    cap = CapacityModel.build(cluster, profiles)
    gpu = {n.id: n.gpu for n in cluster.nodes}
    through = node_inflow(plan.flows, cluster.coordinator.id)
    table = Table(title=f"{plan.cluster} · {plan.model} · method {plan.method}")
    for col in ("node", "GPU", "layers", "#", "flow tok/s", "capacity tok/s", "util"):
        table.add_column(col, justify="right" if col not in ("node", "GPU", "layers") else "left")
    for node, s, e in plan.stages():
        c = cap.node_capacity(node, e - s)
        f = through.get(node, 0.0)
        util = f / c if c > 0 else 0.0
        style = "bold red" if util > 0.999 else ("dim" if f <= 1e-9 else "")
        table.add_row(node, gpu[node], f"[{s}, {e})", str(e - s), f"{f:.1f}", f"{c:.1f}", f"{util:.0%}", style=style)
    idle = [n for n in cluster.node_ids if n not in plan.placement]
    for node in idle:
        table.add_row(node, gpu[node], "—", "0", "0.0", "—", "—", style="dim")
    print_table(console, table)
    line = f"[bold]max flow {plan.max_flow_tok_s:.1f} tok/s[/]"
    if plan.upper_bound_tok_s:
        gap = 1 - plan.max_flow_tok_s / plan.upper_bound_tok_s if plan.upper_bound_tok_s > 0 else 0.0
        line += f"   upper bound {plan.upper_bound_tok_s:.1f} ({plan.bound_method}), gap {gap:.1%}"
    console.print(line)
    if plan.bottleneck:
        shown = ", ".join(plan.bottleneck[:6]) + (f", … ({len(plan.bottleneck)} edges)" if len(plan.bottleneck) > 6 else "")
        console.print(f"bottleneck (min cut): {shown}")
    st = plan.stats
    if "depth_mean" in st:
        kv = f", min KV per layer {st['kv_tokens_min_layer']:,.0f} tokens" if "kv_tokens_min_layer" in st else ""
        console.print(f"pipeline depth min/mean/max {st['depth_min']:.0f}/{st['depth_mean']:.1f}/{st['depth_max']:.0f} stages{kv}")
    if plan.score:
        console.print("serving score: " + ", ".join(f"{k} {v:.4g}" for k, v in plan.score.items()))
    console.print(
        f"method {plan.method}, objective {plan.objective}, status {plan.status}, "
        f"solver {plan.solver or '—'}, wall {plan.wall_s:.1f} s, partial hand-offs {'on' if plan.partial_handoffs else 'off'}"
    )
    if plan.stop_reason:
        console.print(describe_stop(plan.stop_reason, plan.stats.get("stall_window_s")))
    if plan.stats.get("balanced_flows") is False:
        console.print("flows: a maximum flow, not balanced over parallel nodes (the balancing QP did not finish in time)")


def print_compare(console: Console, plan: Plan, cluster: ClusterSpec, profiles: ProfileSet, *, partial_handoffs: bool) -> None:
    """This plan beside the baselines, ranked by what the plan optimised: the serving estimate
    (objective ``serving``, the default) or the max flow."""
    serving = plan.objective == "serving"
    rows = [(plan.method + " (this plan)", plan)]
    for name, placement in baseline_placements(cluster, profiles).items():
        rows.append((name, finish_plan(cluster, profiles, placement, method=name, partial_handoffs=partial_handoffs)))
    est = {name: serving_estimate(cluster, profiles, p) for name, p in rows}

    def key(name: str, p: Plan) -> float:
        return (est[name] or 0.0) if serving else p.max_flow_tok_s

    if serving:
        console.print(
            "compared by the serving estimate (decode tok/s the serving model expects, counting pipeline "
            "depth, per-hop latency and KV per layer), which this plan optimises; max flow counts prompt "
            "and decode tokens alike and ignores latency and KV, so a baseline may show a higher max flow "
            "yet serve less."
        )
        cols = ("method", "serving est. decode tok/s", "vs ours", "max flow tok/s", "depth mean", "min KV/layer")
    else:
        console.print(
            "compared by max flow (tokens/s through the cluster graph), which this plan maximises; the "
            "serving estimate (decode tok/s) is shown beside it."
        )
        cols = ("method", "max flow tok/s", "vs ours", "serving est. decode tok/s", "depth mean", "min KV/layer")
    table = Table(title="compared with the baselines")
    for col in cols:
        table.add_column(col, justify="left" if col == "method" else "right")
    ours = key(*rows[0])
    for name, p in [rows[0], *sorted(rows[1:], key=lambda r: key(*r), reverse=True)]:
        theirs = key(name, p)
        kv = p.stats.get("kv_tokens_min_layer")
        est_text = f"{est[name]:.1f}" if est[name] is not None else "—"
        flow_text = f"{p.max_flow_tok_s:.1f}"
        table.add_row(
            name,
            est_text if serving else flow_text,
            f"{ours / theirs:.2f}x" if theirs > 0 else "—",
            flow_text if serving else est_text,
            f"{p.stats.get('depth_mean', 0):.1f}",
            f"{kv:,.0f}" if kv is not None else "—",
        )
    from planner import baselines

    for name in baselines.BASELINES:
        if name not in {r[0] for r in rows}:
            table.add_row(name, "infeasible", "—", "—", "—", "—", style="dim")
    print_table(console, table)


# -- helix evaluate --------------------------------------------------------------------------


def add_evaluate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("cluster", help="cluster YAML")
    p.add_argument("plan", help="plan file (.json or .yaml) whose placement to evaluate")
    p.add_argument("--no-partial", action="store_true", help="no partial-layer hand-offs")
    p.add_argument("--json", action="store_true", help="print only the evaluated plan JSON")


def run_evaluate(args: argparse.Namespace) -> int:
    cluster, profiles = _load(args.cluster)
    loaded, warnings = load_for_evaluation(args.plan, cluster, profiles)
    _warn(warnings)
    plan = evaluate_plan(cluster, profiles, loaded, partial_handoffs=not args.no_partial)
    if args.json:
        sys.stdout.write(plan.to_json() + "\n")
        return 0
    print_plan(Console(highlight=False), plan, cluster, profiles)
    return 0


# -- helix show ------------------------------------------------------------------------------


def add_show_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan file")
    p.add_argument("--cluster", required=True, help="cluster YAML the plan is for")
    p.add_argument("--png", required=True, metavar="OUT", help="where to write the chart")


def run_show(args: argparse.Namespace) -> int:
    cluster, profiles = _load(args.cluster)
    plan, warnings = load_for_evaluation(args.plan, cluster, profiles)
    _warn(warnings)
    if not plan.flows:
        plan = evaluate_plan(cluster, profiles, plan, partial_handoffs=plan.partial_handoffs)
    try:
        from planner.viz import save_plan_png
    except ImportError as exc:  # pragma: no cover - matplotlib is a test/extra dependency
        raise HelixError(f"helix show needs matplotlib ({exc})") from None
    save_plan_png(plan, cluster, profiles, Path(args.png))
    Console(highlight=False).print(f"wrote [bold]{escape(str(args.png))}[/]", soft_wrap=True)  # a path stays whole
    return 0
