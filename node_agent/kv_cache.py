"""KV cache of a stage: per-request K/V tensors, each sized to its request's reservation.

The accounting that admission relies on (``KVAccount``, ``KVUsage``) lives in the torch-free
:mod:`node_agent.kv_account` and is re-exported here under its old names.
"""

from __future__ import annotations

import torch

from helix.errors import CapacityError
from node_agent.kv_account import KVAccount, KVUsage

__all__ = ["KVAccount", "KVUsage", "RequestKV"]


class RequestKV:
    """K/V storage for one request over layers ``[layer_start, layer_end)``, sized to its reservation."""

    __slots__ = ("layer_start", "capacity_tokens", "length", "k", "v")

    def __init__(self, layer_start: int, layer_end: int, num_kv_heads: int, head_dim: int,
                 capacity_tokens: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (layer_end - layer_start, num_kv_heads, capacity_tokens, head_dim)
        self.layer_start = layer_start
        self.capacity_tokens = capacity_tokens
        self.length = 0
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    def write(self, layer: int, first_position: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` (``[kv_heads, n, d]``) at positions ``first_position..+n``; return all keys/values so far."""
        end = self.claim(first_position, k.shape[1])
        i = layer - self.layer_start
        self.k[i, :, first_position:end] = k
        self.v[i, :, first_position:end] = v
        return self.k[i, :, :end], self.v[i, :, :end]

    def claim(self, first_position: int, n: int) -> int:
        """Positions ``first_position..+n`` are about to be written (here or by the native kernel); their end."""
        end = first_position + n
        if end > self.capacity_tokens:
            raise CapacityError(f"request KV overflow: position {end} > reserved {self.capacity_tokens} tokens")
        self.length = max(self.length, end)
        return end
