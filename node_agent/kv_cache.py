"""KV cache of a stage: per-request K/V tensors and the KV *accounting* that admission relies on.

Following Orca, a request reserves its worst case (``prompt + max_tokens`` tokens) when it is
admitted, so a running request can always finish and the scheduler never deadlocks. The
account counts tokens (each token holds K and V for every layer of the stage); a request whose
reservation exceeds the whole capacity can never run and is refused with ``CapacityError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helix.errors import CapacityError


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


@dataclass(slots=True)
class KVUsage:
    """A snapshot of the KV account, in tokens (what the router's watermark masking reads)."""

    capacity_tokens: int
    reserved_tokens: int
    used_tokens: int
    num_requests: int

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.reserved_tokens

    @property
    def reserved_fraction(self) -> float:
        return self.reserved_tokens / self.capacity_tokens if self.capacity_tokens else 1.0


class KVAccount:
    """Token-granular bookkeeping of a stage's KV capacity: reservations and actual use."""

    __slots__ = ("capacity_tokens", "_reserved")

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens <= 0:
            raise CapacityError(f"KV capacity must be positive, got {capacity_tokens} tokens")
        self.capacity_tokens = capacity_tokens
        self._reserved: dict[str, int] = {}

    @classmethod
    def from_bytes(cls, budget_bytes: int, bytes_per_token: int) -> KVAccount:
        """Capacity of a memory budget given one token's KV bytes across the stage's layers."""
        return cls(budget_bytes // bytes_per_token)

    @property
    def reserved_tokens(self) -> int:
        return sum(self._reserved.values())

    def check_fits_ever(self, request_id: str, tokens: int) -> None:
        """Raise ``CapacityError`` if ``tokens`` exceed the whole capacity (it could never run)."""
        if tokens > self.capacity_tokens:
            raise CapacityError(
                f"request {request_id!r} needs {tokens} KV tokens (prompt + max_tokens) but this stage "
                f"holds only {self.capacity_tokens}"
            )

    def can_reserve(self, tokens: int) -> bool:
        return self.reserved_tokens + tokens <= self.capacity_tokens

    def reserve(self, request_id: str, tokens: int) -> None:
        assert request_id not in self._reserved, f"double reservation for {request_id}"
        assert self.can_reserve(tokens), "reserve() without can_reserve()"
        self._reserved[request_id] = tokens

    def release(self, request_id: str) -> None:
        self._reserved.pop(request_id, None)

    def is_reserved(self, request_id: str) -> bool:
        return request_id in self._reserved

    def usage(self, used_tokens: int) -> KVUsage:
        return KVUsage(self.capacity_tokens, self.reserved_tokens, used_tokens, len(self._reserved))
