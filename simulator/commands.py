"""``helix simulate CLUSTER PLAN``: run the simulator and print (or ``--json``) its numbers."""

from __future__ import annotations

import argparse
import json
import math
from typing import TYPE_CHECKING, Any

from helix.errors import ConfigError
from router.commands import add_task_balance_arguments
from simulator.routing import ROUTERS

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_LOAD = 0.75  # online without --rate/--load: this fraction of the plan's max flow


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("cluster", help="cluster YAML")
    p.add_argument("plan", help="plan file (JSON or YAML); flows are computed when it has none")
    p.add_argument("--mode", choices=("offline", "online"), default="offline",
                   help="offline: keep the cluster saturated; online: requests arrive at a rate")
    p.add_argument("--router", choices=ROUTERS, default="iwrr", help="how the coordinator picks each next node")
    p.add_argument("--trace", help="replay a trace (CSV or JSONL: arrival_s, prompt_tokens, output_tokens); implies online")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="online: requests per second")
    rate.add_argument("--load", type=float, help=f"online: fraction of the plan's max flow (default {DEFAULT_LOAD})")
    p.add_argument("--cv", type=float, default=1.0, help="online arrivals: 1 = Poisson, > 1 = bursty Gamma")
    p.add_argument("--lengths", default="azure-conv", help="azure-conv | fixed:P,O | uniform:P0-P1,O0-O1")
    p.add_argument("--duration", type=float, default=600.0, help="measured simulated seconds (after warm-up)")
    p.add_argument("--warmup", type=float, default=60.0, help="simulated seconds before measuring")
    p.add_argument("--seed", type=int, default=0, help="random seed of arrivals, request lengths and the random routers")
    p.add_argument("--watermark", type=float, default=0.85, help="KV high watermark for masking")
    p.add_argument("--max-inflight", type=int, help="offline: keep N requests in flight instead of the KV feeder (sensitivity runs)")
    p.add_argument("--chunk-tokens", type=int,
                   help="nodes prefill one chunk of at most N prompt tokens per iteration (Sarathi, as helix agents do); "
                        "default: whole prompts up to the profile's limit (the paper's vLLM nodes)")
    p.add_argument("--host-cores", type=int,
                   help="nodes whose addresses name one host run at most N iterations at a time (co-located CPU agents)")
    p.add_argument("--flows", choices=("plan", "judge"), default="plan",
                   help="route by the plan's flows, or by the max flow the Helix paper's simulator recomputes "
                        "(networkx preflow-push, hops under 5%% of their vertex's out-flow dropped): score a plan as "
                        "that judge would")
    p.add_argument("--per-request-messages", action="store_true",
                   help="one message per request, back to back, as the paper's simulator sends them (default: one "
                        "message per next hop per batch, as an agent gathers a burst)")
    p.add_argument("--legacy-mechanisms", action="store_true",
                   help="turn off the paper simulator's mechanisms adopted in issue 21 (a lone decode priced as two, "
                        "prompt-count and decode-context limits, host copy per received token)")
    p.add_argument("--tasks", metavar="MIX",
                   help="fine-tuned tasks every request is drawn from evenly: N (N LoRA tasks) or TYPE:N,... (e.g. "
                        "lora:32,adapter:8); 0: the base model only; default: the cluster file's tasks (docs/pets.md)")
    p.add_argument("--task-popularity", default="even", metavar="even|zipf:S",
                   help="how requests pick their task: evenly, or Zipf with exponent S over the tasks (docs/simulator.md)")
    p.add_argument("--popularity-shift-s", type=float, metavar="S",
                   help="reshuffle the Zipf ranking of the tasks every S simulated seconds (default: never)")
    add_task_balance_arguments(p)  # as helix serve: --task-placement, --pet-balance and its settings
    p.add_argument("--pet-load-gb-per-s", type=float, default=2.0,
                   help="a node loads a migrated task's PET at this rate, GB/s (default: %(default)s)")
    p.add_argument("--pet-serial-drains", action="store_true",
                   help="start the next PET move (and round) only once the last move's source drained, not at its "
                        "switch as helix serve does (what waiting for the drains would cost)")
    p.add_argument("--membership", metavar="TRACE",
                   help="replay a membership trace (YAML: nodes killed, leaving and joining at times; docs/simulator.md): "
                        "the coordinator re-plans as helix serve does, and the results say what it cost")
    p.add_argument("--bucket-s", type=float, default=10.0, help="the throughput time line's window (simulated s)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def run_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from helix.console import print_table
    from helix.profile import load_profiles_for
    from helix.spec import load_cluster
    from planner.api import load_for_evaluation
    from router.commands import balance_policy  # helix serve's --pet-balance options, read the same way
    from simulator.engine import SimConfig, simulate
    from simulator.membership_trace import load_membership_trace
    from simulator.results import LEGACY_MECHANISMS
    from simulator.tasks import parse_popularity, parse_task_mix
    from simulator.workload import load_trace

    if args.duration <= 0 or args.warmup < 0:
        raise ConfigError("--duration must be positive and --warmup not negative", field="--duration")
    if args.bucket_s <= 0:
        raise ConfigError(f"must be positive, got {args.bucket_s}", field="--bucket-s")
    for flag, value in (("--chunk-tokens", args.chunk_tokens), ("--host-cores", args.host_cores)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}", field=flag)
    popularity, balance = parse_popularity(args.task_popularity, args.popularity_shift_s), balance_policy(args)
    cluster = load_cluster(args.cluster)
    profiles = load_profiles_for(cluster)
    plan, warnings = load_for_evaluation(args.plan, cluster, profiles)
    for line in warnings:
        Console(stderr=True, highlight=False).print(f"[bold yellow]warning:[/] {escape(line)}")
    trace = load_trace(args.trace) if args.trace else None
    membership = load_membership_trace(args.membership, cluster, plan, profiles) if args.membership else None
    mode = "online" if trace is not None else args.mode
    load = DEFAULT_LOAD if args.load is None and args.rate is None else args.load
    cfg = SimConfig(mode=mode, router=args.router, duration_s=args.duration, warmup_s=args.warmup, seed=args.seed,
                    lengths=args.lengths, rate_per_s=args.rate, load=load, cv=args.cv, trace=trace,
                    watermark=args.watermark, max_inflight=args.max_inflight, host_cores=args.host_cores,
                    prefill_chunk_tokens=args.chunk_tokens, flows=args.flows,
                    per_request_messages=args.per_request_messages, bucket_s=args.bucket_s,
                    task_mix=parse_task_mix(args.tasks) if args.tasks is not None else None,
                    task_popularity=popularity, task_placement=args.task_placement, pet_balance=balance,
                    pet_load_gb_per_s=args.pet_load_gb_per_s, pet_serial_drains=args.pet_serial_drains,
                    **(LEGACY_MECHANISMS if args.legacy_mechanisms else {}))  # type: ignore[arg-type]
    total = args.warmup + args.duration
    if args.json:
        result = simulate(cluster, profiles, plan, cfg, membership=membership)
        print(json.dumps(_clean(result.to_json()), indent=2))
        return 0
    console = Console()
    with Progress(TextColumn("[bold]simulating[/]"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} sim-s"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("sim", total=total)
        result = simulate(cluster, profiles, plan, cfg, progress=lambda t: bar.update(task, completed=min(t, total)),
                          membership=membership)  # fmt: skip
    t = Table(title=f"{cluster.name}: {plan.method} placement, {args.router} routing, {mode}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("decode throughput (tok/s)", f"{result.decode_tok_s:.1f}")
    t.add_row("prompt throughput (tok/s)", f"{result.prompt_tok_s:.1f}")
    for name, d in (("prompt latency (s)", result.prompt_latency_s), ("decode latency (s/token)", result.decode_latency_s)):
        t.add_row(name, "  ".join(f"{k} {v:.3f}" for k, v in d.items()))
    t.add_row("requests finished / admitted", f"{result.finished_requests} / {result.admitted_requests}")
    t.add_row("requests that waited for a node's KV", str(result.kv_waits))
    print_table(console, t)
    console.print(f"measured {args.duration:g} simulated s after a warm-up of {args.warmup:g} s; "
                  f"load: {describe_load(args, mode, len(trace) if trace is not None else None)}")
    nt = Table(title="per node")
    for col in ("node", "layers", "utilization", "KV peak (true)", "KV peak (router estimate)"):
        nt.add_column(col, justify="left" if col == "node" else "right")
    placement = {n: tuple(r) for n, r in (result.membership or {}).get("placement", plan.placement).items()}
    for node in sorted(result.node_utilization, key=lambda n: (placement.get(n, (math.inf,))[0], n)):
        rng = placement.get(node)
        nt.add_row(node, f"[{rng[0]},{rng[1]})" if rng else "gone", f"{result.node_utilization[node]:.0%}",
                   f"{result.kv_peak_fraction[node]:.0%}", f"{result.kv_estimate_peak_fraction.get(node, 0.0):.0%}")
    print_table(console, nt)
    if result.membership is not None:
        print_membership(console, result.membership, result.throughput_over_time, args.bucket_s)
    if result.tasks is not None:
        print_tasks(console, result.tasks, result.throughput_over_time, args.bucket_s)
    return 0


def print_tasks(console: Console, report: dict[str, Any], timeline: list[tuple[float, float]], bucket_s: float) -> None:
    """The tasks' placement and popularity, the PET moves made, throughput and balance (phi) over time."""
    from rich.table import Table

    from helix.console import print_table

    moves = report["moves"]
    console.print(f"tasks: {report['popularity']} popularity, {report['placement']} placement; PET migration "
                  f"{'on' if report['pet_balance'] else 'off'}: {report['moves_done']} moves made "
                  f"({len(moves)} asked) in {sum(r['judged'] for r in report['rounds'])} judged rounds", highlight=False)
    for m in moves[:20]:
        console.print(f"  {m['asked_s']:.1f} s: {m['task']} {m['src']} -> {m['dst']} ({m['requests']:.0f} requests; "
                      f"copy {m['copy_s'] * 1000:.0f} ms): {m['outcome']}", highlight=False)
    if len(moves) > 20:
        console.print(f"  ... and {len(moves) - 20} more (--json lists them)")
    phi = dict(report["phi_over_time"])
    tt = Table(title=f"per {bucket_s:g} s: decode throughput and the worst replica group's balance phi")
    for col in ("until s", "tok/s", "phi"):
        tt.add_column(col, justify="right")
    for t, tok_s in timeline:
        tt.add_row(f"{t:g}", f"{tok_s:.1f}", f"{phi[t]:.2f}" if t in phi else "-")
    print_table(console, tt)


def print_membership(console: Console, report: dict[str, Any], timeline: list[tuple[float, float]],
                     bucket_s: float) -> None:  # fmt: skip
    """A membership trace's cost: the re-plans and their layer moves, failovers, losses, the throughput time line."""
    from rich.table import Table

    from helix.console import print_table

    rt = Table(title="re-plans (planner.replan)")
    for col in ("v", "why", "started s", "planned s", "routed s", "outcome", "nodes moved", "layers loaded"):
        rt.add_column(col, justify="left" if col in ("why", "outcome") else "right")
    for r in report["replans"]:
        moves = r["replan"].get("moves", [])
        rt.add_row(str(r["version"]), "; ".join(r["reasons"]), f"{r['started_s']:.1f}", _s(r["planned_s"]),
                   _s(r["switched_s"]), r["outcome"], str(len(moves)), str(r["replan"].get("layers_moved", "")))
    print_table(console, rt)
    for r in report["replans"]:
        moves = r["replan"].get("moves", [])
        if moves:
            console.print(f"v{r['version']} moves: " + "; ".join(f"{m['node']} {_pair(m['before'])} -> {_pair(m['after'])}"
                                                               for m in moves), highlight=False)  # fmt: skip
    console.print(f"requests re-prefilled (failover): {report['requests_rerouted']}; requests lost: "
                  f"{report['lost_requests']}; time some layer had no live node: {report['uncovered_s']:.1f} s"
                  + (f"; unavailable: {report['unavailable']}" if report["unavailable"] else ""))
    tt = Table(title=f"decode throughput per {bucket_s:g} s")
    tt.add_column("until s", justify="right")
    tt.add_column("tok/s", justify="right")
    for t, tok_s in timeline:
        tt.add_row(f"{t:g}", f"{tok_s:.1f}")
    print_table(console, tt)


def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.1f}"


def _pair(rng: list[int] | None) -> str:
    return "-" if rng is None else f"[{rng[0]},{rng[1]})"


def describe_load(args: argparse.Namespace, mode: str, trace_requests: int | None) -> str:
    """The workload in words: what drives the simulated cluster, and how hard."""
    if trace_requests is not None:
        return f"online: trace {args.trace} ({trace_requests} requests), lengths from the trace"
    if mode == "offline":
        feeder = f"{args.max_inflight} requests kept in flight" if args.max_inflight else "KV feeder keeps it saturated"
        return f"offline: {feeder}; lengths {args.lengths}"
    arrivals = "Poisson" if args.cv == 1.0 else f"Gamma cv {args.cv:g}"
    rate = f"{args.rate:g} requests/s" if args.rate is not None else \
        f"{DEFAULT_LOAD if args.load is None else args.load:.0%} of the plan's max flow"
    return f"online: {rate}, {arrivals} arrivals; lengths {args.lengths}"


def _clean(x: object) -> object:
    if isinstance(x, float):
        return None if math.isnan(x) else x
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x
