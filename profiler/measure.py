"""Measuring one device through the real engine: per-layer latency curves, KV capacity, layer limit.

:func:`measure_device` builds :class:`node_agent.engine.StageEngine` stages of the model (two
runs of middle layers of different lengths, and the last layer with the LM head) and drives
each exactly as an agent does, with ``add_request`` / ``push_hidden`` / ``step``:

* **prefill**: one request of ``t`` prompt tokens in one step (chunking off), for every ``t`` in
  ``prefill_tokens``;
* **decode**: ``b`` requests of about ``context_tokens`` of context, one new token each per step,
  for every ``b`` in ``decode_batches``;
* **context**: on the longer middle stage, ``context_batch`` requests decoding at
  ``context_tokens`` and as many at ``long_context_tokens``: the cost of context (attention
  reads every cached key and value) per layer, per request and per token,
  ``decode_ms_per_context_token``;
* **tasks**: on the longer middle stage, what each fine-tuned task a step touches adds to a
  layer, per PET type of ``pet_types`` and by the task's rows, ``pet_ms_per_layer``
  (:mod:`profiler.pet_costs`; torch backend only).

Every point is the median of ``repeats`` steps, and the points are measured in turns (a round
of every point, ``repeats`` times): see :func:`_step_curves`.

From the three stages' step times come the per-layer curves (see :func:`measure_device`). The
two middle stages are long enough that their weights do not fit the device's last-level cache
(:func:`profiler.device.probe_stage_layers`): a real stage streams its weights from memory every
step, and a one-layer probe that stays in cache made decode look up to twice as cheap as it is on CPU.

KV capacity (:mod:`profiler.kv_capacity`) comes from free memory (``MemAvailable`` on CPU,
``torch.cuda.mem_get_info`` on a GPU) divided among the nodes sharing the device, times
``MEMORY_UTILIZATION``, minus the weights of the layers held, over the engine's KV bytes per
token per layer; the layer limit is the most layers whose weights fit beside the KV reserve
(:mod:`profiler.kv_reserve`; by default ``min_kv_tokens_per_layer`` of KV in every layer held).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helix.errors import ConfigError
from profiler.device import last_level_cache_bytes, probe_stage_layers, step_clock
from profiler.kv_capacity import DEFAULT_MIN_KV_TOKENS_PER_LAYER
from profiler.pet_costs import measure_pet_costs
from profiler.step_costs import layer_slopes, with_step_costs

log = logging.getLogger(__name__)

DEFAULT_PREFILL_TOKENS = (16, 64, 128, 256)  # the agent's prefill chunk is 256
DEFAULT_DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DEFAULT_CONTEXT_TOKENS = 64
DEFAULT_LONG_CONTEXT_TOKENS = 512  # far enough from context_tokens that the growth stands out of the noise
DEFAULT_CONTEXT_BATCH = 8
DEFAULT_PET_TYPES = ("lora", "adapter", "bitfit", "diff", "mask")
DEFAULT_PET_ROWS = (1, 16)  # a decode's one row, a piece of a prompt
DEFAULT_PET_TASKS = 8  # tasks touched in each timed step
DEFAULT_PET_REPEATS = 5  # rounds of the task probes (five types: 20 steps a round)
MEASURE_VERSION = 9  # bump when what measure_device returns changes (invalidates caches)

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class MeasureSettings:
    """What to measure; part of the cache key so changed settings re-measure."""

    probe_layers: int | None = None  # the longer middle stage; None: out of cache (probe_stage_layers)
    prefill_tokens: tuple[int, ...] = DEFAULT_PREFILL_TOKENS
    decode_batches: tuple[int, ...] = DEFAULT_DECODE_BATCHES
    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    long_context_tokens: int = DEFAULT_LONG_CONTEXT_TOKENS
    context_batch: int = DEFAULT_CONTEXT_BATCH
    repeats: int = 9
    min_kv_tokens_per_layer: int = DEFAULT_MIN_KV_TOKENS_PER_LAYER
    backend: str = "torch"  # what runs the layers: "torch" or "vllm" (node_agent.backends)
    pet_types: tuple[str, ...] = DEFAULT_PET_TYPES  # fine-tuned tasks' costs to measure (torch only); (): none
    pet_rows: tuple[int, ...] = DEFAULT_PET_ROWS
    pet_tasks: int = DEFAULT_PET_TASKS
    pet_repeats: int = DEFAULT_PET_REPEATS

    def key(self) -> dict[str, Any]:
        return {
            "version": MEASURE_VERSION,
            **({"backend": self.backend} if self.backend != "torch" else {}),  # torch: the keys cached before
            "probe_layers": self.probe_layers,
            "prefill_tokens": list(self.prefill_tokens),
            "decode_batches": list(self.decode_batches),
            "context_tokens": self.context_tokens,
            "long_context_tokens": self.long_context_tokens,
            "context_batch": self.context_batch,
            "repeats": self.repeats,
            "pets": [list(self.pet_types), list(self.pet_rows), self.pet_tasks, self.pet_repeats],
        }


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 4)


def decode_runs(settings: MeasureSettings) -> int:
    """The most decode steps one probe request can run during :func:`_step_curves` (its KV
    reservation): one per measured point, every round, the untimed first round included."""
    return (settings.repeats + 1) * (len(settings.decode_batches) + 2)


@dataclass(slots=True)
class _ProbeRequests:
    """The decode requests one probe engine keeps for the whole measurement: a ``pool`` at
    ``context_tokens`` that every decode point takes its batch from, in turn (so all of them
    grow alike), and, on the engines that price context, ``near`` and ``far`` groups of
    ``context_batch`` at ``context_tokens`` and ``long_context_tokens``, run once a round each
    (so their contexts stay exactly that far apart)."""

    pool: deque[str]
    near: list[str]
    far: list[str]


@dataclass(slots=True)
class StepCurves:
    """Median step ms of one probe engine at every point, and the mean context its decodes ran at."""

    prefill: list[float]
    decode: list[float]
    context: list[float]  # [near, far] at context_batch; [] where context is not measured
    context_growth_ms: float  # the median of far - near, step by step (0.0 where not measured)
    decode_context_tokens: float


def _step_curves(engines: dict[str, Any], settings: MeasureSettings, note: Progress,
                 context_labels: tuple[str, ...]) -> dict[str, StepCurves]:  # fmt: skip
    """Median step ms of every engine for every prefill size and decode batch of ``settings``,
    and, for the engines in ``context_labels``, of ``context_batch`` requests decoding at
    ``context_tokens`` and at ``long_context_tokens``.

    Everything is measured in turns: ``repeats`` rounds (after an untimed one), each round one
    step of every engine at every point. This machine's speed drifts by 10-30 % within seconds
    (other processes, the co-located nodes being measured at the same time, the host under the
    VM); measured one point after another, the drift landed on whichever point ran then and
    drowned the context cost (a few percent of a step) entirely. In turns, every point sees the same mix of fast and slow
    moments, so the curves' shapes (the per-layer slope between two stages, the head, the growth
    with batch and with context) are clean and their level is the average over the measurement.

    The decode requests stay resident (:class:`_ProbeRequests`); a step runs exactly the ones
    given an input just before it, as an agent's step runs the requests whose inputs arrived.
    """
    import torch

    from node_agent.sampling import SamplingParams

    s = settings
    sampling = SamplingParams(max_tokens=decode_runs(s))
    counter = iter(range(1 << 30))
    clocks = {label: step_clock(str(getattr(engine, "device", "cpu"))) for label, engine in engines.items()}

    def add(engine: Any, tokens: int) -> str:
        rid = f"probe-{next(counter)}"
        engine.add_request(rid, sampling, prompt_len=tokens)
        engine.push_hidden(rid, torch.randn(tokens, engine.config.hidden_size))
        return rid

    def timed_step(label: str) -> float:
        clock, engine = clocks[label], engines[label]
        t0 = clock()
        engine.step()
        return clock() - t0

    for engine in engines.values():  # warm-up: first-call allocations
        warm = add(engine, 32)
        engine.step()
        engine.cancel(warm)
    note("prefilling the decode requests")
    probes: dict[str, _ProbeRequests] = {}
    for label, engine in engines.items():
        priced = label in context_labels
        probes[label] = _ProbeRequests(
            pool=deque(add(engine, s.context_tokens) for _ in range(max(s.decode_batches))),
            near=[add(engine, s.context_tokens) for _ in range(s.context_batch)] if priced else [],
            far=[add(engine, s.long_context_tokens) for _ in range(s.context_batch)] if priced else [])
        running = engine.scheduler.running
        while any(seq.in_prefill for seq in running.values()):
            engine.step()

    def decode_step(label: str, rids: list[str]) -> tuple[float, int]:
        """One timed step of ``rids`` decoding a token each: (seconds, their context tokens)."""
        engine = engines[label]
        context = sum(engine.scheduler.running[rid].computed_tokens for rid in rids)
        for rid in rids:
            engine.push_hidden(rid, torch.randn(1, engine.config.hidden_size))
        return timed_step(label), context

    prefill: dict[str, list[list[float]]] = {label: [[] for _ in s.prefill_tokens] for label in engines}
    decode: dict[str, list[list[float]]] = {label: [[] for _ in s.decode_batches] for label in engines}
    context: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for label in context_labels if label in engines}
    decoded = {label: [0, 0] for label in engines}  # context tokens, requests: the decode curve's own context
    for rnd in range(s.repeats + 1):
        timed = rnd > 0  # the first round only settles allocations and caches
        note(f"round {rnd + 1} of {s.repeats + 1}: prefill, decode, context" if timed else "untimed first round")
        for i, t in enumerate(s.prefill_tokens):
            for label, engine in engines.items():
                rid = add(engine, t)
                took = timed_step(label)
                engine.cancel(rid)
                if timed:
                    prefill[label][i].append(took)
        for i, b in enumerate(s.decode_batches):
            for label in engines:
                pool = probes[label].pool
                took, ctx = decode_step(label, [pool[j] for j in range(b)])
                pool.rotate(-b)
                if timed:
                    decode[label][i].append(took)
                    decoded[label][0] += ctx
                    decoded[label][1] += b
        for label, (near, far) in context.items():
            if rnd % 2:  # in turns, so neither group always runs right after the other
                far_s, _ = decode_step(label, probes[label].far)
                near_s, _ = decode_step(label, probes[label].near)
            else:
                near_s, _ = decode_step(label, probes[label].near)
                far_s, _ = decode_step(label, probes[label].far)
            if timed:
                near.append(near_s)
                far.append(far_s)
    for label, engine in engines.items():
        for rid in [*probes[label].pool, *probes[label].near, *probes[label].far]:
            engine.cancel(rid)
    return {label: StepCurves(prefill=[_median_ms(x) for x in prefill[label]],
                              decode=[_median_ms(x) for x in decode[label]],
                              context=[_median_ms(x) for x in context[label]] if label in context else [],
                              context_growth_ms=_median_ms([f - n for n, f in zip(*context[label], strict=True)])
                              if label in context else 0.0,
                              decode_context_tokens=decoded[label][0] / max(1, decoded[label][1]))
            for label in engines}  # fmt: skip


def measure_device(
    model_dir: str | Path,
    settings: MeasureSettings | None = None,
    *,
    progress: Progress | None = None,
    loaded: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Per-layer prefill/decode curves of ``model_dir`` on this machine's engine (CPU, float32).

    ``loaded`` is called once the probe stages are built, before any step is timed (the
    concurrent profiler waits there until every co-located node is ready, so the measurements
    overlap as the nodes' steps do when they serve).

    Three engines are timed: two runs of middle layers from layer 1, of the lengths
    :func:`profiler.device.probe_stage_layers` picks (weights out of cache) — the per-layer cost is the slope
    between them, so the engine's fixed per-step cost (scheduling,
    gathering rows) is not multiplied by the layer count — and the last layer alone, which also
    runs the final norm, the LM head and sampling. The per-layer curves are the slopes; the
    fixed per-step cost (the shorter stage minus its layers) becomes ``step_overhead_ms`` and what
    the last stage costs beyond that (final norm, LM head, sampling) ``head_ms``
    (:func:`profiler.step_costs.with_step_costs`), so a pipeline stage pays its step cost once and only the last
    stage pays the head.
    """
    import torch

    from node_agent.backends import StageBackend
    from node_agent.config import load_config
    from node_agent.engine import StageEngine
    from node_agent.scheduler import SchedulerConfig

    s = settings or MeasureSettings()
    backend = StageBackend(s.backend)
    torch.set_num_threads(1)
    note = progress or (lambda _msg: None)
    try:
        config = load_config(model_dir)
    except Exception as exc:  # noqa: BLE001 - EngineError or I/O: report as a config problem
        raise ConfigError(f"cannot load the model for profiling: {exc}", source=str(model_dir)) from None
    n = config.num_layers
    if n < 3:
        raise ConfigError(f"profiling needs a model with at least 3 layers, this one has {n}", source=str(model_dir))
    short, layers = probe_stage_layers(n, config.layer_weight_bytes(4), last_level_cache_bytes(), s.probe_layers)
    if s.long_context_tokens <= s.context_tokens:
        raise ConfigError(f"long_context_tokens ({s.long_context_tokens}) must exceed context_tokens ({s.context_tokens})",
                          field="long_context_tokens")  # fmt: skip
    resident = max(max(s.decode_batches) + 2 * s.context_batch + 1, s.pet_tasks)  # decodes + a prefill, or tasks
    pet_tokens = s.pet_tasks * max(s.pet_rows, default=0)
    sched = SchedulerConfig(max_batch_size=resident,
                            token_budget=max(max(s.prefill_tokens), resident, s.long_context_tokens, pet_tokens),
                            chunk_size=None)  # fmt: skip
    runs = decode_runs(s)
    kv_tokens = (max(s.decode_batches) * (s.context_tokens + runs) + s.context_batch * (s.context_tokens + runs)
                 + s.context_batch * (s.long_context_tokens + runs) + max(*s.prefill_tokens, pet_tokens) + runs
                 + 1024)  # fmt: skip
    engines = {
        "short": StageEngine(model_dir, 1, 1 + short, kv_capacity_tokens=kv_tokens, scheduler=sched, backend=backend),
        "long": StageEngine(model_dir, 1, 1 + layers, kv_capacity_tokens=kv_tokens, scheduler=sched, backend=backend),
        "last": StageEngine(model_dir, n - 1, n, kv_capacity_tokens=kv_tokens, scheduler=sched, backend=backend),
    }
    note(f"stages: layers 1-{short}, layers 1-{layers}, last layer + LM head, measured in turns")
    if loaded is not None:
        loaded()
    # context is priced on the longer stage alone: its cost grows with the layers, the fixed part does not
    curves = _step_curves(engines, s, note, context_labels=("long",))
    pet_ms = measure_pet_costs(engines["long"], s.pet_types if backend.name == "torch" else (), s.pet_rows,
                               s.pet_tasks, s.pet_repeats, step_clock(str(engines["long"].model.device)), note)  # fmt: skip
    del engines
    one, mid, last = curves["short"], curves["long"], curves["last"]
    pre_one, dec_one, pre_mid, dec_mid, pre_last, dec_last = (one.prefill, one.decode, mid.prefill, mid.decode,
                                                              last.prefill, last.decode)  # fmt: skip
    # the growth is a few percent of a step: a median of paired differences (the two groups' steps
    # run back to back) leaves out the machine's drift, which a difference of two medians keeps
    ctx_ms = max(0.0, mid.context_growth_ms / layers / s.context_batch / (s.long_context_tokens - s.context_tokens))
    weight_bytes = config.layer_weight_bytes(4)
    pre_layer = layer_slopes(pre_one, pre_mid, short, layers)
    dec_layer = layer_slopes(dec_one, dec_mid, short, layers)
    pre_fixed = [max(0.0, a - short * b) for a, b in zip(pre_one, pre_layer, strict=True)]
    dec_fixed = [max(0.0, a - short * b) for a, b in zip(dec_one, dec_layer, strict=True)]
    pre_head = [max(0.0, a - b) for a, b in zip(pre_last, pre_layer, strict=True)]
    dec_head = [max(0.0, a - b) for a, b in zip(dec_last, dec_layer, strict=True)]
    return with_step_costs({
        "num_layers": n,
        "hidden_size": config.hidden_size,
        "dtype_bytes": 4,
        "layer_weight_bytes": float(weight_bytes),
        "kv_bytes_per_token_per_layer": float(config.kv_bytes_per_token_per_layer(4)),
        "prefill_ms_per_layer": [[0.0, 0.0]] + [[float(t), round(ms + h / n, 4)] for t, ms, h
                                                 in zip(s.prefill_tokens, pre_layer, pre_head, strict=True)],
        "decode_ms_per_layer": [[0.0, 0.0]] + [[float(b), round(ms + h / n, 4)] for b, ms, h
                                                in zip(s.decode_batches, dec_layer, dec_head, strict=True)],
        # the mean context the timed decode steps attended over (each step adds a token)
        "decode_context_tokens": round(mid.decode_context_tokens + 1, 2),
        "decode_ms_per_context_token": round(ctx_ms, 7),
        **({"pet_ms_per_layer": pet_ms} if pet_ms else {}),
        "raw": {"prefill_layer_ms": pre_layer, "prefill_head_ms": pre_head,
                "decode_layer_ms": dec_layer, "decode_head_ms": dec_head,
                "prefill_fixed_ms": pre_fixed, "decode_fixed_ms": dec_fixed, "probe_layers": [short, layers],
                "context_step_ms": {"long": mid.context}, "context_growth_ms": mid.context_growth_ms},
    })  # fmt: skip


