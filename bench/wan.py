"""The demo cluster served across three emulated regions: the real system on slow links vs the simulator.

``sudo .venv/bin/python bench/wan.py`` (root: network namespaces and tc; about 5 min for the default 4 rounds,
plus about 1.5 min to profile):

1. profiles the demo cluster's CPU nodes afresh (``bench/fidelity.py``'s ``prepare``: the real
   engine, the three nodes measured together as they serve, then one alone: the simulator's
   crowding, :mod:`simulator.hosts`);
2. writes a three-region cluster file: ``us`` holds the coordinator and ``cpu-0`` (layers
   [0, 30)), ``eu`` holds ``cpu-1`` ([0, 16)), ``asia`` holds ``cpu-2`` ([16, 30)) - the demo
   cluster's layer ranges - with every inter-region link at ``--bandwidth-mbps`` and
   ``--latency-ms`` (``defaults.inter_region``); the plan's flows come from that file, so IWRR
   knows the slow links;
3. builds the regions (``helix.netem.Wan``: one network namespace per region, htb in the kernel
   for the bandwidth of every directed link, the delay line for the latency where the kernel has
   no netem), starts one ``helix agent`` per node inside its region and, per serve, the
   coordinator (HTTP endpoint, OpenAI API) with the load generator in region ``us``;
4. per round, two serves interleaved (``bench/harness.py``): the coordinator's IWRR + KV masking
   and random next hops (``simulator.routing.make_router('random')``: the same router with a
   random chooser and no KV masking, as the simulator's ``--router random``). Each serve sends
   ``--requests`` streamed chat completions at once (fresh prompts per round) and records every
   request's token counts, time to first token and the gaps between its tokens;
5. simulates the very same requests on the same cluster file and plan with the same router
   (``simulator.engine.simulate``, online, all arriving at t = 0), told what it cannot read from
   the file: the three agents share this box's cores (``host_cores``), prefill in chunks of 256
   and wait their 3 ms gather window (as ``bench/fidelity.py`` runs it), and every engine step
   costs the host CPU measured outside the steps in that very serve (agents' messaging, the
   coordinator, the load generator and the delay line, from the agents' step logs); and again
   with one crowded price for every step (the profile's ``alone`` curves dropped), to show what
   the crowding model adds;
6. prints decode throughput (tokens after each request's first / makespan), TTFT p50 and TPOT
   p50 (median gap between consecutive tokens), measured vs simulated, per arm; how busy each
   WAN link was (bytes the kernel sent ÷ what its rate allows in the makespan) and each agent's
   CPU (process CPU ÷ makespan): where throughput was bound.

Verdicts (medians of the per-round ratios): sim ÷ measured within 15 % for decode tok/s, TTFT
and TPOT with IWRR; IWRR ÷ random decode tok/s on the real system.

Nothing here is a test: the numbers depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the packages, not bench/planner.py or bench/router.py

from helix.netem import LinkShape, Wan  # noqa: E402
from helix.plan import Plan  # noqa: E402
from helix.processes import cpu_seconds as process_cpu_seconds  # noqa: E402
from helix.profile import ProfileSet, load_profiles_for  # noqa: E402
from helix.spec import ClusterSpec, load_cluster  # noqa: E402
from node_agent.scheduler import SchedulerConfig  # noqa: E402
from planner.api import finish_plan  # noqa: E402
from router.launch import AgentProcesses  # noqa: E402
from router.serving import ServeOptions, build_coordinator, create_server_app, make_server  # noqa: E402
from simulator.engine import SimConfig, simulate  # noqa: E402
from simulator.routing import make_router  # noqa: E402
from simulator.workload import RequestSpec  # noqa: E402

sys.path.insert(1, str(ROOT / "bench"))  # after the packages: bench/planner.py must not shadow planner/
from fidelity import SENTENCE, logged_steps, prepare  # noqa: E402
from harness import RoundLog, Target, add_rounds_option, interleaved, make_console, report  # noqa: E402

PLACEMENT = {"cpu-0": (0, 30), "cpu-1": (0, 16), "cpu-2": (16, 30)}
REGIONS = ("us", "eu", "asia")
REGION = {"coordinator": "us", "cpu-0": "us", "cpu-1": "eu", "cpu-2": "asia"}
ARMS = ("iwrr", "random")
GATHER_MS = 3.0
DEAD_AFTER_S = 15.0
TOLERANCE = 0.15
FIGURES = (("decode tok/s", "decode_tok_s", "tok/s"), ("TTFT p50", "ttft_s", "s"), ("TPOT p50", "tpot_s", "s"))


def write_cluster(profiled: Path, workdir: Path, bandwidth_gbps: float, latency_ms: float) -> tuple[Path, Path]:
    """The three-region cluster file (profiles: the profiled copy's), and its twin for the simulator
    whose node addresses name one host: the agents share this box's cores."""
    profile = load_cluster(profiled).profile_paths()[0]
    raw: dict[str, Any] = {
        "name": "demo-wan", "model": "smollm2-135m", "profiles": str(profile),
        "coordinator": {"id": "coordinator", "region": REGION["coordinator"]},
        "nodes": [{"id": n, "gpu": "cpu", "region": REGION[n]} | ({"max_layers": 16} if n != "cpu-0" else {})
                  for n in PLACEMENT],
        "defaults": {"intra_region": {"bandwidth_gbps": 10, "latency_ms": 0.1},
                     "inter_region": {"bandwidth_gbps": bandwidth_gbps, "latency_ms": latency_ms}},
    }  # fmt: skip
    path = workdir / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    for i, node in enumerate(raw["nodes"]):
        node["address"] = f"tcp://this-box:{5551 + i}"
    sim_path = workdir / "cluster-sim.yaml"
    sim_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path, sim_path


def wan_links(cluster: ClusterSpec) -> dict[tuple[str, str], LinkShape]:
    """Every directed pair of regions shaped as the cluster file's ``inter_region`` default says."""
    inter = cluster.defaults.inter_region if cluster.defaults else None
    assert inter is not None
    shape = LinkShape(inter.bandwidth_gbps, inter.latency_ms)
    return {(a, b): shape for a in REGIONS for b in REGIONS if a != b}


def chat_prompts(n: int, seed: int) -> list[str]:
    """``n`` chat messages of 1-4 sentences; the mix shifts with ``seed`` (a fresh sample per round)."""
    return [SENTENCE * (1 + (i * 3 + seed) % 4) + "Write a long, detailed story about this fox." for i in range(n)]


@dataclass
class Served:
    """One serve: each request's counts and timings, the makespan, CPU and link bytes."""

    requests: list[dict[str, Any]]  # prompt_tokens, completion_tokens, ttft_s, gaps_s, done_s
    makespan_s: float
    started: float  # time.monotonic() when the requests went out
    cpu_s: dict[str, float]  # process CPU during the serve: agents, "coordinator", "delay line"
    link_bytes: dict[tuple[str, str], int]


async def _stream(client: Any, url: str, model: str, text: str, max_tokens: int, t0: float) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    times: list[float] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter() - t0)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0),
            "ttft_s": times[0] if times else float("nan"), "gaps_s": gaps, "done_s": time.perf_counter() - t0}


def serve(wan: Wan, agents: AgentProcesses, cluster: ClusterSpec, profiles: Any, plan: Plan, arm: str, texts: list[str],
          max_tokens: int, seed: int, secret: str, delay_pid: int | None) -> Served:  # fmt: skip
    """One serve of ``texts`` through a fresh coordinator (router ``arm``) in region us."""
    import httpx

    coordinator = build_coordinator(cluster, plan, profiles, ServeOptions())
    if arm == "random":
        coordinator.core.set_router(make_router("random", coordinator.router, seed=seed)[0])
    # heartbeats cross the slow links behind activations: the default 1.8 s declared cpu-1 dead mid-run
    app = create_server_app(coordinator, agents.addresses(), secret=secret.encode(), dead_after_s=DEAD_AFTER_S,
                            reply_host=wan.address(REGION["coordinator"]))  # fmt: skip
    server: Any = make_server(app, "127.0.0.1", 0)
    pids = {node: a.pid for node, a in agents.agents.items()}
    links = list(wan.links)
    out: dict[str, Any] = {}

    def cpu() -> dict[str, float]:
        extra = {"delay line": process_cpu_seconds(delay_pid)} if delay_pid else {}
        return {n: process_cpu_seconds(p) for n, p in pids.items()} | {"coordinator": time.process_time()} | extra

    async def main() -> None:
        serving = asyncio.create_task(server.serve())
        while not (server.started and coordinator.ready):
            if serving.done():
                serving.result()
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
        model = coordinator.model_names[0]
        try:
            async with httpx.AsyncClient(timeout=600) as client:
                await _stream(client, url, model, "Warm up.", 4, time.perf_counter())
                out["cpu0"], out["bytes0"] = cpu(), {k: wan.link_bytes(*k) for k in links}
                out["started"], t0 = time.monotonic(), time.perf_counter()
                out["requests"] = await asyncio.gather(*(_stream(client, url, model, t, max_tokens, t0) for t in texts))
                out["makespan"] = time.perf_counter() - t0
                out["cpu1"], out["bytes1"] = cpu(), {k: wan.link_bytes(*k) for k in links}
        finally:
            server.should_exit = True
            await serving

    def run() -> None:
        try:
            with wan.entered(REGION["coordinator"]):
                asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run, name=f"coordinator-{arm}")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return Served(out["requests"], out["makespan"], out["started"],
                  {k: out["cpu1"][k] - out["cpu0"][k] for k in out["cpu1"]},
                  {k: out["bytes1"][k] - out["bytes0"][k] for k in links})  # fmt: skip


def outside_step_ms(run: Served, workdir: Path) -> tuple[float, int]:
    """Host CPU per engine step outside the engines' steps during ``run`` (agents' messaging, the
    coordinator and load generator, the delay line), and the number of steps."""
    steps = {node: logged_steps(workdir, node, run.started) for node in PLACEMENT}
    count = sum(len(v) for v in steps.values())
    if not count:
        return 0.0, 0
    in_steps = sum(r["cpu_ms"] for v in steps.values() for r in v) / 1000
    return max(0.0, sum(run.cpu_s.values()) - in_steps) * 1000 / count, count


def measured(run: Served) -> dict[str, float]:
    reqs = run.requests
    gaps = [g for r in reqs for g in r["gaps_s"]]
    return {"decode_tok_s": sum(r["completion_tokens"] - 1 for r in reqs) / run.makespan_s,
            "ttft_s": statistics.median(r["ttft_s"] for r in reqs),
            "tpot_s": statistics.median(gaps) if gaps else float("nan")}  # fmt: skip


def without_alone(profiles: ProfileSet) -> ProfileSet:
    """``profiles`` with every ``alone`` curve dropped: one crowded price at any crowding."""
    gpus = {g: gp.model_copy(update={"throughput": {m: tp.model_copy(update={"alone": None})
                                                    for m, tp in gp.throughput.items()}})
            for g, gp in profiles.gpus.items()}  # fmt: skip
    return profiles.model_copy(update={"gpus": gpus})


def simulated(sim_cluster: ClusterSpec, profiles: Any, plan: Plan, arm: str, run: Served, overhead_ms: float,
              seed: int) -> dict[str, float]:  # fmt: skip
    trace = [RequestSpec(0.0, r["prompt_tokens"], r["completion_tokens"]) for r in run.requests]
    res = simulate(sim_cluster, profiles, plan, SimConfig(
        mode="online", router=arm, trace=trace, num_requests=len(trace), warmup_s=0.0, duration_s=1e6, seed=seed,
        host_cores=os.cpu_count() or 1, prefill_chunk_tokens=SchedulerConfig().chunk_size,
        gather_window_ms=GATHER_MS, iteration_overhead_ms=overhead_ms))  # fmt: skip
    return {"decode_tok_s": res.decode_tok_s, "ttft_s": res.prompt_latency_s["p50"],
            "tpot_s": res.decode_latency_s["p50"]}


def bound_table(runs: dict[str, Served], wan: Wan, bandwidth_gbps: float) -> Table:
    """Where each arm's last serve was bound: each WAN link's busy share, each process's CPU share."""
    table = Table(title="where throughput was bound (last round): link bytes ÷ rate × makespan, process CPU ÷ makespan")
    table.add_column("arm")
    for a, b in wan.links:
        table.add_column(f"{a}→{b}", justify="right")
    names = list(next(iter(runs.values())).cpu_s)
    for name in names:
        table.add_column(f"CPU {name}", justify="right")
    for arm, run in runs.items():
        cap = bandwidth_gbps * 1e9 / 8 * run.makespan_s
        table.add_row(arm, *(f"{run.link_bytes[k] / cap:.0%}" for k in wan.links),
                      *(f"{run.cpu_s[n] / run.makespan_s:.0%}" for n in names))  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24, help="streamed chat completions sent at once per serve")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--bandwidth-mbps", type=float, default=0.5,
                    help="every inter-region link's rate (10^6 bit/s; 0.5 carries ~27 tok/s of activations, far "
                         "below what the agents compute)")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="every inter-region link's one-way latency")
    add_rounds_option(ap, 4, "two serves per round (IWRR, random), interleaved; each round draws its own prompts")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 requests of 16 tokens, one round")
    ap.add_argument("--workdir", help="scratch directory (default: a fresh temporary one)")
    ap.add_argument("--cached-profile", action="store_true",
                    help="take the profile from helix's cache instead of measuring it afresh (about 2 min saved); "
                         "only when the box is in the state it was measured in: a profile taken under other load "
                         "prices every step wrong")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.rounds = 8, 16, 1
    console = make_console()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="helix-wan-"))
    profiled, _ = prepare(workdir, console, force=not args.cached_profile)
    bandwidth_gbps = args.bandwidth_mbps / 1000
    cluster_path, sim_path = write_cluster(profiled, workdir, bandwidth_gbps, args.latency_ms)
    cluster, sim_cluster = load_cluster(cluster_path), load_cluster(sim_path)
    profiles = load_profiles_for(cluster)
    plan = finish_plan(cluster, profiles, PLACEMENT, method="manual")
    plan_path = workdir / "plan.json"
    plan.save(plan_path)
    console.print(f"plan {dict(plan.placement)}: max flow {plan.max_flow_tok_s:.0f} tok/s; flows "
                  + ", ".join(f"{f.src}→{f.dst} {f.tok_s:.0f}" for f in plan.flows))  # fmt: skip

    log = RoundLog()
    secret = secrets.token_hex(16)
    last: dict[str, Served] = {}
    with Wan(REGIONS, wan_links(cluster)) as wan:
        console.print(f"regions {', '.join(REGIONS)}: links {args.bandwidth_mbps} Mbit/s, {args.latency_ms} ms one way "
                      f"(latency by {wan.delay_method})")  # fmt: skip
        delay_pid = wan.delay_line_pid
        t_round = time.perf_counter()
        for r, arm in interleaved(ARMS, args.rounds):
            texts = chat_prompts(args.requests, seed=r)
            rundir = workdir / f"round-{r + 1}-{arm}"  # the agents' logs and step logs
            rundir.mkdir(parents=True, exist_ok=True)
            agents = AgentProcesses(cluster_path, plan_path, rundir, secret=secret,
                                    extra_args=("--step-log", str(rundir / "steps-{node}.jsonl"),
                                                "--gather-window-ms", str(GATHER_MS)),
                                    bind_hosts={n: wan.address(REGION[n]) for n in PLACEMENT},
                                    command_prefix={n: wan.exec_prefix(REGION[n]) for n in PLACEMENT})  # fmt: skip
            with agents:  # fresh agents per serve: their step logs are complete once they stop
                agents.start(PLACEMENT)
                agents.wait_ready()
                run = serve(wan, agents, cluster, profiles, plan, arm, texts, args.max_tokens, r, secret, delay_pid)
            (rundir / "requests.json").write_text(json.dumps(run.requests))  # to simulate the serve again
            overhead, steps = outside_step_ms(run, rundir)
            real, sim = measured(run), simulated(sim_cluster, profiles, plan, arm, run, overhead, r)
            flat = simulated(sim_cluster, without_alone(profiles), plan, arm, run, overhead, r)
            console.print(f"round {r + 1} {arm}: measured {real['decode_tok_s']:.1f} tok/s, simulated "
                          f"{sim['decode_tok_s']:.1f}; TTFT {real['ttft_s']:.2f} / {sim['ttft_s']:.2f} s, TPOT "
                          f"{real['tpot_s'] * 1000:.0f} / {sim['tpot_s'] * 1000:.0f} ms; {steps} steps, "
                          f"{overhead:.2f} ms host CPU per step outside them")  # fmt: skip
            for label, key, unit in FIGURES:
                log.record(r, f"{arm} measured {label}", real[key], unit)
                log.record(r, f"{arm} simulated {label}", sim[key], unit)
                log.record(r, f"{arm} sim ÷ measured {label}", sim[key] / real[key], "")
            log.record(r, f"{arm} sim ÷ measured decode tok/s, one crowded price", flat["decode_tok_s"] / real["decode_tok_s"], "")
            log.record(r, f"{arm} host CPU ms per step", overhead, "ms")
            last[arm] = run
            if arm == arm_last(r):
                log.wall_s.append(time.perf_counter() - t_round)
                t_round = time.perf_counter()
        console.print(bound_table(last, wan, bandwidth_gbps))
    log.ratio("IWRR ÷ random decode tok/s (measured)", "iwrr measured decode tok/s", "random measured decode tok/s")
    log.ratio("IWRR ÷ random decode tok/s (simulated)", "iwrr simulated decode tok/s", "random simulated decode tok/s")
    within = Target("within", 1.0, unit="", tolerance=TOLERANCE)
    targets = {f"iwrr sim ÷ measured {label}": within for label, _, _ in FIGURES}
    targets |= {"random sim ÷ measured decode tok/s": within,
                "IWRR ÷ random decode tok/s (measured)": Target(">=", 1.2)}  # fmt: skip
    report(console, log, f"WAN: the demo cluster over 3 regions ({args.bandwidth_mbps} Mbit/s, {args.latency_ms} ms), "
                         f"{args.requests} requests × {args.max_tokens} tokens, {args.rounds} round(s); {workdir}",
           targets)  # fmt: skip
    return 0


def arm_last(round_index: int) -> str:
    """The arm a round runs last (interleaved order)."""
    return ARMS[-1] if round_index % 2 == 0 else ARMS[0]


if __name__ == "__main__":
    sys.exit(main())
