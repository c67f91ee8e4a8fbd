"""Simulator benchmark (issue 5): fidelity, placements, routing, KV peaks, speed — one run.

On ``clusters/helix-paper-single24`` (LLaMA-2 70B, offline, 60 s warm-up + 600 s measured):

1. fidelity: the paper's MILP placement with IWRR vs the paper's 252.1 decode tok/s, and
   Swarm's placement with Swarm routing (180 requests in flight, the paper's setting) vs 124.7;
2. placements with IWRR: the paper's MILP and Swarm, our planner's default
   (``make_plan(method="helix")``), the pure max-flow objective, the petals and uniform
   baselines, with their latencies, the planner's serving estimate for each and whether the
   estimate ranks them as the simulator does (discordant pairs);
3. routing on the MILP placement and on our default placement, like for like: every router gets
   the same coordinator admission (the offline feeder on the coordinator's KV estimate,
   ``router.kv``); only the next hop differs (IWRR over the flows with watermark masking vs
   uniform random among valid hops, shortest queue, Swarm-style). Then the paper's own protocol
   (its artifact's ``request_scheduling/setup2``: random, shortest-queue and Swarm routing
   "can not reject a request", so they run at a fixed 180 requests in flight while IWRR feeds on
   its KV estimate), and random routing swept over fixed in-flight counts (90 … 900, and an
   oracle's KV-bound count): how much of IWRR's lead is admission rather than next-hop choice;
4. peak KV per node (true and the router's estimate, IWRR and random); throughput over time
   (steady state); speed and memory;
5. mechanisms (issue 21): every placement above (the paper's MILP, Swarm with its routing and with
   IWRR, our default plan, the max-flow objective's 24-stage chain, petals, uniform) under (a) the
   simulator's old mechanisms (``simulator.results.LEGACY_MECHANISMS``), each adopted mechanism of
   the paper's simulator added alone (a lone decode priced as two; the prompt-count and
   decode-context limits of its vLLM nodes; the host copy per received token), (b) all of them (the
   simulator's default, which every other table runs) and (c) (b) routed by the flows the paper's
   simulator recomputes (``SimConfig.flows = "judge"``), beside the planner's serving estimate under
   those flows (``planner.api.serving_estimate(..., flows="judge")``), and (d) (c) with its one message per
   request (``SimConfig.per_request_messages``, not adopted), beside the published figures, so
   each placement's movement is attributed to a mechanism.

The headline figures (both fidelities, our default placement ÷ the paper's MILP under (b) and (c),
the planner's estimate ÷ the simulator on the placement where they differ most, under (b) and
(c), IWRR ÷ random routing, the wall time of a run) are judged in rounds (``bench/harness.py``): each round
simulates them with a fresh seed (arrivals and lengths), the detailed tables come from round 1
(seed 0), and the verdicts are on the medians with how many rounds pass.

Run: ``.venv/bin/python bench/simulate.py [--rounds 3]`` (``--quick`` for a 120 s window).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from helix.plan import Plan, load_plan  # noqa: E402
from helix.profile import load_profiles_for  # noqa: E402
from helix.spec import load_cluster  # noqa: E402
from planner.api import evaluate_plan, serving_estimate  # noqa: E402
from simulator.engine import SimConfig, SimResult, Simulation, simulate  # noqa: E402
from simulator.results import LEGACY_MECHANISMS  # noqa: E402
from simulator.short_run import run_short  # noqa: E402

sys.path.insert(1, str(ROOT / "bench"))  # after the packages: bench/planner.py must not shadow planner/
from harness import RoundLog, Target, add_rounds_option, report  # noqa: E402

PAPER = ROOT / "clusters" / "helix-paper-single24"
PAPER_MILP, PAPER_SWARM = 252.1, 124.7
JUDGE_MILP = 254.5  # issue 21: the paper's simulator on its MILP placement, 120 + 480 s
# issue 21's mechanisms, each added alone to the old ones: (column, SimConfig fields it sets to their default)
MECHANISMS = (("+ decode 1=2", ("decode_floor",)), ("+ batch limits", ("prompt_slot_tokens", "decode_context_per_slot")),
              ("+ host copy", ("host_copy_gb_per_s",)))
PAPER_FIXED_INFLIGHT = 180  # the artifact's in-flight count for routers without KV admission (Swarm, random)
FID_MILP, FID_SWARM = "paper MILP + IWRR, decode tok/s", "Swarm + Swarm routing, decode tok/s"
OURS_VS_MILP = "helix default ÷ paper MILP (IWRR), decode"
OURS_VS_MILP_JUDGE = "helix default ÷ paper MILP, both routed by the judge's flows, decode"
IWRR_PAPER = "IWRR ÷ random at a fixed 180 in flight (paper's protocol), MILP placement"
IWRR_FEEDER = "IWRR ÷ random with IWRR's KV feeder, MILP placement"
WALL = "wall s, Swarm + swarm routing run"
EST_WORST = "planner estimate ÷ simulator (b), the placement farthest from 1"
EST_WORST_JUDGE = "planner estimate ÷ simulator (c), both under the judge's flows, the farthest from 1"
TARGETS = {FID_MILP: Target("within", PAPER_MILP, unit="tok/s", tolerance=0.15),
           FID_SWARM: Target("within", PAPER_SWARM, unit="tok/s", tolerance=0.15),
           OURS_VS_MILP: Target(">=", 1.2), OURS_VS_MILP_JUDGE: Target(">=", 1.2), IWRR_PAPER: Target(">=", 1.2),
           IWRR_FEEDER: Target(">=", 1.2), WALL: Target("<=", 60.0, unit="s"),
           EST_WORST: Target("within", 1.0, tolerance=0.15), EST_WORST_JUDGE: Target("within", 1.0, tolerance=0.15)}


def ranking_line(est: dict[str, float | None], sim: dict[str, float]) -> str:
    """Whether the planner's estimate orders the placements as the simulator does (Kendall-style)."""
    names = [n for n in sim if est.get(n) is not None]
    pairs = discordant = 0
    bad: list[str] = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pairs += 1
            if (est[a] - est[b]) * (sim[a] - sim[b]) < 0:  # type: ignore[operator]
                discordant += 1
                bad.append(f"{a} vs {b}")
    by_sim = " > ".join(sorted(names, key=lambda n: -sim[n]))
    by_est = " > ".join(sorted(names, key=lambda n: -est[n]))  # type: ignore[operator]
    verdict = "[green]orders agree[/]" if discordant == 0 else f"[red]orders disagree[/] ({'; '.join(bad)})"
    tau = 1 - 2 * discordant / pairs if pairs else 1.0
    return (f"ranking: {discordant} discordant pair(s) of {pairs} (Kendall tau {tau:+.2f}): {verdict}\n"
            f"  simulator: {by_sim}\n  planner:   {by_est}")


def cluster_layers(profiles: Any, cluster: Any) -> int:
    return int(profiles.models[cluster.model].num_layers)


def layer_ranges(plan: Plan, num_layers: int) -> str:
    """How many distinct layer ranges the placement has, and "chain" when they tile the model one
    node each (a pipeline of that many stages)."""
    ranges = sorted(set(plan.placement.values()))
    chain = len(ranges) == len(plan.placement) and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)) \
        and ranges[0][0] == 0 and ranges[-1][1] == num_layers
    return f"{len(ranges)}{' (chain)' if chain else ''}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--planner-time-limit", type=float, default=60.0)
    ap.add_argument("--plans-dir", type=Path, help="reuse our planner's plans saved here (saved on the first run)")
    add_rounds_option(ap, 3, "the headline figures, a fresh seed each; the figures are deterministic per seed, "
                             "only the wall time is a timing")
    args = ap.parse_args()
    plans_dir: Path | None = args.plans_dir
    if plans_dir is not None:
        plans_dir.mkdir(parents=True, exist_ok=True)
    duration, warmup = (120.0, 60.0) if args.quick else (600.0, 60.0)
    console = Console(width=170)
    t_start = time.perf_counter()
    cluster = load_cluster(PAPER / "cluster.yaml")
    profiles = load_profiles_for(cluster)
    # the reference placements carry no flows: give them planner.graph's (what the router computes for
    # a flow-less plan anyway), so the simulator and the planner's estimate read the same flows
    milp = evaluate_plan(cluster, profiles, load_plan(PAPER / "reference" / "milp.json"))
    swarm_plan = evaluate_plan(cluster, profiles, load_plan(PAPER / "reference" / "swarm.json"))

    def run(plan: Plan, router: str = "iwrr", seed: int = 0, **kw: Any) -> tuple[SimResult, float]:
        t0 = time.perf_counter()
        res = simulate(cluster, profiles, plan, SimConfig(router=router, duration_s=duration, warmup_s=warmup,
                                                          seed=seed, **kw))
        return res, time.perf_counter() - t0

    # 1. fidelity (+ speed and memory on the first run)
    tracemalloc.start()
    r_milp, wall_milp = run(milp)
    _, peak_traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    r_swarm, wall_swarm = run(swarm_plan, "swarm", max_inflight=PAPER_FIXED_INFLIGHT)
    t = Table(title=f"Fidelity vs the paper's simulator (offline, {warmup:.0f}+{duration:.0f} s)")
    for c in ("placement + router", "decode tok/s", "paper", "error", "within 15%"):
        t.add_column(c, justify="left" if c.startswith("placement") else "right")
    for name, r, ref in (("paper MILP + IWRR/KV", r_milp, PAPER_MILP), ("Swarm + Swarm routing", r_swarm, PAPER_SWARM)):
        err = r.decode_tok_s / ref - 1
        t.add_row(name, f"{r.decode_tok_s:.1f}", f"{ref:.1f}", f"{err:+.1%}", "yes" if abs(err) <= 0.15 else "NO")
    console.print(t)

    # 2. placements: every plan carries the flows the router uses, and the planner scores each
    plans: list[tuple[str, Plan]] = [("paper MILP (reference)", milp), ("paper Swarm (reference)", swarm_plan)]
    try:
        from planner.api import make_plan
    except ImportError:
        console.print("[yellow]planner.api.make_plan is not available yet: skipping our planner's placements[/]")
    else:
        for label, method, objective in (("helix planner (default objective)", "helix", "serving"),
                                         ("helix planner (max-flow objective)", "helix", "max-flow"),
                                         ("petals baseline", "petals", "serving"), ("uniform baseline", "uniform", "serving")):
            cached = plans_dir / f"{method}-{objective}.json" if plans_dir else None
            t0 = time.perf_counter()
            if cached is not None and cached.is_file():
                plan = load_plan(cached)
                how = f"loaded from {cached}"
            else:
                plan = make_plan(cluster, profiles, method=method, objective=objective,
                                 time_limit_s=args.planner_time_limit, threads=1, simulator=run_short)
                how = f"planned in {time.perf_counter() - t0:.0f} s"
                if cached is not None:
                    plan.save(cached)
            console.print(f"[dim]{label}: {how}, max flow {plan.max_flow_tok_s:.1f}[/]")
            plans.append((label, plan))
    console.print("[dim]flows: the reference placements get theirs from planner.api.evaluate_plan (networkx max "
                  "flow on planner.graph); the helix plans carry the optimizer's balanced flows, the baselines "
                  "planner.api.finish_plan's. The simulator's router and the planner's estimate read the same "
                  "plan.flows.[/]")
    sims: dict[str, SimResult] = {}
    ests: dict[str, float | None] = {}
    t = Table(title="Placements, all with IWRR + KV masking (offline)")
    for c in ("placement", "max flow", "planner decode est.", "decode tok/s (sim)", "est ÷ sim", "× paper MILP",
              "prompt tok/s", "prompt p50 s", "from admission", "decode p50 s/tok"):
        t.add_column(c, justify="left" if c == "placement" else "right")
    for label, plan in plans:
        r = r_milp if plan is milp else run(plan)[0]
        est = serving_estimate(cluster, profiles, plan)  # the default objective's serving model
        sims[label], ests[label] = r, est
        t.add_row(label, f"{plan.max_flow_tok_s:.1f}", "-" if est is None else f"{est:.1f}", f"{r.decode_tok_s:.1f}",
                  "-" if est is None else f"{est / r.decode_tok_s:.2f}",
                  f"{r.decode_tok_s / r_milp.decode_tok_s:.2f}", f"{r.prompt_tok_s:.1f}",
                  f"{r.prompt_latency_s['p50']:.2f}", f"{r.extra['prompt_latency_from_admission_p50_s']:.2f}",
                  f"{r.decode_latency_s['p50']:.3f}")
    console.print(t)
    console.print("[dim]prompt p50: arrival to first token (a request waits in the coordinator's queue while KV "
                  "masks every route); from admission: as the paper's simulator counts it[/]")
    console.print(ranking_line(ests, {k: v.decode_tok_s for k, v in sims.items()}))

    head = RoundLog()
    head.record(0, FID_MILP, r_milp.decode_tok_s, "tok/s")
    head.record(0, FID_SWARM, r_swarm.decode_tok_s, "tok/s")
    head.record(0, WALL, wall_swarm, "s")
    if "helix planner (default objective)" in sims:
        head.record(0, OURS_VS_MILP, sims["helix planner (default objective)"].decode_tok_s / r_milp.decode_tok_s, "×")
    est_ratios = [ests[k] / sims[k].decode_tok_s for k in sims if ests.get(k) is not None]  # type: ignore[operator]
    if est_ratios:
        head.record(0, EST_WORST, max(est_ratios, key=lambda x: abs(x - 1.0)), "×")

    # 2b. mechanisms (issue 21): which of the paper simulator's mechanisms moves each placement
    short = {"paper MILP (reference)": "paper MILP", "paper Swarm (reference)": "paper Swarm",
             "helix planner (default objective)": "helix default", "helix planner (max-flow objective)": "helix max-flow",
             "petals baseline": "petals", "uniform baseline": "uniform"}
    mech_rows: list[tuple[str, Plan, str, dict[str, Any], SimResult, str]] = [
        (short.get(label, label), plan, "iwrr", {}, sims[label],
         f"{PAPER_MILP:.1f}, judge {JUDGE_MILP:.1f}" if plan is milp else "") for label, plan in plans]
    mech_rows.insert(2, ("paper Swarm, Swarm routing @180", swarm_plan, "swarm", {"max_inflight": PAPER_FIXED_INFLIGHT},
                         r_swarm, f"{PAPER_SWARM:.1f}"))
    t = Table(title=f"Mechanisms of the paper's simulator, decode tok/s (offline, {warmup:.0f}+{duration:.0f} s, IWRR "
                    "unless named): (a) old, each mechanism added alone, (b) all adopted (the default), (c) (b) routed "
                    "by the judge's flows")
    for c in ("placement", "ranges", "(a) old", *(m for m, _ in MECHANISMS), "(b) adopted", "(c) judge flows",
              "(c) est", "est ÷ (c)", "(d) + messages", "paper", "(b)÷(a)", "(c)÷(b)"):
        t.add_column(c, justify="left" if c == "placement" else "right")
    defaults = SimConfig()
    by_mode: dict[str, dict[str, float]] = {"a": {}, "b": {}, "c": {}, "d": {}}
    judge_est_ratios: list[float] = []
    for label, plan, router, kw, adopted, published in mech_rows:
        old = run(plan, router, **kw, **LEGACY_MECHANISMS)[0]
        alone = [run(plan, router, **kw, **{**LEGACY_MECHANISMS, **{f: getattr(defaults, f) for f in fields}})[0]
                 for _, fields in MECHANISMS]
        flows = {"flows": "judge"} if router == "iwrr" else {}  # Swarm routing does not route by flows
        judged = run(plan, router, **flows, **kw)[0] if flows else None
        messages = run(plan, router, per_request_messages=True, **flows, **kw)[0]
        by_mode["a"][label], by_mode["b"][label] = old.decode_tok_s, adopted.decode_tok_s
        by_mode["d"][label] = messages.decode_tok_s
        judged_est = serving_estimate(cluster, profiles, plan, flows="judge") if judged is not None else None
        if judged is not None:
            by_mode["c"][label] = judged.decode_tok_s
            if judged_est is not None:
                judge_est_ratios.append(judged_est / judged.decode_tok_s)
        t.add_row(label, layer_ranges(plan, cluster_layers(profiles, cluster)), f"{old.decode_tok_s:.1f}",
                  *(f"{r.decode_tok_s:.1f}" for r in alone), f"{adopted.decode_tok_s:.1f}",
                  "-" if judged is None else f"{judged.decode_tok_s:.1f}",
                  "-" if judged_est is None else f"{judged_est:.1f}",
                  "-" if judged_est is None or judged is None else f"{judged_est / judged.decode_tok_s:.2f}",
                  f"{messages.decode_tok_s:.1f}",
                  published or "-", f"{adopted.decode_tok_s / old.decode_tok_s:.2f}",
                  "-" if judged is None else f"{judged.decode_tok_s / adopted.decode_tok_s:.2f}")
    console.print(t)
    console.print("[dim](c) judge flows: networkx's preflow-push max flow of the placement (the plan's flows ignored), "
                  "hops under 5 % of their vertex's out-flow dropped (simulator.routing.judge_router); Swarm routing "
                  "does not route by flows. (d): (c) with the paper simulator's one message per request, so batches "
                  "fragment at idle nodes (SimConfig.per_request_messages; not adopted: our agents gather a burst). "
                  "paper: the published decode tok/s; judge: issue 21's run of the paper's simulator.[/]")
    ours, ref = "helix default", "paper MILP"
    if ours in by_mode["a"]:
        console.print("helix default ÷ paper MILP, decode: " + "; ".join(
            f"({mode}) {by_mode[mode][ours] / by_mode[mode][ref]:.2f}" for mode in ("a", "b", "c", "d"))
            + " (the judge gave 0.99 for a similar plan of ours, issue 21)")
        head.record(0, OURS_VS_MILP_JUDGE, by_mode["c"][ours] / by_mode["c"][ref], "×")
    if judge_est_ratios:
        head.record(0, EST_WORST_JUDGE, max(judge_est_ratios, key=lambda x: abs(x - 1.0)), "×")

    # 3. routing: the same coordinator admission (the KV feeder on router.kv's estimate) for every
    # router, only the next-hop choice differs; fixed-concurrency runs are sensitivity rows
    routing_on = [("paper MILP", milp, r_milp)]
    default_plan = next((p for label, p in plans if "default objective" in label), None)
    if default_plan is not None:
        routing_on.append(("helix default", default_plan, sims["helix planner (default objective)"]))
    random_runs: dict[str, SimResult] = {}
    for pname, plan, r_iwrr in routing_on:
        oracle = Simulation(cluster, profiles, plan, SimConfig()).kv_bound_inflight()
        t = Table(title=f"Routing on the {pname} placement (offline)")
        for c in ("router", "admission", "mean in flight", "decode tok/s", "IWRR ÷ this", "waited for KV",
                  "max KV peak (true)", "prompt p50 s", "decode p50 s/tok"):
            t.add_column(c, justify="left" if c in ("router", "admission") else "right")
        rows: list[tuple[str, str, SimResult]] = [("IWRR + KV masking", "KV feeder", r_iwrr)]
        for label, router in (("random (no masking)", "random"), ("shortest queue", "shortest-queue"),
                              ("swarm-style", "swarm")):
            r = run(plan, router)[0]
            rows.append((label, "KV feeder", r))
            if router == "random":
                random_runs[pname] = r
        paper_rows = [(label, router, PAPER_FIXED_INFLIGHT, "paper protocol: fixed") for label, router in
                      (("random (no masking)", "random"), ("shortest queue", "shortest-queue"), ("swarm-style", "swarm"))]
        sweep = sorted({90, 270, 540, oracle} | ({900} if plan is milp else set()))  # 900: one placement is enough
        fixed = paper_rows + [("random (no masking)", "random", n, "sweep: fixed") for n in sweep]
        fixed.append(("IWRR + KV masking", "iwrr", oracle, "sweep: fixed"))
        random_fixed: dict[int, float] = {}
        for label, router, n, kind in fixed:
            r = run(plan, router, max_inflight=n)[0]
            rows.append((label, f"{kind} {n}", r))
            if router == "random":
                random_fixed[n] = r.decode_tok_s
        for label, adm, r in rows:
            t.add_row(label, adm, f"{r.extra.get('mean_inflight', float('nan')):.0f}", f"{r.decode_tok_s:.1f}",
                      f"{r_iwrr.decode_tok_s / r.decode_tok_s:.2f}", str(r.kv_waits),
                      f"{max(r.kv_peak_fraction.values()):.0%}", f"{r.prompt_latency_s['p50']:.2f}",
                      f"{r.decode_latency_s['p50']:.3f}")
        console.print(t)
        if plan is milp:
            head.record(0, IWRR_PAPER, r_iwrr.decode_tok_s / random_fixed[PAPER_FIXED_INFLIGHT], "×")
            head.record(0, IWRR_FEEDER, r_iwrr.decode_tok_s / random_runs[pname].decode_tok_s, "×")
        best_n = max(random_fixed, key=random_fixed.__getitem__)
        console.print(
            f"IWRR + KV masking ÷ random routing on the {pname} placement (target ≥ 1.2): "
            f"paper's protocol (random at a fixed {PAPER_FIXED_INFLIGHT} in flight) "
            f"{r_iwrr.decode_tok_s / random_fixed[PAPER_FIXED_INFLIGHT]:.2f}x; random at its best fixed count of the "
            f"sweep ({best_n}) {r_iwrr.decode_tok_s / random_fixed[best_n]:.2f}x; random given IWRR's own KV feeder "
            f"{r_iwrr.decode_tok_s / random_runs[pname].decode_tok_s:.2f}x")
        console.print(f"[dim]fixed {oracle} = requests of expected length the fullest layer's KV holds at "
                      f"feed_hwm (an oracle's choice no real router makes)[/]")

    # 4. KV peaks (true use never passes capacity: the nodes' schedulers reserve it first) and steady state
    for pname, plan, r_iwrr in routing_on:
        r_rand = random_runs[pname]
        t = Table(title=f"Peak KV per node, {pname} placement, KV feeder (fraction of the node's KV capacity)")
        for c in ("node", "layers", "IWRR true peak", "IWRR router estimate peak", "IWRR utilization",
                  "random true peak", "random router estimate peak"):
            t.add_column(c, justify="left" if c == "node" else "right")
        for node, (s, e) in sorted(plan.placement.items(), key=lambda x: (x[1][0], x[0])):
            t.add_row(node, f"[{s},{e})", f"{r_iwrr.kv_peak_fraction[node]:.0%}",
                      f"{r_iwrr.kv_estimate_peak_fraction.get(node, 0):.0%}", f"{r_iwrr.node_utilization[node]:.0%}",
                      f"{r_rand.kv_peak_fraction[node]:.0%}", f"{r_rand.kv_estimate_peak_fraction.get(node, 0):.0%}")
        console.print(t)
    series = r_milp.throughput_over_time
    console.print("decode tok/s over time (10 s buckets), paper MILP + IWRR: "
                  + " ".join(f"{v:.0f}" for _, v in series))
    per_min = [sum(v for t_, v in series if m * 60 < t_ <= (m + 1) * 60) / 6 for m in range(int(series[-1][0] // 60))]
    console.print("per-minute means: " + " ".join(f"{v:.0f}" for v in per_min))

    # 5. speed
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sim_s = warmup + duration
    t = Table(title="Speed and size (24 nodes, one run)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("target", justify="right")
    t.add_row("simulated seconds", f"{sim_s:.0f}", "600+")
    t.add_row("wall seconds (MILP + IWRR, under tracemalloc)", f"{wall_milp:.1f}", "≤ 60")
    t.add_row("wall seconds (Swarm + swarm routing)", f"{wall_swarm:.1f}", "≤ 60")
    t.add_row("sim-seconds per wall-second", f"{sim_s / wall_swarm:.0f}", "")
    t.add_row("events (MILP + IWRR)", f"{r_milp.events}", "")
    t.add_row("peak traced Python memory (MiB)", f"{peak_traced / 2**20:.1f}", "")
    t.add_row("peak RSS of this whole bench process (MiB)", f"{rss_mb:.0f}", "≤ 1024")
    console.print(t)

    # 6. the headline figures in rounds: round 1 is the run above (seed 0), each further round a fresh seed
    head.wall_s.append(time.perf_counter() - t_start)
    default_plan = next((p for label, p in plans if "default objective" in label), None)
    for r in range(1, args.rounds):
        console.print(f"[dim]headline round {r + 1} of {args.rounds} (seed {r})[/]")
        t0 = time.perf_counter()
        m = run(milp, seed=r)[0]
        sw, wall = run(swarm_plan, "swarm", seed=r, max_inflight=PAPER_FIXED_INFLIGHT)
        head.record(r, FID_MILP, m.decode_tok_s, "tok/s")
        head.record(r, FID_SWARM, sw.decode_tok_s, "tok/s")
        head.record(r, WALL, wall, "s")
        if default_plan is not None:
            head.record(r, OURS_VS_MILP, run(default_plan, seed=r)[0].decode_tok_s / m.decode_tok_s, "×")
            head.record(r, OURS_VS_MILP_JUDGE, run(default_plan, seed=r, flows="judge")[0].decode_tok_s
                        / run(milp, seed=r, flows="judge")[0].decode_tok_s, "×")
        fixed = run(milp, "random", seed=r, max_inflight=PAPER_FIXED_INFLIGHT)[0]
        head.record(r, IWRR_PAPER, m.decode_tok_s / fixed.decode_tok_s, "×")
        head.record(r, IWRR_FEEDER, m.decode_tok_s / run(milp, "random", seed=r)[0].decode_tok_s, "×")
        head.wall_s.append(time.perf_counter() - t0)
    report(console, head, f"Headline figures, {args.rounds} round(s) (round r: simulation seed r - 1; round 1 "
                          "also ran every table above)", {k: v for k, v in TARGETS.items() if k in head.names})
    return 0


if __name__ == "__main__":
    sys.exit(main())
