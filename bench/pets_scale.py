"""(a) of ``bench/pets.py``: fine-tuned tasks registered at once on the live demo cluster (PetS's scale figure).

The demo cluster (``clusters/demo``) for real: its three ``helix agent`` processes (SmolLM2-135M
float32, one torch thread each) in the layout cpu-0 [0, 30), cpu-1 [0, 15), cpu-2 [15, 30)
(two pipelines: cpu-0 alone, cpu-1 -> cpu-2), and the coordinator ``helix serve`` runs
(``router.serving``'s app under uvicorn, on a thread of this process, so that the bench reads
the bytes each agent reported per task). Steps:

1. **Task directories**: ``--lora-tasks`` LoRA tasks in PEFT's on-disk format (rank 8 on q/k/v/o)
   and ``--other-tasks`` of each other type in Helix's layout (``save_pet``), random with fixed
   seeds (``node_agent.pet_samples``). ``--tasks-dir`` keeps them for the next run (else a temporary
   directory, removed at the end).
2. **Registration**: every task through the coordinator, ``POST /v1/load_lora_adapter`` one at a
   time (what ``helix tasks --load`` does); each agent reads its own layers' tensors from the
   directory. Progress every ``PROGRESS_EVERY`` tasks; registration stops early (and says so) if
   the machine's available memory falls under ``MIN_AVAILABLE``.
3. **Serving**: requests to three tasks of each type and the base, all at once, then each alone:
   each answers 200 with the same greedy text both ways.
4. **Memory**: per agent, its RSS before and after registering (psutil), the bytes its tasks hold
   (what each agent answered in TASK_STATUS: its bound tensors) and the RSS growth over them; per
   PET type, the bytes per task on cpu-0 (all 30 layers) against a full copy of the model.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from harness import make_console
from rich.table import Table
from safetensors import safe_open
from safetensors.torch import save_file

from helix.tasks import PEFT_CONFIG, PEFT_WEIGHTS
from node_agent.config import ModelConfig, load_config
from node_agent.pet_samples import LORA_ALPHA, LORA_RANK, SHAPES, sample_tensors
from node_agent.pets import ATTENTION_MODULES
from node_agent.task_files import save_pet
from node_agent.weights import stage_tensor_names

ROOT = Path(__file__).resolve().parents[1]
DEMO_CLUSTER = ROOT / "clusters" / "demo" / "cluster.yaml"
LAYOUT = {"cpu-0": (0, 30), "cpu-1": (0, 15), "cpu-2": (15, 30)}
MIN_AVAILABLE = 1.5 * 2**30  # stop registering when the machine has less memory available than this
PROGRESS_EVERY = 100
PROMPTS = ("The old lighthouse keeper", "def fibonacci(n):", "Three reasons to learn Rust:", "Once upon a time")
CHECK_TOKENS = 12
OTHER_TYPES = ("adapter", "bitfit", "diff", "mask")
CONSOLE = make_console()


# ---- 1. task directories ---------------------------------------------------------------------------

def write_task(directory: Path, kind: str, cfg: ModelConfig, seed: int, base_model: str) -> None:
    """One task's directory: PEFT's LoRA files, or Helix's layout for the other types; kept if already written."""
    stamp = directory / "bench-seed.json"
    want = {"kind": kind, "seed": seed, "lora_rank": LORA_RANK}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return
    tensors = sample_tensors(kind, cfg, seed)
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "lora":  # what peft's save_pretrained writes for LoraConfig(r=8, target_modules=q/k/v/o)
        save_file({f"base_model.model.{name}.weight": t for name, t in tensors.items()},
                  str(directory / PEFT_WEIGHTS), metadata={"format": "pt"})  # fmt: skip
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                  "r": LORA_RANK, "lora_alpha": LORA_ALPHA, "lora_dropout": 0.0, "bias": "none",
                  "target_modules": sorted(m.rpartition(".")[2] for m in ATTENTION_MODULES), "use_rslora": False,
                  "use_dora": False, "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
                  "rank_pattern": {}, "alpha_pattern": {}}  # fmt: skip
        (directory / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    else:
        save_pet(directory, kind, tensors, base_model=base_model)
    stamp.write_text(json.dumps(want))


def write_tasks(root: Path, counts: dict[str, int], cfg: ModelConfig, base_model: str) -> dict[str, list[tuple[str, Path]]]:
    """Every task's directory under ``root``: kind -> [(task name, directory)]."""
    tasks: dict[str, list[tuple[str, Path]]] = {}
    total, done, t0 = sum(counts.values()), 0, time.perf_counter()
    for k, (kind, n) in enumerate(counts.items()):
        for i in range(n):
            name = f"{kind}-{i:04d}"
            write_task(root / name, kind, cfg, 100_000 * k + i + 1, base_model)  # the same task whatever the counts
            tasks.setdefault(kind, []).append((name, root / name))
            done += 1
            if done % PROGRESS_EVERY == 0 or done == total:
                CONSOLE.print(f"[dim](a) task files: {done}/{total} in {time.perf_counter() - t0:.0f} s "
                              f"({_size(_du(root))} in {root})[/]")  # fmt: skip
    return tasks


def _du(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


# ---- 2. the demo cluster: agents + coordinator ---------------------------------------------------------

@dataclass(slots=True)
class Cluster:
    base_url: str
    model: str  # the base model's name
    coordinator: Any
    pids: dict[str, int]  # node -> its agent's process id

    def rss(self) -> dict[str, int]:
        return {node: psutil.Process(pid).memory_info().rss for node, pid in self.pids.items()}

    def task_bytes(self) -> dict[str, dict[str, int]]:
        """Task name -> node -> bytes of the task that node's agent holds (its TASK_STATUS)."""
        return {name: dict(task.nbytes) for name, task in self.coordinator.tasks.tasks.items()}


@contextmanager
def demo_cluster(workdir: Path) -> Iterator[Cluster]:
    """The demo cluster's agents in :data:`LAYOUT` and a coordinator serving them on a loopback port."""
    import secrets

    from helix.plan import load_plan
    from helix.profile import load_profiles_for
    from helix.spec import load_cluster
    from planner.api import finish_plan
    from router.launch import AgentProcesses
    from router.serving import ServeOptions, build_coordinator, create_server_app, make_server

    cluster = load_cluster(DEMO_CLUSTER)
    profiles = load_profiles_for(cluster)
    plan_path = workdir / "plan.json"
    finish_plan(cluster, profiles, LAYOUT, method="manual").save(plan_path)
    secret = secrets.token_hex(8)
    server: Any = None
    thread: threading.Thread | None = None
    with AgentProcesses(DEMO_CLUSTER, plan_path, workdir, secret=secret) as agents:
        try:
            agents.start(LAYOUT)
            addresses = agents.wait_ready(timeout_s=300)
            coordinator = build_coordinator(cluster, load_plan(plan_path), profiles, ServeOptions())
            app = create_server_app(coordinator, addresses, secret=secret.encode())
            server = make_server(app, "127.0.0.1", 0)
            thread = threading.Thread(target=lambda: asyncio.run(server.serve()), name="uvicorn", daemon=True)
            thread.start()
            deadline = time.monotonic() + 60
            while not (server.started and coordinator.ready):
                if time.monotonic() > deadline:
                    raise RuntimeError("the coordinator did not become ready")
                time.sleep(0.05)
            port = server.servers[0].sockets[0].getsockname()[1]
            yield Cluster(f"http://127.0.0.1:{port}", cluster.model, coordinator,
                          {node: a.pid for node, a in agents.agents.items()})  # fmt: skip
        finally:
            if server is not None:
                server.should_exit = True
            if thread is not None:
                thread.join(timeout=20)


# ---- 3. registration and serving ----------------------------------------------------------------------

@dataclass(slots=True)
class Registration:
    seconds: dict[str, list[float]] = field(default_factory=dict)  # kind -> each load's latency
    wall: dict[str, float] = field(default_factory=dict)  # kind -> wall seconds for all its loads
    errors: list[str] = field(default_factory=list)
    stopped: str = ""  # why registration stopped early ("" if it did not)


def register(cluster: Cluster, tasks: dict[str, list[tuple[str, Path]]]) -> Registration:
    """``POST /v1/load_lora_adapter`` for every task, one at a time."""
    out = Registration()
    total, done, t0 = sum(len(v) for v in tasks.values()), 0, time.perf_counter()
    with httpx.Client(base_url=cluster.base_url, timeout=600) as http:
        for kind, named in tasks.items():
            start = time.perf_counter()
            for name, directory in named:
                available = psutil.virtual_memory().available
                if available < MIN_AVAILABLE:
                    out.stopped = (f"stopped at {done}/{total} tasks: {_size(available)} of memory available "
                                   f"(< {_size(MIN_AVAILABLE)})")  # fmt: skip
                    CONSOLE.print(f"[bold red](a) {out.stopped}[/]")
                    return out
                begin = time.perf_counter()
                response = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(directory)})
                out.seconds.setdefault(kind, []).append(time.perf_counter() - begin)
                if response.status_code != 200:
                    out.errors.append(f"{name}: {response.status_code} {response.text[:200]}")
                done += 1
                if done % PROGRESS_EVERY == 0 or done == total:
                    rss = ", ".join(f"{n} {_size(b)}" for n, b in cluster.rss().items())
                    CONSOLE.print(f"[dim](a) registered {done}/{total} ({kind}) in {time.perf_counter() - t0:.0f} s, "
                                  f"last {kind} load {1000 * out.seconds[kind][-1]:.0f} ms; RSS {rss}; "
                                  f"{_size(psutil.virtual_memory().available)} available[/]")  # fmt: skip
            out.wall[kind] = time.perf_counter() - start
    return out


async def _complete(http: httpx.AsyncClient, model: str, prompt: str) -> tuple[int, str]:
    response = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": CHECK_TOKENS,
                                                         "temperature": 0})  # fmt: skip
    return response.status_code, response.json()["choices"][0]["text"] if response.status_code == 200 else response.text


async def _serve_check(base_url: str, picks: list[str]) -> tuple[list[tuple[int, str]], list[tuple[int, str]], float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        t0 = time.perf_counter()
        together = await asyncio.gather(*(_complete(http, m, PROMPTS[i % len(PROMPTS)]) for i, m in enumerate(picks)))
        wall = time.perf_counter() - t0
        alone = [await _complete(http, m, PROMPTS[i % len(PROMPTS)]) for i, m in enumerate(picks)]
    return list(together), alone, wall


def serve_check(cluster: Cluster, tasks: dict[str, list[tuple[str, Path]]], registered: set[str]) -> str:
    """Three tasks of each type (first, middle, last registered) and the base, all at once, then each alone."""
    picks = [cluster.model]
    for named in tasks.values():
        names = [n for n, _ in named if n in registered]
        picks += list(dict.fromkeys(names[j] for j in (0, len(names) // 2, -1))) if names else []
    together, alone, wall = asyncio.run(_serve_check(cluster.base_url, picks))
    ok = sum(code == 200 for code, _ in together)
    same = sum(a == b and a[0] == 200 for a, b in zip(together, alone, strict=True))
    for model, a, b in zip(picks, together, alone, strict=True):
        if a != b or a[0] != 200:
            CONSOLE.print(f"[red](a) {model}: together {a!r}, alone {b!r}[/]")
    return (f"{len(picks)} requests ({len(picks) - 1} tasks of {len(tasks)} types + the base, {CHECK_TOKENS} greedy "
            f"tokens) all at once in {wall:.1f} s: {ok}/{len(picks)} answered 200, {same}/{len(picks)} "
            f"the same text as alone")  # fmt: skip


# ---- 4. the report ----------------------------------------------------------------------------------------

def checkpoint_bytes(model_dir: Path, cfg: ModelConfig, start: int, end: int) -> int:
    """Bytes (float32, as the agents hold them) of the base tensors a stage holding ``[start, end)`` loads."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:  # type: ignore[no-untyped-call]
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    return sum(4 * _numel(shapes[name]) for name in stage_tensor_names(cfg, start, end))


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def scale(model_dir: Path, lora_tasks: int, other_tasks: int, tasks_dir: Path | None = None) -> None:
    cfg = load_config(model_dir)
    counts = {"lora": lora_tasks, **dict.fromkeys(OTHER_TYPES, other_tasks)}
    workdir = Path(tempfile.mkdtemp(prefix="helix-pets-scale-"))
    root = tasks_dir or workdir / "tasks"
    try:
        tasks = write_tasks(root, counts, cfg, cfg.name)
        CONSOLE.print("[dim](a) starting the demo cluster (3 agents, coordinator)...[/]")
        with demo_cluster(workdir) as cluster:
            with httpx.Client(base_url=cluster.base_url, timeout=600) as http:  # warm-up: buffers the base needs
                http.post("/v1/completions", json={"model": cluster.model, "prompt": PROMPTS[0], "max_tokens": 4})
            rss0, bench0 = cluster.rss(), psutil.Process().memory_info().rss
            registration = register(cluster, tasks)
            rss1, bench1 = cluster.rss(), psutil.Process().memory_info().rss
            held = cluster.task_bytes()
            check = serve_check(cluster, tasks, set(held))
        _report(model_dir, cfg, counts, tasks, registration, held, rss0, rss1, bench1 - bench0, check)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _report(model_dir: Path, cfg: ModelConfig, counts: dict[str, int], tasks: dict[str, list[tuple[str, Path]]],
            reg: Registration, held: dict[str, dict[str, int]], rss0: dict[str, int], rss1: dict[str, int],
            bench_growth: int, check: str) -> None:  # fmt: skip
    n_tasks = len(held)
    nodes = Table(title=f"(a) scale on the demo cluster: {n_tasks} tasks registered at once through the coordinator "
                        f"({counts['lora']} LoRA + {counts[OTHER_TYPES[0]]} of each other type asked)")  # fmt: skip
    for col in ("agent", "layers", "tasks", "PET bytes held", "RSS before", "RSS after", "RSS growth",
                "growth ÷ PET bytes", "base weights held"):  # fmt: skip
        nodes.add_column(col, justify="right")
    for node, (start, end) in LAYOUT.items():
        pet_bytes = sum(per_node.get(node, 0) for per_node in held.values())
        growth = rss1[node] - rss0[node]
        nodes.add_row(node, f"{start}–{end - 1}", str(sum(node in p for p in held.values())), _size(pet_bytes),
                      _size(rss0[node]), _size(rss1[node]), _size(growth), f"{growth / max(pet_bytes, 1):.2f}×",
                      _size(checkpoint_bytes(model_dir, cfg, start, end)))  # fmt: skip
    CONSOLE.print(nodes)
    full_copy = checkpoint_bytes(model_dir, cfg, 0, cfg.num_layers)
    types = Table(title=f"per PET type: bytes per task on cpu-0 (all 30 layers) vs a full copy of the model "
                        f"({_size(full_copy)}, float32); registration one task at a time over HTTP")  # fmt: skip
    for col in ("PET", "shape", "tasks", "per task", "÷ full copy", "tasks per full copy", "load p50",
                "load p99", "all loads"):  # fmt: skip
        types.add_column(col, justify="right")
    for kind, named in tasks.items():
        sizes = [held[n]["cpu-0"] for n, _ in named if n in held and "cpu-0" in held[n]]
        lat = sorted(reg.seconds.get(kind, []))
        if not sizes or not lat:
            continue
        mean = sum(sizes) / len(sizes)
        types.add_row(kind, SHAPES[kind], str(len(sizes)), _size(mean), f"{mean / full_copy:.2%}",
                      f"{full_copy / mean:.0f}", f"{1000 * statistics.median(lat):.0f} ms",
                      f"{1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]:.0f} ms",
                      f"{reg.wall.get(kind, sum(lat)):.0f} s")  # fmt: skip
    CONSOLE.print(types)
    on_cpu0 = sum(p.get("cpu-0", 0) for p in held.values())
    copies = on_cpu0 / full_copy
    loads = sum(len(v) for v in reg.seconds.values())
    CONSOLE.print(f"cpu-0 holds {n_tasks} tasks in {_size(on_cpu0)}, the memory of {copies:.1f} full copies: "
                  f"{n_tasks / max(copies, 1e-9):.0f}× more tasks than full copies would fit (PetS: up to 26×)")
    CONSOLE.print(f"registration: {loads} loads in {sum(reg.wall.values()):.0f} s, one at a time "
                  f"({loads / max(sum(reg.wall.values()), 1e-9):.1f} tasks/s); {len(reg.errors)} refused"
                  + (f" (first: {reg.errors[0]})" if reg.errors else "") + (f"; {reg.stopped}" if reg.stopped else ""))
    CONSOLE.print(f"serving with all of them registered: {check}")
    CONSOLE.print(f"[dim]the coordinator (in the bench's process) grew {_size(bench_growth)} while registering[/]")


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
