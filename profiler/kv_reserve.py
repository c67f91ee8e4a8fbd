"""The KV reserve: the memory a node keeps for KV cache beside its weights, and the layer limit
(``max_layers``) it implies.

A node holding ``k`` layers of a model with ``W`` weight bytes per layer and ``kv_b`` KV bytes
per token per layer has ``usable - k W`` bytes left for KV. The reserve says how much of that
it must keep, in one of two forms (``helix profile --kv-requests/--kv-context-tokens`` or
``--kv-reserve-gb``)::

    per layer held:  k W + k * tokens_per_layer * kv_b <= usable    tokens_per_layer =
                                                                     requests x context tokens
    fixed:           k W + reserve_bytes <= usable

``max_layers`` is the largest such ``k`` (at most the model's layer count). The per-layer form
is the one that keeps a node's concurrency whatever it holds: a request's context occupies KV in
every layer the node runs for it. :class:`LayerLimit` says, for one GPU, what limited it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from helix.profile import AZURE_MEAN_OUTPUT_TOKENS, AZURE_MEAN_PROMPT_TOKENS

# The paper's rule: 256 requests of the Azure conversation trace's mean context (prompt + output)
# in every layer held reproduces its layer limits for A100/L4/T4 (12/7/4 layers of LLaMA-2 70B).
DEFAULT_KV_REQUESTS = 256
DEFAULT_KV_CONTEXT_TOKENS = AZURE_MEAN_PROMPT_TOKENS + AZURE_MEAN_OUTPUT_TOKENS


@dataclass(frozen=True, slots=True)
class KvReserve:
    """KV kept beside the weights: ``tokens_per_layer`` in every layer held, or ``fixed_bytes``."""

    tokens_per_layer: float = DEFAULT_KV_REQUESTS * DEFAULT_KV_CONTEXT_TOKENS
    fixed_bytes: float | None = None
    why: str = f"{DEFAULT_KV_REQUESTS} requests x {DEFAULT_KV_CONTEXT_TOKENS} tokens"

    @classmethod
    def for_requests(cls, requests: int, context_tokens: float) -> KvReserve:
        """KV for ``requests`` concurrent requests of ``context_tokens`` each, in every layer held."""
        return cls(tokens_per_layer=requests * context_tokens, why=f"{requests} requests x {context_tokens:g} tokens")

    @classmethod
    def fixed_gb(cls, gb: float) -> KvReserve:
        """``gb`` GB (10^9 bytes) of each GPU kept for KV, whatever it holds."""
        return cls(tokens_per_layer=0.0, fixed_bytes=gb * 1e9, why=f"{gb:g} GB per GPU")

    def bytes_for(self, layers: int, kv_bytes_per_token_per_layer: float) -> float:
        """Bytes kept for KV when ``layers`` layers are held."""
        if self.fixed_bytes is not None:
            return self.fixed_bytes
        return layers * self.tokens_per_layer * kv_bytes_per_token_per_layer

    def describe(self) -> str:
        if self.fixed_bytes is not None:
            return f"KV reserve of {self.fixed_bytes / 1e9:g} GB per GPU"
        return f"KV reserve of {self.tokens_per_layer:,.0f} tokens in every layer held ({self.why})"


@dataclass(frozen=True, slots=True)
class LayerLimit:
    """How many layers one GPU may hold, and why."""

    usable_bytes: float  # memory for weights + KV
    layer_weight_bytes: float
    kv_bytes_per_token_per_layer: float
    num_layers: int
    reserve: KvReserve

    @property
    def weights_only_layers(self) -> int:
        """Layers whose weights alone fit (no KV at all), not capped by the model's layer count."""
        return max(0, math.floor(self.usable_bytes / self.layer_weight_bytes))

    @property
    def max_layers(self) -> int:
        """The largest ``k`` whose weights and KV reserve fit (module docstring), at most the model's."""
        w, kv_b = self.layer_weight_bytes, self.kv_bytes_per_token_per_layer
        if self.reserve.fixed_bytes is not None:
            k = math.floor((self.usable_bytes - self.reserve.fixed_bytes) / w)
        else:
            k = math.floor(self.usable_bytes / (w + self.reserve.tokens_per_layer * kv_b))
        return max(0, min(self.num_layers, k))

    def explain(self) -> str:
        """One line: usable memory, one layer's cost, the limit and the weights-only limit."""
        gb = 1e9
        if self.reserve.fixed_bytes is not None:
            cost = f"{self.reserve.fixed_bytes / gb:.2f} GB KV, then {self.layer_weight_bytes / gb:.2f} GB per layer"
        else:
            kv = self.reserve.tokens_per_layer * self.kv_bytes_per_token_per_layer
            cost = f"{self.layer_weight_bytes / gb:.2f} GB weights + {kv / gb:.2f} GB KV per layer"
        capped = " (the whole model)" if self.max_layers == self.num_layers else ""
        return (f"{self.usable_bytes / gb:.1f} GB for weights + KV, {cost} -> at most {self.max_layers} layers"
                f"{capped} (weights alone: {self.weights_only_layers})")  # fmt: skip
