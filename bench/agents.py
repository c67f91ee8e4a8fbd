"""Three agents over ZeroMQ vs one process holding all layers (issue 3: >= 0.7x throughput).

Same workload, side by side in one run, SmolLM2-135M-Instruct float32, one torch thread per
process: N requests (prompts U(32, 256) tokens, 32 output tokens each, greedy, stop tokens
ignored) all submitted at t=0 (offline throughput).

* **one process**: a single ``StageEngine`` holding layers [0, 30), stepped in this process.
* **three agents**: ``python -m node_agent`` subprocesses holding [0, 10), [10, 20), [20, 30) on
  loopback, driven through ``router.agents_io.AgentsIO`` (ADMIT, ACTIVATIONS node to node, TOKENS
  to the coordinator, STEP back to the first stage).

Figures: tokens/s (prompt + generated) and generated tokens/s, and the ratio agents / one process.
Run: ``.venv/bin/python bench/agents.py [--quick]`` (about 4-5 min on 2 shared cores); :func:`section`
has the signature of ``bench/engine.py``'s ``SECTIONS`` entries.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from helix import wire  # noqa: E402
from node_agent.engine import StageEngine  # noqa: E402
from node_agent.gguf_convert import cached_model_dir  # noqa: E402
from node_agent.sampling import SamplingParams  # noqa: E402
from node_agent.scheduler import SchedulerConfig  # noqa: E402
from router.agent_events import TokenEvent  # noqa: E402
from router.agents_io import AgentsIO  # noqa: E402
from router.launch import process_cpu_seconds  # noqa: E402
from router.pipeline import Stage  # noqa: E402

console = Console()
SPLIT = {"a": (0, 10), "b": (10, 20), "c": (20, 30)}
SCHED = dict(max_batch_size=16, token_budget=256, chunk_size=64)
OUTPUT_TOKENS = 32
SECRET = "bench-secret"


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(49152) for _ in range(rng.randint(32, 256))] for _ in range(n)]


def one_process(model_dir: Path, prompts: list[list[int]]) -> float:
    engine = StageEngine(model_dir, kv_capacity_tokens=65536, scheduler=SchedulerConfig(**SCHED))  # type: ignore[arg-type]
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), SamplingParams(max_tokens=OUTPUT_TOKENS), prompt_token_ids=p)
    while engine.has_unfinished:
        engine.step()
    return time.perf_counter() - t0


def start_agents(model_dir: Path, root: Path) -> tuple[dict[str, subprocess.Popen[str]], dict[str, str]]:
    cluster, plan = root / "cluster.yaml", root / "plan.json"
    cluster.write_text("name: bench\nmodel: smollm2\nprofiles: p.yaml\nnodes:\n"
                       + "".join(f"  - {{id: {n}, gpu: CPU}}\n" for n in SPLIT)
                       + "defaults:\n  intra_region: {bandwidth_gbps: 10}\n")
    plan.write_text(json.dumps({"cluster": "bench", "model": "smollm2", "method": "manual", "max_flow_tok_s": 0,
                                "placement": {n: list(r) for n, r in SPLIT.items()}}))
    env = {**os.environ, "HELIX_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    procs, controls = {}, {}
    for node in SPLIT:
        procs[node] = subprocess.Popen(
            [sys.executable, "-m", "node_agent", "--cluster", str(cluster), "--plan", str(plan), "--node", node,
             "--model-dir", str(model_dir), "--threads", "1", "--max-batch-size", str(SCHED["max_batch_size"]),
             "--token-budget", str(SCHED["token_budget"]), "--chunk-size", str(SCHED["chunk_size"])],
            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    for node, proc in procs.items():
        assert proc.stdout is not None
        match = re.search(r"control=(\S+)", proc.stdout.readline())
        if not match:
            raise SystemExit(f"agent {node} did not start")
        controls[node] = match.group(1)
    return procs, controls


def three_agents(controls: dict[str, str], prompts: list[list[int]]) -> float:
    events: queue.Queue[TokenEvent] = queue.Queue()
    pipeline = [Stage(n, *r) for n, r in SPLIT.items()]
    with AgentsIO(controls, secret=SECRET.encode(), dead_after_s=5.0, on_token=events.put) as io:
        if not io.wait_ready(timeout_s=60):
            raise SystemExit(f"agents not ready: {io.agents()}")
        io.submit("warm", [1, 2, 3], wire.SamplingSpec(), pipeline, max_tokens=2)
        while not events.get(timeout=60).finished:
            pass
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            io.submit(str(i), p, wire.SamplingSpec(), pipeline, max_tokens=OUTPUT_TOKENS)
        done = 0
        while done < len(prompts):
            event = events.get(timeout=300)
            if event.error:
                raise SystemExit(f"request {event.request_id} failed: {event.error}")
            done += event.finished
        return time.perf_counter() - t0


def section(model_dir: Path, quick: bool, progress: Progress | None = None) -> Table:
    """The comparison as one table (fits ``bench/engine.py``'s ``SECTIONS`` signature)."""
    prompts = workload(12 if quick else 32)
    prompt_tokens = sum(map(len, prompts))
    generated = OUTPUT_TOKENS * len(prompts)
    task = progress.add_task("3 agents vs one process", total=2) if progress is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        procs, controls = start_agents(model_dir, Path(tmp))
        try:
            cpu0 = sum(process_cpu_seconds(p.pid) for p in procs.values())
            agents_s = three_agents(controls, prompts)
            agents_cpu = sum(process_cpu_seconds(p.pid) for p in procs.values()) - cpu0
        finally:
            for proc in procs.values():
                proc.send_signal(signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    if progress is not None and task is not None:
        progress.advance(task)
    one_process(model_dir, prompts[:2])  # warm-up
    cpu0 = time.process_time()
    single_s = one_process(model_dir, prompts)
    single_cpu = time.process_time() - cpu0
    if progress is not None and task is not None:
        progress.advance(task)
    ratio = single_s / agents_s
    verdict = "meets" if ratio >= 0.7 else "MISSES"
    table = Table(title=f"Three agents over ZeroMQ vs one process ({len(prompts)} requests, {prompt_tokens} prompt "
                        f"+ {generated} generated tokens, 1 torch thread per process, 2 shared cores)",
                  caption=f"throughput ratio agents / one process: {ratio:.2f}x ({verdict} the >= 0.7x target)")
    for col in ("setup", "wall s", "tokens/s", "generated tok/s", "CPU s (all processes)"):
        table.add_column(col, justify="right" if col != "setup" else "left")
    rows = (("one process, layers [0,30)", single_s, single_cpu),
            ("3 agents [0,10) [10,20) [20,30)", agents_s, agents_cpu))
    for name, secs, cpu in rows:
        table.add_row(name, f"{secs:.2f}", f"{(prompt_tokens + generated) / secs:.1f}", f"{generated / secs:.1f}",
                      f"{cpu:.1f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 requests instead of 32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    console.print(section(cached_model_dir(), args.quick))


if __name__ == "__main__":
    main()
