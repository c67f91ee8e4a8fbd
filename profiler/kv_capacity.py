"""A measured node's memory: the layer limit and KV capacity its free memory gives, and the
default KV reserve when measuring.

A node gets ``MEMORY_UTILIZATION`` of the memory free on its device
(:func:`profiler.device.free_memory_bytes`, divided among the nodes sharing the device); the
layers it may hold and the KV left beside them follow from the KV reserve
(:mod:`profiler.kv_reserve`), by default ``DEFAULT_MIN_KV_TOKENS_PER_LAYER`` tokens in every
layer held, as an agent keeps.
"""

from __future__ import annotations

from typing import Any

from profiler.kv_reserve import KvReserve, LayerLimit

MEMORY_UTILIZATION = 0.9  # the share of a device's memory a node uses (vLLM's default gpu_memory_utilization)
DEFAULT_MIN_KV_TOKENS_PER_LAYER = 65536


def memory_limits(measured: dict[str, Any], free_bytes: float, reserve: KvReserve) -> tuple[LayerLimit, list[float]]:
    """What limits the layers a node with ``free_bytes`` of memory may hold, and its
    ``kv_capacity_tokens_by_layers`` up to that limit (KV entries left next to k layers)."""
    limit = LayerLimit(usable_bytes=free_bytes * MEMORY_UTILIZATION, layer_weight_bytes=measured["layer_weight_bytes"],
                       kv_bytes_per_token_per_layer=measured["kv_bytes_per_token_per_layer"],
                       num_layers=measured["num_layers"], reserve=reserve)  # fmt: skip
    w, kv_b, usable = limit.layer_weight_bytes, limit.kv_bytes_per_token_per_layer, limit.usable_bytes
    return limit, [float(int((usable - k * w) // kv_b)) for k in range(1, limit.max_layers + 1)]


def default_reserve(tokens_per_layer: int = DEFAULT_MIN_KV_TOKENS_PER_LAYER) -> KvReserve:
    """Measuring's default KV reserve: ``tokens_per_layer`` (the agent's --kv-capacity-tokens) per layer."""
    return KvReserve(tokens_per_layer=tokens_per_layer, why=f"{tokens_per_layer} tokens per layer, as an agent keeps")
