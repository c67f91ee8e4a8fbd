"""Many fine-tuned tasks on one base model (PetS; issue 16): scale, cross-task batching, PET overhead.

SmolLM2-135M float32, one torch thread, in-process ``StageEngine`` s (the engine the agents run;
no ZeroMQ, no coordinator). PET parameters are random with fixed seeds, in the shapes the issue
names: LoRA rank 8 on q/k/v/o; bottleneck adapters of 16 after attention and MLP; BitFit biases
on every linear, norm, the final norm and the LM head; Diff-Pruning 0.5 % dense on every linear
(PetS's default); masks zeroing 1 % of every linear.

* **(a) scale**: the demo cluster's layout (``clusters/demo``: cpu-0 holds all 30 layers, cpu-1
  layers 0-14, cpu-2 layers 15-29), one stage at a time: register ``--lora-tasks`` LoRA tasks and
  ``--other-tasks`` of each other type at once on the stage; the memory they hold (bound
  parameters, and the process's RSS growth) per task against a full copy of the model; then a
  step of requests over tasks of every type runs with all of them registered.
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
import gc
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
from rich.table import Table  # noqa: E402

from node_agent import pets, task_ops  # noqa: E402
from node_agent.config import ModelConfig  # noqa: E402
from node_agent.engine import StageEngine  # noqa: E402
from node_agent.gguf_convert import cached_model_dir  # noqa: E402
from node_agent.model import StageModel  # noqa: E402
from node_agent.pets import LINEAR_MODULES, NORMS, TaskPET, module_shape  # noqa: E402
from node_agent.sampling import SamplingParams  # noqa: E402
from node_agent.scheduler import SchedulerConfig  # noqa: E402

CONSOLE = make_console()
QKVO = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LORA_RANK, LORA_ALPHA, BOTTLENECK, DIFF_DENSITY, MASK_ZEROED = 8, 16, 16, 0.005, 0.01
DEMO_LAYOUT = (("cpu-0", 0, 30), ("cpu-1", 0, 15), ("cpu-2", 15, 30))  # clusters/demo: one of its layouts
OTHER_TYPES = ("adapter", "bitfit", "diff", "mask")
TARGETS = {"batched ÷ one at a time": Target(">=", 1.5), "LoRA ÷ base": Target(">=", 0.8)}
ROUNDS = {"batching": 2, "overhead": 5}


# ---- random PETs of the shapes (fixed seeds; only the layers [start, end)) -----------------

def random_pet(kind: str, cfg: ModelConfig, seed: int, start: int = 0, end: int | None = None) -> TaskPET:
    gen = torch.Generator().manual_seed(seed)
    end = cfg.num_layers if end is None else end
    t: dict[str, torch.Tensor] = {}
    for i in range(start, end):
        p = f"model.layers.{i}"
        if kind == "lora":
            for m in QKVO:
                n_out, n_in = module_shape(cfg, m)
                t[f"{p}.{m}.lora_A"] = torch.randn(LORA_RANK, n_in, generator=gen) / n_in ** 0.5
                t[f"{p}.{m}.lora_B"] = torch.randn(n_out, LORA_RANK, generator=gen) * 0.06
        elif kind == "adapter":
            h = cfg.hidden_size
            for place in pets.ADAPTER_PLACES:
                t[f"{p}.{place}.down.weight"] = torch.randn(BOTTLENECK, h, generator=gen) / h ** 0.5
                t[f"{p}.{place}.down.bias"] = torch.randn(BOTTLENECK, generator=gen) * 0.1
                t[f"{p}.{place}.up.weight"] = torch.randn(h, BOTTLENECK, generator=gen) * 0.1 / BOTTLENECK ** 0.5
                t[f"{p}.{place}.up.bias"] = torch.randn(h, generator=gen) * 0.02
        elif kind == "bitfit":
            for m in LINEAR_MODULES:
                t[f"{p}.{m}.bias"] = torch.randn(module_shape(cfg, m)[0], generator=gen) * 0.05
            for norm in NORMS:
                t[f"{p}.{norm}.bias"] = torch.randn(cfg.hidden_size, generator=gen) * 0.05
        else:  # diff / mask: sparse, at random positions (duplicates merge)
            for m in LINEAR_MODULES:
                shape = module_shape(cfg, m)
                nnz = int((DIFF_DENSITY if kind == "diff" else MASK_ZEROED) * shape[0] * shape[1])
                idx = torch.stack([torch.randint(0, shape[0], (nnz,), generator=gen),
                                   torch.randint(0, shape[1], (nnz,), generator=gen)])
                values = torch.randn(nnz, generator=gen) * 0.3 if kind == "diff" else torch.ones(nnz)
                name = "weight_diff" if kind == "diff" else "weight_mask_complement"
                t[f"{p}.{m}.{name}"] = torch.sparse_coo_tensor(idx, values, shape, check_invariants=True).coalesce()
    if kind == "bitfit" and end == cfg.num_layers:
        t["model.norm.bias"] = torch.randn(cfg.hidden_size, generator=gen) * 0.1
        t["lm_head.bias"] = torch.randn(cfg.vocab_size, generator=gen) * 0.5
    return TaskPET.from_tensors(kind, t, lora_scaling=LORA_ALPHA / LORA_RANK)


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
        engine.add_task(f"{kind}-{i}", random_pet(kind, cfg, 1000 + i), max_lora_rank=LORA_RANK)
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
        engine.add_task(name, random_pet("lora", cfg, 2000 + i), max_lora_rank=LORA_RANK)
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


# ---- (a) scale ---------------------------------------------------------------------------------------

def rss_bytes() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass(slots=True)
class StageScale:
    """What one node of the layout holds once every task is registered."""

    tasks: int
    held: int  # bytes of the tasks' bound parameters
    rss_growth: int  # the process's resident memory, after minus before registering
    base_held: int  # bytes of the base weights the stage holds
    full_copy: int  # bytes of every parameter of the checkpoint
    register_s: float
    step: str  # a step over tasks of every type, where the stage holds every layer
    per_type: dict[str, float]  # mean bound bytes per task, by PET type


def register_on_stage(model_dir: Path, start: int, end: int, counts: dict[str, int]) -> StageScale:
    """One node of the layout, in its own process (a fresh RSS): register every task at once."""
    torch.set_num_threads(1)
    engine = StageEngine(model_dir, start, end, kv_capacity_tokens=4096)
    cfg = engine.config
    full_copy, base_held = _full_copy_bytes(engine), _stage_weight_bytes(engine)
    gc.collect()
    rss0, t0 = rss_bytes(), time.perf_counter()
    sizes: dict[str, list[int]] = {}
    seed = 0
    for kind, n in counts.items():
        for i in range(n):
            seed += 1
            bound = engine.add_task(f"{kind}-{i}", random_pet(kind, cfg, seed, start, end), max_lora_rank=LORA_RANK)
            sizes.setdefault(kind, []).append(bound.nbytes)
    gc.collect()
    wall, grown = time.perf_counter() - t0, rss_bytes() - rss0
    step = _step_over_tasks(engine, counts) if (start, end) == (0, cfg.num_layers) else "—"
    return StageScale(len(engine.tasks), sum(t.nbytes for t in engine.tasks.values()), grown, base_held, full_copy,
                      wall, step, {k: sum(v) / len(v) for k, v in sizes.items()})  # fmt: skip


def scale(model_dir: Path, lora_tasks: int, other_tasks: int) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    counts = {"lora": lora_tasks, **dict.fromkeys(OTHER_TYPES, other_tasks)}
    nodes = Table(title=f"(a) scale: {lora_tasks} LoRA tasks + {other_tasks} of each other type registered "
                        f"at once on each node of the demo layout (each node a process, one after another)")  # fmt: skip
    for col in ("node", "layers", "tasks", "bound PET memory", "RSS growth", "base weights held",
                "register (wall)", "16 requests over 13 tasks + base"):  # fmt: skip
        nodes.add_column(col, justify="right")
    whole: StageScale | None = None
    for node, start, end in DEMO_LAYOUT:
        CONSOLE.print(f"[dim](a) {node}: layers {start}–{end - 1}, registering...[/]")
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            got = pool.submit(register_on_stage, model_dir, start, end, counts).result()
        whole = got if (start, end) == DEMO_LAYOUT[0][1:] else whole
        nodes.add_row(node, f"{start}–{end - 1}", str(got.tasks), _mb(got.held), _mb(got.rss_growth),
                      _mb(got.base_held), f"{got.register_s:.0f} s", got.step)  # fmt: skip
    CONSOLE.print(nodes)
    assert whole is not None
    full_copy = whole.full_copy
    types = Table(title=f"memory per task (all 30 layers, as cpu-0 holds it) vs a full copy of the model "
                        f"({_mb(full_copy)}, float32)")  # fmt: skip
    for col in ("PET", "shape", "per task", "÷ full copy", "tasks in a full copy's memory"):
        types.add_column(col, justify="right")
    shapes = {"lora": f"rank {LORA_RANK}, q/k/v/o", "adapter": f"bottleneck {BOTTLENECK}, attn + MLP",
              "bitfit": "all linears, norms, head", "diff": f"{DIFF_DENSITY:.1%} of each linear",
              "mask": f"{MASK_ZEROED:.0%} of each linear zeroed"}  # fmt: skip
    for kind, mean in whole.per_type.items():
        types.add_row(kind, shapes[kind], _mb(mean), f"{mean / full_copy:.2%}", f"{full_copy / mean:.0f}")
    CONSOLE.print(types)
    copies = whole.held / full_copy
    CONSOLE.print(f"cpu-0 holds {whole.tasks} tasks in {_mb(whole.held)}, the memory of {copies:.1f} full copies: "
                  f"{whole.tasks / copies:.0f}× more tasks than full copies would fit (PetS: up to 26×)")


def _full_copy_bytes(engine: StageEngine) -> int:
    """The bytes of every parameter of the checkpoint (a full copy of the model)."""
    from node_agent.weights import load_stage_weights

    tensors = load_stage_weights(engine.model_dir, engine.config, 0, engine.config.num_layers)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _stage_weight_bytes(engine: StageEngine) -> int:
    """The base weights the stage holds (its layers, and the embedding / final norm / LM head if it has them)."""
    model = engine.model
    assert isinstance(model, StageModel)
    total = sum(w.input_norm.nbytes + w.post_norm.nbytes + sum(lin.nbytes for lin in (w.qkv, w.o_proj, w.gate_up, w.down))
                for w in model.layers.values())  # fmt: skip
    for t in (model.embed_tokens, model.final_norm):
        total += 0 if t is None else t.nbytes
    return total + (0 if model.lm_head is None else model.lm_head.nbytes)


def _step_over_tasks(engine: StageEngine, counts: dict[str, int]) -> str:
    """16 requests over tasks of every type (and the base), run to the end: the mean step time."""
    names: list[str | None] = [None] + [f"{kind}-{i * 7 % n}" for kind, n in counts.items() for i in range(3) if n]
    requests = workload(16, 7, names, engine.config.vocab_size)
    for i, r in enumerate(requests):
        engine.add_request(f"s{i}", SamplingParams(max_tokens=8), prompt_token_ids=r.prompt, task=r.task)
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished:
        engine.step()
        steps += 1
    return f"{steps} steps, {1000 * (time.perf_counter() - t0) / steps:.0f} ms each"


def _mb(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("scale", "batching", "overhead"), action="append",
                        help="run only these parts (repeatable; default: all three)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 100 LoRA + 10 of each other type, 16 tasks in (b) and (c), one round")
    parser.add_argument("--lora-tasks", type=int, default=1000, help="(a): LoRA tasks registered (default 1000)")
    parser.add_argument("--other-tasks", type=int, default=100, help="(a): tasks of each other type (default 100)")
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
        scale(model_dir, 100 if args.quick else args.lora_tasks, 10 if args.quick else args.other_tasks)
    if "batching" in parts:
        batching(model_dir, rounds("batching"), args.quick)
    if "overhead" in parts:
        overhead(model_dir, rounds("overhead"), args.quick, args.per_task_arm)


if __name__ == "__main__":
    main()
