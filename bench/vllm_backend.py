"""The vLLM backend: one agent vs vLLM and vs the torch engine; three vLLM-backed agents vs one process.

Two sections (``--only single|agents`` runs one of them; both by default, in that order).

**single**: one agent on the vLLM backend vs vLLM's own offline engine (``LLM.generate``) and vs
our torch engine. Same model, workload and batch limits as ``bench/vllm_compare.py`` (whose
workload, vLLM worker and torch arm this reuses): SmolLM2-135M float32, Orca's request mix, all
requests at t = 0, one thread per engine. Arms per round, in ABBA order (``bench/harness.py``): a
``StageEngine`` holding layers [0, 30) on the vLLM backend (``node_agent/vllm_layers.py``), the
same on the torch engine, and vLLM's ``LLM.generate`` in a worker process. Targets: vLLM backend
÷ vLLM ≥ 0.9 (our scheduling and glue cost at most 10 %, by CPU time); vLLM backend ÷ torch
engine is reported.

**agents**: ``bench/agents.py``'s comparison with every stage on the vLLM backend: three
``python -m node_agent --backend vllm`` subprocesses holding [0, 10), [10, 20), [20, 30) (one torch
thread each), driven through the coordinator core (``router.pinned.PinnedClient``), vs one
``StageEngine`` [0, 30) on the vLLM backend in this process (one torch thread); its workload
(prompts U(32, 256), 32 output tokens, all at t = 0; 32 requests per round, 12 with ``--quick``),
batch limits and ABBA rounds.
Target: throughput (tokens/s, wall clock) three agents ÷ one process ≥ 0.7, as for the torch engine.

Run in the venv holding vLLM:
``.venv-vllm/bin/python bench/vllm_backend.py [--only single|agents] [--quick] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))

import router.tokenizer  # noqa: E402,F401 - the package first: vllm_compare puts bench/ (bench/router.py) first on the path

# isort: split

from harness import RoundLog, Target, add_rounds_option, arm_order, figures_table, verdict_lines  # noqa: E402
from vllm_compare import SCHED, WARMUP, Ours, VLLMWorker, record, workload  # noqa: E402

if TYPE_CHECKING:
    from rich.console import Console

TARGETS = {"vLLM backend ÷ vLLM, by CPU time": Target(">=", 0.9)}
RATIO_TORCH = "vLLM backend ÷ torch engine, by CPU time"
SINGLE_ROUNDS = 4  # the ratio sits near its 0.9x target: an even number of ABBA rounds
AGENTS_ROUNDS = 3  # bench/agents.py's default


class OnVllm(Ours):
    """``bench/vllm_compare.py``'s one-engine arm, with the stage's layers built by vLLM."""

    def __init__(self, model_dir: Path, threads: int, progress: Any) -> None:
        import torch

        from node_agent.backends import StageBackend
        from node_agent.engine import StageEngine
        from node_agent.sampling import SamplingParams
        from node_agent.scheduler import SchedulerConfig

        torch.set_num_threads(threads)
        self.params, self.progress, self.torch = SamplingParams, progress, torch
        self.engine = StageEngine(model_dir, kv_capacity_tokens=1 << 16, scheduler=SchedulerConfig(**SCHED),  # type: ignore[arg-type]
                                  backend=StageBackend("vllm"))  # fmt: skip
        self.engine.add_request("warmup", SamplingParams(max_tokens=WARMUP[1]), prompt_token_ids=WARMUP[0])
        while self.engine.has_unfinished:
            self.engine.step()


def single(model_dir: Path, n: int, rounds: int, console: Console) -> None:
    """One agent on the vLLM backend vs vLLM's ``LLM.generate`` and vs the torch engine."""
    from rich.progress import Progress

    log = RoundLog()
    with Progress(console=console, transient=True) as progress:
        arms: dict[str, Any] = {"vLLM backend": OnVllm(model_dir, 1, progress), "torch engine": Ours(model_dir, 1, progress),
                                "vLLM": VLLMWorker(model_dir, 1, sys.executable, progress,
                                                   Path(tempfile.gettempdir()) / "helix-vllm-backend.log")}  # fmt: skip
        try:
            for r in log.each_round(rounds, lambda text: console.print(f"  {text}")):
                reqs = workload(n, seed=r)
                prompt_tokens, gen_tokens = sum(len(p) for p, _ in reqs), sum(m for _, m in reqs)
                for name in arm_order(list(arms), r):
                    record(log, r, name, arms[name].run(reqs, f"r{r}-{name.split()[0]}"), prompt_tokens, gen_tokens)
        finally:
            arms["vLLM"].close()
    log.ratio("vLLM backend ÷ vLLM, by CPU time", "total tok/s by CPU, vLLM backend", "total tok/s by CPU, vLLM")
    log.ratio(RATIO_TORCH, "total tok/s by CPU, vLLM backend", "total tok/s by CPU, torch engine")
    console.print(figures_table(log, f"One agent on the vLLM backend — SmolLM2-135M float32, Orca mix, {n} requests "
                                     f"per round, {rounds} round(s), ours: up to {SCHED['chunk_size']} prompt tokens "
                                     "per step", TARGETS))  # fmt: skip
    for line in verdict_lines(log, TARGETS):
        console.print(line)


def agents_on_vllm(model_dir: Path, quick: bool, rounds: int | None, console: Console) -> None:
    """``bench/agents.py``'s three agents vs one process, every stage on the vLLM backend."""
    import agents
    import torch
    from rich.progress import Progress

    torch.set_num_threads(1)  # the one-process arm; each agent gets --threads 1 and OMP_NUM_THREADS=1
    with Progress(console=console, transient=True) as progress:
        parts = agents.section(model_dir, quick, rounds or (1 if quick else AGENTS_ROUNDS), progress, backend="vllm")
    for part in parts:
        console.print(part)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["single", "agents"], help="run one section (default: both)")
    parser.add_argument("--quick", action="store_true", help="one round; single: 8 requests, agents: 12")
    parser.add_argument("--requests", type=int, default=16, help="single: requests per round (default 16)")
    add_rounds_option(parser, None, f"single {SINGLE_ROUNDS}, agents {AGENTS_ROUNDS}, or 1 with --quick")
    parser.add_argument("--chunk", type=int, default=SCHED["chunk_size"],
                        help=f"single: our engines' prompt tokens per step (default {SCHED['chunk_size']}, the agent's; "
                             "512 = vLLM's step limit here)")
    args = parser.parse_args()
    SCHED["chunk_size"] = args.chunk
    from rich.console import Console

    from node_agent.gguf_convert import cached_model_dir
    from router.tokenizer import ensure_tokenizer_dir

    model_dir = ensure_tokenizer_dir(cached_model_dir())
    console = Console(width=max(Console().width, 120))
    if args.only in (None, "single"):
        n, rounds = (8, 1) if args.quick else (args.requests, args.rounds or SINGLE_ROUNDS)
        single(model_dir, n, rounds, console)
    if args.only in (None, "agents"):
        agents_on_vllm(model_dir, args.quick, args.rounds, console)


if __name__ == "__main__":
    main()
