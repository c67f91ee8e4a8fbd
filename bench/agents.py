"""Three agents over ZeroMQ vs one process holding all layers (issue 3: >= 0.7x throughput).

Same workload, side by side in one run, SmolLM2-135M-Instruct float32, one torch thread per
process: N requests (prompts U(32, 256) tokens, 32 output tokens each, greedy, stop tokens
ignored) all submitted at t=0 (offline throughput).

* **one process**: a single ``StageEngine`` holding layers [0, 30), stepped in this process.
* **three agents**: ``helix agent`` subprocesses (``router.launch``) holding [0, 10), [10, 20), [20, 30) on
  loopback, driven through the coordinator core on that pipeline (``router.pinned.PinnedClient``: ADMIT,
  ACTIVATIONS node to node, TOKENS to the coordinator, STEP back to the first stage).

Figures: tokens/s (prompt + generated) and generated tokens/s, and the ratio agents / one process,
in rounds (``bench/harness.py``): the agents start once, then each round runs both arms on a fresh
request sample, in ABBA order; the verdict is on the median of the per-round ratios.
Both arms run the layers on one stage backend (``node_agent/backends.py``): ``torch`` here; the
``backend`` arguments let ``bench/vllm_backend.py`` run the same comparison on ``vllm``.
Run: ``.venv/bin/python bench/agents.py [--rounds 3] [--quick]`` (about 1.5 min per round on 2 shared
cores); :func:`section` has the signature of ``bench/engine.py``'s ``SECTIONS`` entries.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import (  # noqa: E402
    RoundLog,
    Target,
    add_rounds_option,
    arm_order,
    figures_table,
    make_console,
    verdict_lines,
)
from rich.progress import Progress  # noqa: E402

from helix.domain import Stage  # noqa: E402
from helix.processes import cpu_seconds as process_cpu_seconds  # noqa: E402
from node_agent.backends import StageBackend  # noqa: E402
from node_agent.engine import StageEngine  # noqa: E402
from node_agent.gguf_convert import cached_model_dir  # noqa: E402
from node_agent.sampling import SamplingParams  # noqa: E402
from node_agent.scheduler import SchedulerConfig  # noqa: E402
from router.launch import AgentProcesses  # noqa: E402
from router.pinned import PinnedClient  # noqa: E402

console = make_console()
SPLIT = {"a": (0, 10), "b": (10, 20), "c": (20, 30)}
SCHED = dict(max_batch_size=16, token_budget=256, chunk_size=64)
OUTPUT_TOKENS = 32
SECRET = "bench-secret"
ROUNDS = 3  # the ratio sits far from its target (1.3x vs 0.7x): three rounds agree
TARGET = Target(">=", 0.7)
RATIO = "throughput ratio agents ÷ one process"


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(49152) for _ in range(rng.randint(32, 256))] for _ in range(n)]


def one_process(model_dir: Path, prompts: list[list[int]], backend: str = "torch") -> tuple[float, float]:
    """Wall and CPU seconds of one ``StageEngine`` serving ``prompts`` (its construction not counted)."""
    engine = StageEngine(model_dir, kv_capacity_tokens=65536, scheduler=SchedulerConfig(**SCHED),  # type: ignore[arg-type]
                         backend=StageBackend(backend))  # fmt: skip
    t0, cpu0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), SamplingParams(max_tokens=OUTPUT_TOKENS), prompt_token_ids=p)
    while engine.has_unfinished:
        engine.step()
    return time.perf_counter() - t0, time.process_time() - cpu0


def start_agents(model_dir: Path, root: Path, backend: str = "torch") -> AgentProcesses:
    """The three agents of ``SPLIT``, ready."""
    cluster, plan = root / "cluster.yaml", root / "plan.json"
    cluster.write_text("name: bench\nmodel: smollm2\nprofiles: p.yaml\nnodes:\n"
                       + "".join(f"  - {{id: {n}, gpu: CPU}}\n" for n in SPLIT)
                       + "defaults:\n  intra_region: {bandwidth_gbps: 10}\n")
    plan.write_text(json.dumps({"cluster": "bench", "model": "smollm2", "method": "manual", "max_flow_tok_s": 0,
                                "placement": {n: list(r) for n, r in SPLIT.items()}}))
    agents = AgentProcesses(cluster, plan, root, secret=SECRET, model_dir=str(model_dir),
                            extra_args=("--max-batch-size", str(SCHED["max_batch_size"]), "--token-budget",
                                        str(SCHED["token_budget"]), "--chunk-size", str(SCHED["chunk_size"]),
                                        "--backend", backend))  # fmt: skip
    try:
        agents.start(SPLIT)
        agents.wait_ready(timeout_s=300)
    except BaseException:
        agents.stop()
        raise
    return agents


def three_agents(client: PinnedClient, prompts: list[list[int]], tag: str) -> float:
    """Wall seconds of ``prompts`` (greedy) on the three agents, all submitted at once."""
    pipeline = [Stage(n, *r) for n, r in SPLIT.items()]
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        client.submit(f"{tag}-{i}", p, pipeline, max_tokens=OUTPUT_TOKENS, temperature=0.0)
    done = 0
    while done < len(prompts):
        out = client.outputs.get(timeout=300)
        if out.error is not None:
            raise SystemExit(f"request {out.request_id} failed: {out.error.message}")
        done += out.finished
    return time.perf_counter() - t0


def section(model_dir: Path, quick: bool, rounds: int | None = None, progress: Progress | None = None,
            backend: str = "torch") -> list[Any]:  # fmt: skip
    """The comparison as a table and its verdict (fits ``bench/engine.py``'s ``SECTIONS`` signature);
    ``backend`` runs every stage, the agents' and the one process's, on that stage backend."""
    n = 12 if quick else 32
    rounds = rounds or (1 if quick else ROUNDS)
    label = "" if backend == "torch" else f" ({backend} backend)"
    task = progress.add_task(f"3 agents vs one process{label}", total=2 * rounds) if progress is not None else None
    log = RoundLog()
    with tempfile.TemporaryDirectory() as tmp:
        agents = start_agents(model_dir, Path(tmp), backend)
        try:
            with PinnedClient(agents.addresses(), secret=SECRET.encode(), dead_after_s=5.0,
                              ready_timeout_s=60 if backend == "torch" else 300) as client:  # fmt: skip
                three_agents(client, [[1, 2, 3]], "warm")  # first-call allocations on every stage
                one_process(model_dir, workload(2, seed=99), backend)  # warm-up
                for r in log.each_round(rounds):
                    prompts = workload(n, seed=r)
                    tokens = sum(map(len, prompts)) + OUTPUT_TOKENS * n
                    for arm in arm_order(["3 agents", "one process"], r):
                        if arm == "3 agents":
                            cpu0 = sum(process_cpu_seconds(pid) for pid in agents.pids())
                            secs = three_agents(client, prompts, f"r{r}")
                            cpu = sum(process_cpu_seconds(pid) for pid in agents.pids()) - cpu0
                        else:
                            secs, cpu = one_process(model_dir, prompts, backend)
                        log.record(r, f"tokens/s, {arm}", tokens / secs, "tok/s")
                        log.record(r, f"generated tok/s, {arm}", OUTPUT_TOKENS * n / secs, "tok/s")
                        log.record(r, f"CPU s (all processes), {arm}", cpu, "s")
                        if progress is not None and task is not None:
                            progress.advance(task)
                    log.ratio(RATIO, "tokens/s, 3 agents", "tokens/s, one process")
        finally:
            agents.stop(grace_s=15)
    title = (f"Three agents over ZeroMQ [0,10) [10,20) [20,30) vs one process [0,30){label} ({n} requests per round, "
             f"prompts U(32, 256), {OUTPUT_TOKENS} output tokens, 1 torch thread per process, {rounds} round(s))")
    return [figures_table(log, title, {RATIO: TARGET}), *verdict_lines(log, {RATIO: TARGET})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 requests instead of 32, one round")
    add_rounds_option(parser, None, f"{ROUNDS}, or 1 with --quick: the ratio sits far from its target")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for part in section(cached_model_dir(), args.quick, args.rounds):
        console.print(part)


if __name__ == "__main__":
    main()
