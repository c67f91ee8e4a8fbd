"""PetS's scheduling on Helix (issue 19): which requests share a step on one node, which node runs a task.

    python bench/pets_balance.py [--only batching|migration|sim-migration ...] [--rounds N]

Sections (``--only``, repeatable; default: all; each is a ``Section`` in ``SECTIONS``, so more plug in):

* **batching** (here; PetS section 3.3, ``node_agent/batching.py``): one agent's engine (SmolLM2-135M,
  float32, one torch thread, in-process as in ``bench/pets.py``; the agent's defaults: max batch 32,
  token budget 512, prefill chunk 256) holding ``--batching-tasks`` tasks of mixed PET types (128:
  LoRA, adapter, BitFit, diff, mask in turn, ``node_agent.pet_samples``). Each round, ``--queries``
  requests all at t = 0 (1,024: PetS's query pool), each on a task drawn at random, prompts of Gaussian length (PetS's protocol:
  mean 32, σ from ``--sigmas`` in turn by round; random token ids), ``--gen-tokens`` greedy tokens
  each (32: PetS's queries are one pass of an encoder; a language model's answer is decode steps, where
  a step's PET ops are a call per task for a row each). The four policies (``helix agent --batching``) run the same requests,
  fcfs, alpha (α-only), beta (β-only), coordinated, side by side on one engine: each arm has its own
  scheduler, and the next step is always that of the arm least far through its tokens, so drift on the
  machine hits every arm alike (``run_arms``); each step's CPU time is its own arm's. ``--jobs 2`` runs
  the rounds at once, each in its own process. The policies are priced by the α and β models of ``helix
  profile``'s measurement of this machine (the demo cluster's ``cpu``; ``--profiles`` takes a file).
  A fifth arm, the same requests on the base model (no task), shows what the tasks' ops cost at all:
  what any policy could win back. Figures: tokens (prompt + generated) per CPU-second, each policy ÷
  fcfs within the round, the distinct tasks a step touched on average, and the cost model's
  prediction of each arm's time. Target (the issue's): coordinated ÷ fcfs ≥ 1.2× (PetS: 1.52× over
  fixed-size batching). The greedy tokens of every request are checked to be the same under every policy.
* **migration** (``bench/pets_migration.py``; PetS section 3.4): PET migration vs a static task
  assignment on a live cluster.
* **sim-migration** (``bench/pets_sim_migration.py``): the same comparison at scale, in the simulator.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

from harness import RoundLog, Target, add_rounds_option, arm_order, make_console, report  # noqa: E402

CONSOLE = make_console()
KINDS = ("lora", "adapter", "bitfit", "diff", "mask")
POLICIES = ("fcfs", "alpha", "beta", "coordinated")
BASE_ARM = "base model"
TARGET = Target(">=", 1.2)
KV_TOKENS = 65536  # per arm: every request's reservation is its own tensor, allocated when it starts


@dataclass(frozen=True, slots=True)
class Section:
    """One part of the bench: its options, its default rounds (and why) and what runs it."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]
    rounds: int
    why: str


# ---- batching: the four policies on one engine -------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Query:
    prompt: list[int]
    task: str


def queries(n: int, sigma: float, tasks: list[str], vocab: int, seed: int) -> list[Query]:
    """``n`` requests on tasks drawn at random, prompts of N(32, sigma) tokens (at least 1)."""
    rng = random.Random(seed)
    return [Query([rng.randrange(vocab) for _ in range(max(1, round(rng.gauss(32, sigma))))], rng.choice(tasks))
            for _ in range(n)]  # fmt: skip


def measured_costs(args: argparse.Namespace, layers: int) -> Any:
    """The α and β models (``StepCostModel``) of this machine: ``--profiles``, else ``helix profile`` of the
    demo cluster (from its cache when this machine was measured before; else it measures, minutes)."""
    from helix.profile import load_profile_file
    from helix.spec import load_cluster
    from node_agent.batching import StepCostModel

    cluster = load_cluster(ROOT / "clusters" / "demo" / "cluster.yaml")
    if args.profiles:
        profiles = load_profile_file(args.profiles)
    else:
        from profiler.cluster_profile import profile_cluster

        with tempfile.TemporaryDirectory() as tmp:
            result = profile_cluster(cluster, output=Path(tmp) / "profiles.yaml", measure_links=False,
                                     notify=lambda _phase, msg: CONSOLE.print(f"[dim]profile: {msg}[/]"))  # fmt: skip
            profiles = result.profiles
    curves = profiles.throughput("cpu", cluster.model).curves()
    if curves is None or not curves.pet:
        raise SystemExit("the profile has no measured curves with pet_ms_per_layer (helix profile measures them)")
    return StepCostModel(curves, layers)


@dataclass(slots=True)
class Arm:
    """One policy's run of a round's requests: its own scheduler on the shared engine, and what it cost."""

    name: str
    scheduler: Any  # node_agent.scheduler.Scheduler
    tag: str
    task_of: dict[str, str | None] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    cpu_s: float = 0.0
    steps: int = 0
    touched: int = 0
    model_ms: float = 0.0
    sampled: int = 0
    expected: int = 1

    @property
    def progress(self) -> float:
        return self.sampled / self.expected


def run_arms(engine: Any, arms: list[Arm], batch: list[Query], gen_tokens: int, costs: Any,
             pet_of: dict[str, str], notify: Callable[[str], None] = lambda _: None) -> None:  # fmt: skip
    """Every arm's copy of ``batch`` at t = 0 until all finish, the arms' steps interleaved on one engine.

    Each arm has its own scheduler (its policy, its KV account); the engine's weights and tasks are
    shared. The next step is always the one of the unfinished arm least far through its tokens, so the
    arms run side by side through the round: a machine that slows down, or another process taking the
    memory bus, slows every arm alike, and each step's process CPU time is its own arm's.
    """
    from node_agent.sampling import SamplingParams

    for arm in arms:
        engine.scheduler = arm.scheduler
        for i, q in enumerate(batch):
            rid = f"{arm.tag}{i}"
            arm.task_of[rid] = None if arm.name == BASE_ARM else q.task
            engine.add_request(rid, SamplingParams(max_tokens=gen_tokens), prompt_token_ids=q.prompt,
                               task=arm.task_of[rid])  # fmt: skip
        arm.expected = len(batch) * gen_tokens
    head = costs.curves.head
    shown = 0
    while live := [a for a in arms if a.scheduler.has_unfinished]:
        arm = min(live, key=lambda a: a.progress)
        engine.scheduler = arm.scheduler
        t0 = time.process_time()
        result = engine.step()
        arm.cpu_s += time.process_time() - t0
        arm.steps += 1
        rows: dict[str, int] = {}
        for out in result.outputs:
            if out.token is not None:
                arm.tokens.setdefault(out.request_id, []).append(out.token)
                arm.sampled += 1
            task = arm.task_of[out.request_id]
            if task is not None:
                rows[task] = rows.get(task, 0) + out.num_tokens
        arm.touched += len(rows)
        prefill, decodes, _ = result.by_start.get(0, (0, 0, 0))
        sampled = sum(out.token is not None for out in result.outputs)
        arm.model_ms += costs.alpha_ms(prefill, decodes) + sum(costs.beta_ms(pet_of[t], n) for t, n in rows.items()) \
            + (head.at(sampled) if head is not None else 0.0)
        done = min(a.progress for a in arms)
        if done >= (shown + 1) / 10:
            shown = int(done * 10)
            notify(f"{shown * 10} % of every arm's tokens, " + ", ".join(f"{a.name} {a.cpu_s:.0f}" for a in arms)
                   + " CPU-s")


@dataclass(frozen=True, slots=True)
class RoundResult:
    """One round of the batching section: each arm's figures, and the greedy tokens' agreement."""

    index: int
    sigma: float
    arms: dict[str, dict[str, float]]
    same_tokens: bool
    wall_s: float


def workload(args: argparse.Namespace) -> tuple[int, int, list[str]]:
    """The tasks, the requests per round and the arms (policies, then the base model unless skipped)."""
    n_tasks, n_queries = (16, 48) if args.quick else (args.batching_tasks, args.queries)
    return n_tasks, n_queries, [*POLICIES, *([] if args.no_base_arm else [BASE_ARM])]


def batching_round(args: argparse.Namespace, r: int, tag: str = "") -> RoundResult:
    """Round ``r`` of the batching section in this process: a fresh engine holding the tasks, every arm
    of the round's requests interleaved (:func:`run_arms`)."""
    import torch

    from node_agent.batching import BatchingMode, BatchingPolicy
    from node_agent.engine import StageEngine
    from node_agent.gguf_convert import cached_model_dir
    from node_agent.kv_cache import KVAccount
    from node_agent.pet_samples import LORA_RANK, sample_pet
    from node_agent.scheduler import Scheduler

    torch.set_num_threads(1)
    say = lambda text: CONSOLE.print(f"[dim]batching{tag}: {text}[/]")  # noqa: E731
    n_tasks, n_queries, arm_names = workload(args)
    sigmas = [float(s) for s in args.sigmas.split(",")]
    engine = StageEngine(cached_model_dir(), kv_capacity_tokens=KV_TOKENS)
    config = engine.scheduler.config
    costs = measured_costs(args, engine.layer_end - engine.layer_start)
    if r == 0:
        say(f"α: decode {costs.alpha_ms(0, 1):.1f} ms at 1, {costs.alpha_ms(0, 32):.1f} ms at 32; prefill "
            f"{costs.alpha_ms(256, 0):.0f} ms at 256 tokens. β at 1 / 16 rows (ms, all layers): "
            + ", ".join(f"{k} {costs.beta_ms(k, 1):.2f} / {costs.beta_ms(k, 16):.2f}" for k in KINDS))
    names, pet_of = [], {}
    t0 = time.perf_counter()
    for i in range(n_tasks):
        kind = KINDS[i % len(KINDS)]
        names.append(f"{kind}-{i}")
        pet_of[names[-1]] = kind
        engine.add_task(names[-1], sample_pet(kind, engine.config, seed=3000 + i), max_lora_rank=LORA_RANK)
    say(f"{n_tasks} tasks bound in {time.perf_counter() - t0:.0f} s")
    vocab = engine.config.vocab_size

    def arm(name: str, prefix: str) -> Arm:
        policy = BatchingPolicy(BatchingMode(name), args.max_passed_over_steps, None if name == "fcfs" else costs) \
            if name != BASE_ARM else BatchingPolicy()
        return Arm(name, Scheduler(replace(config, batching=policy), KVAccount(KV_TOKENS)), f"{prefix}{name[:2]}-")

    run_arms(engine, [arm("fcfs", "warm")], queries(16, 4, names, vocab, seed=999), 4, costs, pet_of)
    sigma = sigmas[r % len(sigmas)]
    batch = queries(n_queries, sigma, names, vocab, seed=r)
    t0 = time.perf_counter()
    arms = [arm(name, f"r{r}") for name in arm_order(arm_names, r)]
    run_arms(engine, arms, batch, args.gen_tokens, costs, pet_of, say)
    figures = {}
    for a in arms:
        processed = sum(len(q.prompt) for q in batch) + sum(map(len, a.tokens.values()))
        figures[a.name] = {"cpu_s": a.cpu_s, "tok_s": processed / a.cpu_s, "steps": a.steps,
                           "tasks_per_step": a.touched / a.steps, "model_s": a.model_ms / 1000}  # fmt: skip
        say(f"  {a.name}: {a.cpu_s:.1f} CPU-s (model {a.model_ms / 1000:.1f} s), {a.steps} steps, "
            f"{a.touched / a.steps:.1f} tasks a step")
    answers = [[a.tokens.get(f"{a.tag}{i}", []) for i in range(len(batch))] for a in arms if a.name != BASE_ARM]
    return RoundResult(r, sigma, figures, all(x == answers[0] for x in answers), time.perf_counter() - t0)


def _round_in_child(args: argparse.Namespace, r: int) -> RoundResult:
    return batching_round(args, r, f" r{r + 1}")


def bench_batching(args: argparse.Namespace) -> None:
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be 1 or more, got {args.jobs}")
    rounds = list(range(args.rounds))
    CONSOLE.print(f"[dim]batching: {len(rounds)} round(s), {min(args.jobs, len(rounds))} at a time[/]")
    t0 = time.perf_counter()
    parallel = args.jobs > 1 and len(rounds) > 1
    if parallel:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(args.jobs, len(rounds)), mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_round_in_child, [args] * len(rounds), rounds))
    else:
        results = [batching_round(args, r, f" round {r + 1} of {len(rounds)}") for r in rounds]
    log = RoundLog()
    for res in results:
        log.record(res.index, "prompt σ", res.sigma, "")
        for name, got in res.arms.items():
            log.record(res.index, f"{name}, tok/s (CPU)", got["tok_s"], "tok/s")
            log.record(res.index, f"{name}, tasks a step", got["tasks_per_step"], "")
            log.record(res.index, f"{name}, model s ÷ CPU s", got["model_s"] / got["cpu_s"], "×")
        # rounds side by side: each its share of the wall time, so that the report's total is the run's
        log.wall_s.append((time.perf_counter() - t0) / len(results) if parallel else res.wall_s)
    n_tasks, n_queries, arm_names = workload(args)
    for name in arm_names[1:]:
        log.ratio(f"{name} ÷ fcfs", f"{name}, tok/s (CPU)", "fcfs, tok/s (CPU)")
    report(CONSOLE, log, f"Coordinated batching: {n_tasks} tasks of five PET types, {n_queries} requests at t = 0 on "
                         f"random tasks, prompts N(32, σ), {args.gen_tokens} greedy tokens; SmolLM2-135M, one thread; "
                         f"the arms' steps interleaved",
           {"coordinated ÷ fcfs": TARGET})  # fmt: skip
    same = all(res.same_tokens for res in results)
    style = "green" if same else "red"
    CONSOLE.print(f"[{style}]every request's greedy tokens the same under the four policies: {same}[/]")


def add_batching_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batching")
    g.add_argument("--queries", type=int, default=1024,
                   help="requests per round, all at t = 0 (default 1024, PetS's query pool)")
    g.add_argument("--batching-tasks", type=int, default=128, help="tasks, PET types in turn (default 128)")
    g.add_argument("--sigmas", default="1,8", help="prompt length σ by round, in turn (default 1,8; mean 32)")
    g.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens per request (default 32)")
    g.add_argument("--max-passed-over-steps", type=int, default=16, help="the policies' starvation bound (default 16)")
    g.add_argument("--profiles", help="profiles file with the machine's curves (default: helix profile of the demo)")
    g.add_argument("--no-base-arm", action="store_true", help="skip the base-model arm")
    g.add_argument("--jobs", type=int, default=1,
                   help="rounds run at once, each in its own process on its own core (default 1)")
    g.add_argument("--quick", action="store_true", help="smoke run: 16 tasks, 48 requests")


def _migration() -> Any:
    import pets_migration

    return pets_migration


SECTIONS: dict[str, Section] = {
    "batching": Section(add_batching_arguments, bench_batching, 2,
                        "a round is five arms of the same requests, about 35-40 CPU-minutes"),
    "migration": Section(lambda p: _migration().add_migration_arguments(p.add_argument_group("migration")),
                         lambda a: _migration().bench_migration(a), 1,
                         "a round runs both arms, each on a fresh cluster (about 8 minutes)"),
    "sim-migration": Section(lambda p: __import__("pets_sim_migration").add_sim_migration_arguments(p.add_argument_group("sim-migration")),
                             lambda a: __import__("pets_sim_migration").bench_sim_migration(a), 3,
                             "a round is three simulated runs of a 24-node cluster (bench/pets_sim_migration.py)"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(SECTIONS), action="append",
                        help="run only these sections (repeatable; default: all)")
    for section in SECTIONS.values():
        section.add_arguments(parser)
    add_rounds_option(parser, None, "; ".join(f"{name} {s.rounds}: {s.why}" for name, s in SECTIONS.items()))
    args = parser.parse_args()
    for name in args.only or list(SECTIONS):
        section = SECTIONS[name]
        section.run(argparse.Namespace(**{**vars(args), "rounds": args.rounds or section.rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
