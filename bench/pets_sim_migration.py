"""PET migration vs a static task assignment at scale, in the simulator (issue 19): the ``sim-migration`` section
of ``bench/pets_balance.py``, runnable alone.

    python bench/pets_sim_migration.py [--sim-stages 8] [--sim-replicas 3] [--sim-tasks 64] [--sim-zipf 1.1]
        [--sim-shift-s 60] [--sim-duration-s 600] [--sim-load 0.95] [--sim-lengths azure-conv]
        [--sim-clients N] [--sim-max-batch 256] [--rounds 3]

The cluster: LLaMA-2 70B on A100s of the Helix paper's profiles (``clusters/helix-paper-single24``), cut into
``--sim-stages`` layer ranges of equal size, each held by ``--sim-replicas`` nodes (a replica group: the
nodes PetS balances between), every link the paper cluster's (8 Gbit/s, 1 ms); the plan's flows are
``planner.api.evaluate_plan``'s. ``--sim-tasks`` LoRA tasks (``helix simulate --tasks lora:N``) are placed
``spread`` (``helix serve --task-placement spread``: each on one node of every replica group, so a task's
requests run through one pipeline of nodes); each request runs a task drawn from a Zipf popularity
(exponent ``--sim-zipf``) whose ranking is reshuffled every ``--sim-shift-s`` simulated seconds (the same
schedule in both arms of a round; each round its own seed).

The load: online Poisson arrivals at ``--sim-load`` times the requests/s the same cluster finishes when every
node holds every task (the simulator's offline KV feeder, measured once before the rounds): as much as the
cluster serves, were the tasks' load spread evenly. Or, with ``--sim-clients N``, N clients in a closed
loop (each sends its next request when its last one ends; ``bench/pets_migration.py``'s protocol).
``--sim-max-batch`` bounds each node's running requests (``helix agent --max-batch-size``; vLLM's
``max_num_seqs`` is 256 by default on an A100); 0: only its KV bounds them, as the paper's simulator.

* **ideal** (``--sim-ideal``): every node holds every task (``--task-placement all``), routed by IWRR:
  what holding every task everywhere gains. Not a bound: IWRR routes blind to the nodes' queues, and
  a balancer that reads them passes it where nodes are bounded;
* **static**: the spread assignment stays;
* **migration**: ``--pet-balance`` with ``helix serve``'s defaults (theta 0.9, interval 1-60 s,
  ``--sim-min-requests`` a window): the real ``router.pet_balancer.PetBalancer`` at simulated times, each
  move copying the task's PET for the target's layers at 2 GB/s and switching routing, the next move and
  round going on while the source drains and is freed once its requests there are over, as ``helix serve``
  does (``simulator/pet_migration.py``);
* **migration, serial drains**: the same, but the next move and round wait until the last source is freed
  (``helix simulate --pet-serial-drains``; what ``helix serve`` did before): what waiting for each drain costs.

Figures per round: each arm's decode throughput (tokens/s over the measured window), the mean balance
``phi`` (the worst replica group's least-counted node's requests over its most-counted's, per 10 s), the
moves made; the ratios of the migration arms ÷ static. Target (the issue's): ≥ 1.2× (PetS: up to 29 % on 8 GPUs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

from harness import RoundLog, Target, add_rounds_option, interleaved, make_console, report  # noqa: E402

SINGLE24 = ROOT / "clusters" / "helix-paper-single24" / "cluster.yaml"
ARMS = ("static", "migration", "migration, serial drains")
IDEAL = "ideal"
TARGET = 1.2
out = make_console()


def replicated_cluster(stages: int, replicas: int) -> tuple[Any, Any, Any]:
    """A100s of the paper's profiles, ``stages`` equal layer ranges each held by ``replicas`` nodes: (cluster,
    profiles, plan with its flows)."""
    from helix.plan import Plan
    from helix.profile import load_profiles_for
    from helix.spec import ClusterSpec, load_cluster
    from planner.api import evaluate_plan

    paper = load_cluster(SINGLE24)
    profiles = load_profiles_for(paper)
    layers = profiles.models[paper.model].num_layers
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    nodes = {f"a100-s{s}-r{r}": (bounds[s], bounds[s + 1]) for s in range(stages) for r in range(replicas)}
    cluster = ClusterSpec.model_validate({
        "name": f"a100-{stages}x{replicas}", "model": paper.model, "profiles": str(paper.profile_paths()[0]),
        "coordinator": {"id": "coordinator", "nic_gbps": 10.0},
        "nodes": [{"id": n, "gpu": "A100", "region": "paper"} for n in nodes],
        "defaults": {"intra_region": {"bandwidth_gbps": 8.0, "latency_ms": 1.0}}})  # fmt: skip
    plan = evaluate_plan(cluster, profiles, Plan(cluster=cluster.name, model=cluster.model, method="given",
                                                 placement=nodes, max_flow_tok_s=0.0))  # fmt: skip
    return cluster, profiles, plan


def balanced_rate(args: argparse.Namespace, cluster: Any, profiles: Any, plan: Any) -> float:
    """Requests/s the cluster finishes when every node holds every task (offline, the KV feeder)."""
    from simulator.engine import SimConfig, simulate

    cfg = SimConfig(duration_s=args.sim_duration_s / 2, warmup_s=args.sim_warmup_s, lengths=args.sim_lengths,
                    task_mix={"lora": args.sim_tasks}, max_batch_size=args.sim_max_batch or None)  # fmt: skip
    result = simulate(cluster, profiles, plan, cfg)
    return result.finished_requests / (cfg.warmup_s + cfg.duration_s)


def run_arm(args: argparse.Namespace, arm: str, cluster: Any, profiles: Any, plan: Any, rate: float,
            seed: int) -> dict[str, Any]:  # fmt: skip
    from router.pet_balancer import BalancePolicy
    from simulator.engine import SimConfig, simulate
    from simulator.tasks import Popularity

    load: dict[str, Any] = {"mode": "offline", "max_inflight": args.sim_clients} if args.sim_clients \
        else {"mode": "online", "rate_per_s": rate}
    cfg = SimConfig(**load, duration_s=args.sim_duration_s, warmup_s=args.sim_warmup_s, seed=seed,
                    lengths=args.sim_lengths, task_mix={"lora": args.sim_tasks}, max_batch_size=args.sim_max_batch or None,
                    task_placement="all" if arm == IDEAL else "spread",
                    task_popularity=Popularity(args.sim_zipf, args.sim_shift_s),
                    pet_balance=BalancePolicy(min_requests=args.sim_min_requests) if arm.startswith("migration") else None,
                    pet_serial_drains=arm == "migration, serial drains")  # fmt: skip
    result = simulate(cluster, profiles, plan, cfg)
    tasks = result.tasks or {}
    t0 = args.sim_warmup_s
    phis = [phi for end, phi in tasks.get("phi_over_time", []) if end > t0]
    return {"tok_s": result.decode_tok_s, "phi": sum(phis) / len(phis) if phis else float("nan"),
            "moves": tasks.get("moves_done", 0), "finished": result.finished_requests,
            "timeline": result.throughput_over_time}  # fmt: skip


def bench_sim_migration(args: argparse.Namespace) -> None:
    log = RoundLog()
    cluster, profiles, plan = replicated_cluster(args.sim_stages, args.sim_replicas)
    out.print(f"[dim]sim-migration: {cluster.name} ({len(plan.placement)} A100s, plan max flow "
              f"{plan.max_flow_tok_s:.0f} tok/s); measuring what it serves with every task everywhere...[/]")
    if args.sim_clients:
        rate = 0.0
        out.print(f"  {args.sim_clients} clients in a closed loop, at most {args.sim_max_batch or 'KV-many'} requests a node")
    else:
        capacity = balanced_rate(args, cluster, profiles, plan)
        rate = args.sim_load * capacity
        out.print(f"  balanced: {capacity:.2f} requests/s finished; offering {rate:.2f} requests/s ({args.sim_load:.0%})")
    arms = (*ARMS, *([IDEAL] if args.sim_ideal else []))
    for r, arm in interleaved(arms, args.rounds):
        res = run_arm(args, arm, cluster, profiles, plan, rate, seed=r + 1)
        out.print(f"  round {r + 1}, {arm}: {res['tok_s']:.1f} tok/s, phi {res['phi']:.2f}, {res['moves']} moves, "
                  f"{res['finished']} requests finished")
        log.record(r, f"{arm} decode tok/s", res["tok_s"], " tok/s")
        log.record(r, f"{arm} mean phi", res["phi"], "")
        if arm.startswith("migration"):
            log.record(r, f"{arm} PET moves", res["moves"], "")
    log.ratio("migration ÷ static throughput", "migration decode tok/s", "static decode tok/s")
    log.ratio("serial drains ÷ static throughput", "migration, serial drains decode tok/s", "static decode tok/s")
    if args.sim_ideal:
        log.ratio("ideal ÷ static throughput (the ceiling)", "ideal decode tok/s", "static decode tok/s")
        log.ratio("migration ÷ ideal throughput", "migration decode tok/s", "ideal decode tok/s")
    load = f"{args.sim_clients} closed-loop clients" if args.sim_clients else f"online at {args.sim_load:.0%}"
    report(out, log, f"PET migration vs static in the simulator: {cluster.name}, {args.sim_tasks} LoRA tasks spread, "
                     f"Zipf {args.sim_zipf} reshuffled every {args.sim_shift_s:.0f} s, {args.sim_lengths} lengths, {load}, "
                     f"at most {args.sim_max_batch or 'KV-many'} requests a node, "
                     f"{args.sim_duration_s:.0f} simulated s per arm",
           {"migration ÷ static throughput": Target(">=", TARGET)})  # fmt: skip


def add_sim_migration_arguments(ap: Any) -> None:
    ap.add_argument("--sim-stages", type=int, default=8, help="layer ranges of the simulated cluster (default 8)")
    ap.add_argument("--sim-replicas", type=int, default=3, help="A100s holding each range (default 3)")
    ap.add_argument("--sim-tasks", type=int, default=64, help="LoRA tasks (default 64)")
    ap.add_argument("--sim-zipf", type=float, default=1.1, help="Zipf exponent of the tasks' popularity (default 1.1)")
    ap.add_argument("--sim-shift-s", type=float, default=60.0, help="the ranking is reshuffled this often (default 60)")
    ap.add_argument("--sim-duration-s", type=float, default=600.0, help="measured simulated seconds per arm (default 600)")
    ap.add_argument("--sim-warmup-s", type=float, default=60.0, help="simulated seconds before measuring (default 60)")
    ap.add_argument("--sim-load", type=float, default=0.95,
                    help="offered load: this fraction of what the cluster serves with every task everywhere (default 0.95)")
    ap.add_argument("--sim-min-requests", type=int, default=32,
                    help="helix serve --pet-balance-min-requests in the migration arms (default 32, its default)")
    ap.add_argument("--sim-lengths", default="azure-conv", help="request lengths, as helix simulate --lengths (default azure-conv)")
    ap.add_argument("--sim-clients", type=int, default=0,
                    help="N clients in a closed loop instead of online arrivals at --sim-load (default 0: online)")
    ap.add_argument("--sim-max-batch", type=int, default=0,
                    help="requests a node runs at most (helix agent --max-batch-size; default 0: as many as its KV holds)")
    ap.add_argument("--sim-ideal", action="store_true", help="add the ideal arm: every node holds every task")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sim_migration_arguments(ap)
    add_rounds_option(ap, 3, "a round is three simulated runs, a few minutes")
    bench_sim_migration(ap.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
