"""What a simulation is asked (:class:`SimConfig`) and what it answers (:class:`SimResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from helix.errors import ConfigError
from helix.perf_model import DECODE_CONTEXT_PER_SLOT, HOST_COPY_GB_PER_S, PROMPT_SLOT_TOKENS
from router.pet_balancer import BalancePolicy
from router.task_placement import PlacementPolicy
from simulator.routing import FLOWS
from simulator.tasks import Popularity
from simulator.workload import RequestSpec

MODES = ("offline", "online")


@dataclass(slots=True)
class SimConfig:
    mode: str = "offline"  # offline | online
    router: str = "iwrr"
    duration_s: float = 600.0
    warmup_s: float = 60.0
    seed: int = 0
    lengths: str = "azure-conv"
    rate_per_s: float | None = None  # online: requests/s
    load: float | None = None  # online: fraction of the plan's max flow (tokens/s)
    cv: float = 1.0  # online arrivals: 1 Poisson, > 1 bursty Gamma
    trace: list[RequestSpec] | None = None
    watermark: float = 0.85
    expected_output_tokens: float = 232.0
    feed_hwm: float = 0.8
    offline_initial: int = 20
    max_inflight: int | None = None  # offline: None = the paper's KV feeder (every router); N = N clients in a loop
    num_requests: int | None = None  # stop issuing after this many and drain (tests)
    kv_report_interval_s: float = 1.0
    iteration_overhead_ms: float = 0.0  # CPU per iteration beyond the profile's step: agents' messaging, a co-located coordinator
    host_cores: int | None = None  # nodes on one host (address) run at most this many iterations at once
    prefill_chunk_tokens: int | None = None  # Sarathi: one prefill chunk of at most this many tokens per iteration
    # the agent's own bounds (--max-batch-size, --token-budget); None: a node holds as many requests as its KV
    # reserves and an iteration is bounded by the profile's limits alone, as the paper's vLLM nodes
    max_batch_size: int | None = None
    token_budget: int | None = None
    gather_window_ms: float = 0.0  # an idle node woken by an arrival starts this much later (helix agent: 3 ms)
    bucket_s: float = 10.0
    # the paper simulator's mechanisms we believe for a real GPU cluster (issue 21, docs/simulator.md), on by
    # default; LEGACY_MECHANISMS turns every one off (the figures before issue 21)
    decode_floor: bool = True  # a decode below the smallest measured batch costs that batch (helix.perf_model)
    prompt_slot_tokens: int | None = PROMPT_SLOT_TOKENS  # whole prompts per iteration <= prompt_max_tokens // this; None: any
    decode_context_per_slot: float | None = DECODE_CONTEXT_PER_SLOT  # decodes' contexts summed <= decode_max_tokens x this; None: any
    host_copy_gb_per_s: tuple[float, ...] = HOST_COPY_GB_PER_S  # received bytes are copied once at each rate; (): free
    # routing weights: "plan" = the plan's flows; "judge" = the paper simulator's (networkx max flow recomputed on
    # the placement, hops under 5 % of their vertex's out-flow dropped): to score a plan as the judge would
    flows: str = "plan"
    # the paper simulator's messages: one per request, back to back (an idle node starts on the first); off: one
    # message per next hop per batch, as an agent that gathers a burst before it steps receives it
    per_request_messages: bool = False
    # fine-tuned tasks (simulator.tasks): PET type -> tasks every request is drawn from evenly (e.g. {"lora": 64});
    # None: the cluster file's tasks; {}: every request on the base model
    task_mix: dict[str, int] | None = None
    # which task each request runs (simulator.tasks.Popularity: even, or Zipf reshuffled every shift_s), which nodes
    # hold each task (helix serve --task-placement) and PET migration (helix serve --pet-balance's policy; None: off),
    # its PET copies loaded at pet_load_gb_per_s (simulator.pet_migration)
    task_popularity: Popularity = field(default_factory=Popularity)
    task_placement: str = "all"
    pet_balance: BalancePolicy | None = None
    pet_load_gb_per_s: float = 2.0
    pet_serial_drains: bool = False  # the next PET move and round wait until the source is freed (helix serve: at the switch)

    def check(self) -> None:
        """ConfigError naming the first setting out of range."""
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r} (offline or online)", field="--mode")
        if self.flows not in FLOWS:
            raise ConfigError(f"unknown flows {self.flows!r} ({' or '.join(FLOWS)})", field="flows")
        for name in ("host_cores", "prefill_chunk_tokens", "prompt_slot_tokens", "max_batch_size", "token_budget",
                     "max_inflight"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1 (or None: off), got {value}", field=name)
        if self.token_budget is not None and (self.max_batch_size is None or self.token_budget < self.max_batch_size):
            raise ConfigError(f"token_budget ({self.token_budget}) needs a max_batch_size it is at least "
                              f"(got {self.max_batch_size}): every decode of a full batch must fit", field="token_budget")
        if self.decode_context_per_slot is not None and self.decode_context_per_slot <= 0:
            raise ConfigError(f"decode_context_per_slot must be positive (or None: off), got "
                              f"{self.decode_context_per_slot}", field="decode_context_per_slot")  # fmt: skip
        if self.task_placement not in {p.value for p in PlacementPolicy}:
            raise ConfigError(f"unknown task placement {self.task_placement!r} (all or spread)", field="--task-placement")
        if not self.pet_load_gb_per_s > 0:
            raise ConfigError(f"must be positive, got {self.pet_load_gb_per_s}", field="--pet-load-gb-per-s")
        if any(rate <= 0 for rate in self.host_copy_gb_per_s):
            raise ConfigError(f"host_copy_gb_per_s rates must be positive, got {self.host_copy_gb_per_s}",
                              field="host_copy_gb_per_s")  # fmt: skip


# SimConfig(**LEGACY_MECHANISMS): our simulator as it was before issue 21 adopted the paper simulator's mechanisms
LEGACY_MECHANISMS: dict[str, object] = {
    "decode_floor": False, "prompt_slot_tokens": None, "decode_context_per_slot": None, "host_copy_gb_per_s": (),
}


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    sim_end_s: float
    decode_tok_s: float
    prompt_tok_s: float
    prompt_latency_s: dict[str, float]
    decode_latency_s: dict[str, float]
    finished_requests: int
    admitted_requests: int
    kv_waits: int  # requests that could not start at once on a node (its KV reservations or batch slots full)
    max_inflight: int | None  # None: KV-fed
    node_utilization: dict[str, float]
    kv_peak_fraction: dict[str, float]
    kv_estimate_peak_fraction: dict[str, float]
    throughput_over_time: list[tuple[float, float]]
    events: int
    extra: dict[str, float] = field(default_factory=dict)
    membership: dict[str, Any] | None = None  # a membership trace's replay (simulator.membership.MembershipReplay.report)
    tasks: dict[str, Any] | None = None  # tasks placed, moved or skewed (simulator.pet_migration.TaskBalance.report)

    def to_json(self) -> dict:
        return {
            "router": self.config.router,
            "flows": self.config.flows,
            "mode": self.config.mode,
            "duration_s": self.config.duration_s,
            "warmup_s": self.config.warmup_s,
            "seed": self.config.seed,
            "decode_tok_s": self.decode_tok_s,
            "prompt_tok_s": self.prompt_tok_s,
            "prompt_latency_s": self.prompt_latency_s,
            "decode_latency_s": self.decode_latency_s,
            "finished_requests": self.finished_requests,
            "admitted_requests": self.admitted_requests,
            "kv_waits": self.kv_waits,
            "max_inflight": self.max_inflight,
            "node_utilization": self.node_utilization,
            "kv_peak_fraction": self.kv_peak_fraction,
            "kv_estimate_peak_fraction": self.kv_estimate_peak_fraction,
            "throughput_over_time": self.throughput_over_time,
            "events": self.events,
            **self.extra,
            **({"membership": self.membership} if self.membership is not None else {}),
            **({"tasks": self.tasks} if self.tasks is not None else {}),
        }


def percentiles(xs: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 of ``xs`` (NaN when empty)."""
    if not xs:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    a = np.asarray(xs)
    p50, p90, p99 = np.percentile(a, [50, 90, 99]).tolist()
    return {"mean": float(a.mean()), "p50": p50, "p90": p90, "p99": p99}
