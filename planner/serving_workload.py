"""The workload the serving model (``planner.serving_model``) prices placements for, and how the
mechanisms it models behave: request lengths (the Azure conversation trace's means), the KV
watermarks of the router and the feeder, how decodes batch (fitted to the simulator on single24's
placements, docs/planner-optimizer.md section 6) and the paper's vLLM limits (as the simulator's
defaults, :mod:`helix.perf_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

from helix.perf_model import DECODE_CONTEXT_PER_SLOT, HOST_COPY_GB_PER_S, PROMPT_SLOT_TOKENS


@dataclass(slots=True, frozen=True)
class Workload:
    """A steady stream of requests of ``prompt_tokens`` + ``output_tokens``, and the mechanisms' settings."""

    prompt_tokens: float = 763.0
    output_tokens: float = 232.0
    kv_watermark: float = 0.8  # the feeder admits while the fullest layer's KV (summed over its holders) is below this
    kv_node_watermark: float = 0.85  # the router masks a node whose own KV estimate would pass this (router.kv)
    reserve_tokens: float | None = None  # KV reserved per request per layer; None = prompt + output
    prompt_counts_in_tok_s: bool = False  # True: T_i(k) caps prompt+decode tokens; False: decode only
    compute: str = "curves"  # "curves": node time from the latency curves when profiled; "tok_s": T_i(k)
    mixed_batches: bool = True  # iterations mix prefill and decode tokens (else: prefill inflation)
    routing: str = "flows"  # "flows": split as the max-flow paths (IWRR); "free": LP picks paths
    fixed_hop_ms: float = 0.0  # per-hop overhead not in the link latency
    # how decodes batch (fitted to the simulator on single24's placements, docs/planner-optimizer.md section 6):
    # requests move in convoys, convoys_per_width of them per parallel node of the widest layer; a decode waits
    # wait_share of the residual of the iteration in progress; a node runs at most busy_max of the time
    convoys_per_width: float = 5.0
    wait_share: float = 0.7
    busy_max: float = 0.9
    prompt_cv: float = 0.66  # prompt length's coefficient of variation (the Azure conversation mix: 0.66)
    # the paper's vLLM nodes (issue 21; helix.perf_model, as the simulator's defaults): whole prompts per iteration
    # <= prompt_max_tokens // prompt_slot_tokens, decodes' contexts <= decode_max x decode_context_per_slot, and
    # the bytes a node receives copied to the GPU at each of host_copy_gb_per_s; None / (): off
    prompt_slot_tokens: int | None = PROMPT_SLOT_TOKENS
    decode_context_per_slot: float | None = DECODE_CONTEXT_PER_SLOT
    host_copy_gb_per_s: tuple[float, ...] = HOST_COPY_GB_PER_S
    # fine-tuned tasks (docs/pets.md): PET type -> tasks the requests are spread over evenly, each request on one;
    # None: the cluster file's tasks (CapacityModel.task_mix); {}: every request on the base model
    task_mix: dict[str, int] | None = None
