"""Many fine-tuned tasks on one base model (PetS; issue 16): scale, cross-task batching, PET overhead.

SmolLM2-135M float32, one torch thread; (b) and (c) on in-process ``StageEngine`` s (the engine the
agents run; no ZeroMQ, no coordinator). PET parameters are random with fixed seeds, in the shapes
the issue names (``node_agent.pet_samples``): LoRA rank 8 on q/k/v/o; bottleneck adapters of 16 after
attention and MLP; BitFit biases on every linear, norm, the final norm and the LM head;
Diff-Pruning 0.5 % dense on every linear (PetS's default); masks zeroing 1 % of every linear.

* **(a) scale**: on the live demo cluster (its three agents and the coordinator, ``bench/pets_scale.py``):
  register ``--lora-tasks`` LoRA tasks (PEFT's files) and ``--other-tasks`` of each other type at once
  through ``POST /v1/load_lora_adapter``; per agent its RSS before and after and the bytes its tasks
  hold, per PET type the memory per task against a full copy of the model; then requests over tasks of
  every type, all at once, give the text each gives alone.
* **(b) cross-task batching**: 64 tasks (32 LoRA, 8 of each other type), 2 requests per task, all
  at t = 0 (prompts U(16, 128) tokens, outputs U(16, 64), greedy, fixed lengths). *Batched*: one
  engine takes every request, steps mix the tasks. *One at a time*: each task's requests batched
  alone, task after task (what a server of one model per process must do). Generated tokens per
  CPU-second, the ratio batched / one at a time: target >= 1.5x (PetS: 1.53-1.63x).
* **(c) PET overhead**: 64 requests, one per LoRA task of 64 (rank 8 on q/k/v/o), vs the same
  requests on the base model; max batch 32, so a decode step holds up to 32 tasks. Ratio of
  generated tokens per CPU-second, LoRA / base: target >= 0.8x. ``--per-task-arm`` adds the
  PyTorch per-task LoRA path (the batched ``lora_segments`` kernel off) as a third arm.

Rounds (``bench/harness.py``): (b) and (c) interleave their arms (ABBA) on a fresh request sample
per round (seed = round index); the verdicts are on the median of the per-round ratios. (a) is
one registration (its figures are byte counts; no target on time).
Run: ``.venv/bin/python bench/pets.py [--only scale|batching|overhead] [--rounds N] [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import RoundLog, Target, add_rounds_option, arm_order, make_console, report  # noqa: E402
from pets_scale import OTHER_TYPES, scale  # noqa: E402

from node_agent import task_ops  # noqa: E402
from node_agent.engine import StageEngine  # noqa: E402
from node_agent.gguf_convert import cached_model_dir  # noqa: E402
from node_agent.pet_samples import LORA_RANK, sample_pet  # noqa: E402
from node_agent.sampling import SamplingParams  # noqa: E402
from node_agent.scheduler import SchedulerConfig  # noqa: E402

CONSOLE = make_console()
TARGETS = {"batched ÷ one at a time": Target(">=", 1.5), "LoRA ÷ base": Target(">=", 0.8)}
ROUNDS = {"batching": 2, "overhead": 5}


# ---- workload and arms ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    max_tokens: int
    task: str | None


def workload(n: int, seed: int, tasks: list[str | None], vocab: int) -> list[Request]:
    """``n`` requests, request i on ``tasks[i % len(tasks)]``: prompts U(16, 128), outputs U(16, 64)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(16, 129, (1,), generator=gen))
        out.append(Request(torch.randint(0, vocab, (length,), generator=gen).tolist(),
                           int(torch.randint(16, 65, (1,), generator=gen)), tasks[i % len(tasks)]))
    return out


def run_together(engine: StageEngine, requests: list[Request], tag: str) -> tuple[float, int]:
    """All requests at t = 0 in one engine; (CPU seconds, generated tokens)."""
    for i, r in enumerate(requests):
        engine.add_request(f"{tag}{i}", SamplingParams(max_tokens=r.max_tokens), prompt_token_ids=r.prompt,
                           task=r.task)
    tokens, t0 = 0, time.process_time()
    while engine.has_unfinished:
        tokens += sum(o.token is not None for o in engine.step().outputs)
    return time.process_time() - t0, tokens


def run_one_task_at_a_time(engine: StageEngine, requests: list[Request], tag: str) -> tuple[float, int]:
    """Each task's requests batched alone, one task after another."""
    by_task: dict[str | None, list[Request]] = {}
    for r in requests:
        by_task.setdefault(r.task, []).append(r)
    cpu, tokens = 0.0, 0
    for i, group in enumerate(by_task.values()):
        c, n = run_together(engine, group, f"{tag}{i}-")
        cpu, tokens = cpu + c, tokens + n
    return cpu, tokens


@contextmanager
def per_task_lora() -> Iterator[None]:
    """The PyTorch per-task LoRA path: the batched ``lora_segments`` kernel off."""
    kernel = task_ops._lora_kernel
    task_ops._lora_kernel = lambda y, x: None  # type: ignore[assignment]
    try:
        yield
    finally:
        task_ops._lora_kernel = kernel


def comparison(title: str, rounds: int, arms: dict[str, Callable[[int], tuple[float, int]]],
               ratios: dict[str, tuple[str, str]]) -> None:  # fmt: skip
    """Arms interleaved per round (ABBA), tokens per CPU-second, ratios within each round."""
    log = RoundLog()
    for r in log.each_round(rounds, lambda text: CONSOLE.print(f"[dim]{title}: {text}[/]")):
        for name in arm_order(list(arms), r):
            cpu, tokens = arms[name](r)
            log.record(r, f"{name}, tok/s (CPU)", tokens / cpu, "tok/s")
            CONSOLE.print(f"[dim]  {name}: {tokens} tokens in {cpu:.1f} CPU-s[/]")
    for ratio, (num, den) in ratios.items():
        log.ratio(ratio, f"{num}, tok/s (CPU)", f"{den}, tok/s (CPU)")
    report(CONSOLE, log, title, {k: TARGETS[k] for k in ratios if k in TARGETS})


def warm_up(engine: StageEngine, tasks: list[str | None]) -> None:
    run_together(engine, workload(len(tasks), 99, tasks, engine.config.vocab_size)[:8], "warm")


# ---- (b) cross-task batching -----------------------------------------------------------------------

def batching(model_dir: Path, rounds: int, quick: bool) -> None:
    engine = StageEngine(model_dir, kv_capacity_tokens=40_000)
    cfg = engine.config
    kinds = ["lora"] * 32 + [k for k in OTHER_TYPES for _ in range(8)]
    if quick:
        kinds = kinds[::4]
    names: list[str | None] = []
    for i, kind in enumerate(kinds):
        engine.add_task(f"{kind}-{i}", sample_pet(kind, cfg, 1000 + i), max_lora_rank=LORA_RANK)
        names.append(f"{kind}-{i}")
    warm_up(engine, names)
    per_task = 2
    sample = lambda r: workload(per_task * len(names), r, names, cfg.vocab_size)  # noqa: E731
    comparison(f"(b) cross-task batching: {len(names)} tasks of five types, {per_task} requests each, all at t = 0",
               rounds, {"batched": lambda r: run_together(engine, sample(r), f"b{r}-"),
                        "one at a time": lambda r: run_one_task_at_a_time(engine, sample(r), f"s{r}-")},
               {"batched ÷ one at a time": ("batched", "one at a time")})  # fmt: skip


# ---- (c) PET overhead ------------------------------------------------------------------------------

def overhead(model_dir: Path, rounds: int, quick: bool, per_task_arm: bool) -> None:
    engine = StageEngine(model_dir, kv_capacity_tokens=20_000, scheduler=SchedulerConfig(max_batch_size=32))
    cfg = engine.config
    n_tasks = 16 if quick else 64
    names: list[str | None] = [f"lora-{i}" for i in range(n_tasks)]
    for i, name in enumerate(names):
        assert name is not None
        engine.add_task(name, sample_pet("lora", cfg, 2000 + i), max_lora_rank=LORA_RANK)
    warm_up(engine, names)
    warm_up(engine, [None])

    def arm(tasks: bool, r: int) -> tuple[float, int]:
        sample = workload(n_tasks, r, names, cfg.vocab_size)
        if not tasks:
            sample = [Request(q.prompt, q.max_tokens, None) for q in sample]
        return run_together(engine, sample, f"{'t' if tasks else 'b'}{r}-")

    def per_task(r: int) -> tuple[float, int]:
        with per_task_lora():
            return arm(True, r)

    arms: dict[str, Callable[[int], tuple[float, int]]] = {"LoRA": lambda r: arm(True, r),
                                                          "base": lambda r: arm(False, r)}
    ratios = {"LoRA ÷ base": ("LoRA", "base")}
    if per_task_arm:
        arms["LoRA, per-task ops"] = per_task
        ratios["LoRA per-task ÷ base"] = ("LoRA, per-task ops", "base")
    comparison(f"(c) PET overhead: {n_tasks} requests over {n_tasks} LoRA tasks (rank {LORA_RANK} on q/k/v/o) "
               f"vs the base model, max batch 32", rounds, arms, ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("scale", "batching", "overhead"), action="append",
                        help="run only these parts (repeatable; default: all three)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 100 LoRA + 10 of each other type, 16 tasks in (b) and (c), one round")
    parser.add_argument("--lora-tasks", type=int, default=1000, help="(a): LoRA tasks registered (default 1000)")
    parser.add_argument("--other-tasks", type=int, default=100, help="(a): tasks of each other type (default 100)")
    parser.add_argument("--tasks-dir", type=Path,
                        help="(a): write the task directories here and keep them for the next run (≈ 7 GB for "
                             "the defaults; default: a temporary directory, removed at the end)")
    parser.add_argument("--per-task-arm", action="store_true",
                        help="(c): also run the PyTorch per-task LoRA path (the batched kernel off)")
    add_rounds_option(parser, None, f"(b) {ROUNDS['batching']}: its ratio sits far above its target; "
                                    f"(c) {ROUNDS['overhead']}; 1 with --quick")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    parts = args.only or ["scale", "batching", "overhead"]
    model_dir = cached_model_dir()

    def rounds(part: str) -> int:
        return args.rounds or (1 if args.quick else ROUNDS[part])

    if "scale" in parts:
        scale(model_dir, 100 if args.quick else args.lora_tasks, 10 if args.quick else args.other_tasks,
              args.tasks_dir)
    if "batching" in parts:
        batching(model_dir, rounds("batching"), args.quick)
    if "overhead" in parts:
        overhead(model_dir, rounds("overhead"), args.quick, args.per_task_arm)


if __name__ == "__main__":
    main()
