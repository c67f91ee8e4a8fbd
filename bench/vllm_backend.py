"""One agent on the vLLM backend vs vLLM's own offline engine (``LLM.generate``) and vs our torch engine.

Same model, workload and batch limits as ``bench/vllm_compare.py`` (whose workload, vLLM worker
and torch arm this reuses): SmolLM2-135M float32, Orca's request mix, all requests at t = 0, one
thread per engine. Arms per round, in ABBA order (``bench/harness.py``): a ``StageEngine`` holding
layers [0, 30) on the vLLM backend (``node_agent/vllm_layers.py``), the same on the torch engine,
and vLLM's ``LLM.generate`` in a worker process. Targets: vLLM backend ÷ vLLM ≥ 0.9 (our
scheduling and glue cost at most 10 %, by CPU time); vLLM backend ÷ torch engine is reported.

Not measured here yet: three vLLM-backed agents over ZeroMQ vs one (``bench/agents.py`` measures
that for the torch engine).

Run in the venv holding vLLM: ``.venv-vllm/bin/python bench/vllm_backend.py [--quick] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))

import router.tokenizer  # noqa: E402,F401 - the package first: vllm_compare puts bench/ (bench/router.py) first on the path

# isort: split

from harness import RoundLog, Target, add_rounds_option, arm_order, figures_table, verdict_lines  # noqa: E402
from vllm_compare import SCHED, WARMUP, Ours, VLLMWorker, record, workload  # noqa: E402

TARGETS = {"vLLM backend ÷ vLLM, by CPU time": Target(">=", 0.9)}
RATIO_TORCH = "vLLM backend ÷ torch engine, by CPU time"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests, one round")
    parser.add_argument("--requests", type=int, default=16, help="requests per round (default 16)")
    add_rounds_option(parser, None, "2, or 1 with --quick")
    args = parser.parse_args()
    from rich.console import Console
    from rich.progress import Progress

    from node_agent.gguf_convert import cached_model_dir
    from router.tokenizer import ensure_tokenizer_dir

    n, rounds = (8, 1) if args.quick else (args.requests, args.rounds or 2)
    model_dir = ensure_tokenizer_dir(cached_model_dir())
    console = Console(width=max(Console().width, 120))
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
                                     f"per round, {rounds} round(s)", TARGETS))  # fmt: skip
    for line in verdict_lines(log, TARGETS):
        console.print(line)


if __name__ == "__main__":
    main()
