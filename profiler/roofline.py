"""Roofline estimates of a GPU's per-layer latency curves, KV capacity and layer limit.

So a user can plan a cluster before owning it, :func:`estimate_throughput` turns a GPU's
spec sheet (:class:`~profiler.gpus.GpuSpec`) and a model's shape
(:class:`~profiler.gpus.ModelShape`) into the same ``ThroughputProfile`` the measuring
profiler writes. For one decoder layer with ``P`` parameters (``W = P * dtype_bytes`` bytes),
``h_q = heads * head_dim`` and KV bytes per token ``kv_b``::

    step_ms(flops, bytes) = max(flops / (peak_flops * COMPUTE_EFF),
                                bytes / (mem_bw * MEMORY_EFF)) + LAYER_OVERHEAD_MS

    prefill_ms(t) = step_ms(2 P t + 2 t s h_q,  W + t kv_b)       t batch tokens, prompts of
                                                                 s = min(t, prompt_tokens)
    decode_ms(b)  = step_ms(2 P b + 4 b c h_q,  W + b c kv_b)     b requests of mean context
                                                                 c = prompt + output / 2

(attention: 2·2 FLOPs per query-key pair per head dim for QK^T and AV; causal prefill sees on
average half its prompt). Memory: usable bytes = ``vram * MEMORY_UTILIZATION - RESERVE_BYTES``
(CUDA context, activations, allocator slack), and with ``k`` layers held::

    kv_capacity_tokens_by_layers[k-1] = (usable - k W) / kv_b      (token x layer entries)
    max_layers = the largest k whose weights leave the KV reserve (profiler.kv_reserve)

The default reserve (256 requests of the Azure trace's mean context in every layer held) is the
rule that reproduces the paper's layer limits for A100/L4/T4 (12/7/4 layers of LLaMA-2 70B);
``helix profile --estimate --kv-requests/--kv-context-tokens/--kv-reserve-gb`` changes it. The
efficiencies are one constant for every GPU — not fitted per GPU — so the comparison with the
paper's measured tables (``bench/roofline.py``) says how far a spec sheet is from reality.
"""

from __future__ import annotations

from dataclasses import dataclass

from helix.errors import InfeasiblePlanError
from helix.profile import (
    AZURE_MEAN_OUTPUT_TOKENS,
    AZURE_MEAN_PROMPT_TOKENS,
    GpuProfile,
    ModelProfile,
    ProfileSet,
    ThroughputProfile,
)
from profiler.gpus import GpuSpec, ModelShape
from profiler.kv_capacity import MEMORY_UTILIZATION
from profiler.kv_reserve import KvReserve, LayerLimit

COMPUTE_EFF = 0.6  # share of peak tensor FLOP/s a large GEMM reaches
MEMORY_EFF = 0.8  # share of peak bandwidth a streaming read reaches
LAYER_OVERHEAD_MS = 0.02  # kernel launches per layer per step
RESERVE_BYTES = 1.6e9  # CUDA context + activation workspace

PREFILL_BATCH_TOKENS = (128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192)
DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512)


@dataclass(frozen=True, slots=True)
class Roofline:
    """The estimate's knobs (defaults: the module constants)."""

    compute_eff: float = COMPUTE_EFF
    memory_eff: float = MEMORY_EFF
    layer_overhead_ms: float = LAYER_OVERHEAD_MS
    memory_utilization: float = MEMORY_UTILIZATION
    reserve_bytes: float = RESERVE_BYTES
    kv_reserve: KvReserve = KvReserve()
    prompt_tokens: float = AZURE_MEAN_PROMPT_TOKENS
    output_tokens: float = AZURE_MEAN_OUTPUT_TOKENS

    def step_ms(self, gpu: GpuSpec, flops: float, nbytes: float) -> float:
        compute_s = flops / (gpu.fp16_tflops * 1e12 * self.compute_eff)
        memory_s = nbytes / (gpu.mem_bw_gb_s * 1e9 * self.memory_eff)
        return max(compute_s, memory_s) * 1000 + self.layer_overhead_ms

    def prefill_ms(self, gpu: GpuSpec, model: ModelShape, batch_tokens: int) -> float:
        """One layer, one prefill step of ``batch_tokens`` prompt tokens."""
        t = batch_tokens
        s = min(t, self.prompt_tokens)
        h_q = model.num_heads * model.head_dim
        flops = 2 * model.layer_params * t + 2 * t * s * h_q
        nbytes = model.layer_weight_bytes + t * model.kv_bytes_per_token_per_layer
        return self.step_ms(gpu, flops, nbytes)

    def decode_ms(self, gpu: GpuSpec, model: ModelShape, batch_size: int) -> float:
        """One layer, one decode step of ``batch_size`` requests at the mean context."""
        b = batch_size
        c = self.prompt_tokens + self.output_tokens / 2
        h_q = model.num_heads * model.head_dim
        flops = 2 * model.layer_params * b + 4 * b * c * h_q
        nbytes = model.layer_weight_bytes + b * c * model.kv_bytes_per_token_per_layer
        return self.step_ms(gpu, flops, nbytes)

    def usable_bytes(self, gpu: GpuSpec) -> float:
        return gpu.vram_gb * 1e9 * self.memory_utilization - self.reserve_bytes

    def kv_capacity_tokens(self, gpu: GpuSpec, model: ModelShape, layers: int) -> float:
        """KV entries (token x layer) left when ``layers`` layers' weights are resident."""
        free = self.usable_bytes(gpu) - layers * model.layer_weight_bytes
        return max(0.0, free / model.kv_bytes_per_token_per_layer)

    def layer_limit(self, gpu: GpuSpec, model: ModelShape) -> LayerLimit:
        """What limits the layers ``gpu`` may hold: usable memory, weights and the KV reserve."""
        return LayerLimit(usable_bytes=self.usable_bytes(gpu), layer_weight_bytes=model.layer_weight_bytes,
                          kv_bytes_per_token_per_layer=model.kv_bytes_per_token_per_layer,
                          num_layers=model.num_layers, reserve=self.kv_reserve)  # fmt: skip

    def max_layers(self, gpu: GpuSpec, model: ModelShape) -> int:
        """The most layers whose weights fit while the KV reserve is kept."""
        return self.layer_limit(gpu, model).max_layers


def model_profile(model: ModelShape) -> ModelProfile:
    """The profiles file's model constants for ``model``."""
    return ModelProfile(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        dtype_bytes=model.dtype_bytes,
        layer_weight_bytes=float(model.layer_weight_bytes),
        kv_bytes_per_token_per_layer=float(model.kv_bytes_per_token_per_layer),
    )


def estimate_throughput(gpu: GpuSpec, model: ModelShape, roofline: Roofline | None = None) -> ThroughputProfile:
    """Per-layer prefill/decode curves, KV capacity by layers held, and the layer limit.

    Both curves start at ``(0, 0)`` (no work, no time), as the paper's measured curves do, so a
    simulator interpolating them charges nothing for an absent phase.
    """
    rl = roofline or Roofline()
    limit = rl.layer_limit(gpu, model)
    k_max = limit.max_layers
    if k_max < 1:
        raise InfeasiblePlanError(
            f"{gpu.name} ({gpu.vram_gb:g} GB) cannot hold one layer of {model.name} with its KV reserve: "
            f"{limit.explain()} (a smaller --kv-requests, --kv-context-tokens or --kv-reserve-gb may fit)"
        )
    return ThroughputProfile(
        max_layers=k_max,
        prefill_ms_per_layer=[(0.0, 0.0)]
        + [(float(t), round(rl.prefill_ms(gpu, model, t), 4)) for t in PREFILL_BATCH_TOKENS],
        decode_ms_per_layer=[(0.0, 0.0)] + [(float(b), round(rl.decode_ms(gpu, model, b), 4)) for b in DECODE_BATCH_SIZES],
        kv_capacity_tokens_by_layers=[round(rl.kv_capacity_tokens(gpu, model, k)) for k in range(1, k_max + 1)],
    )


def estimate_profiles(
    gpus: dict[str, GpuSpec], model: ModelShape, roofline: Roofline | None = None
) -> ProfileSet:
    """A ProfileSet for ``model`` on every GPU; keys of ``gpus`` become the profile's GPU names."""
    return ProfileSet(
        models={model.name: model_profile(model)},
        gpus={
            key: GpuProfile(vram_gb=spec.vram_gb, throughput={model.name: estimate_throughput(spec, model, roofline)})
            for key, spec in gpus.items()
        },
    )
