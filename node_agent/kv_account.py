"""A stage's KV *accounting*: reservations and use in tokens, with no tensors (no torch), so
the scheduler and whoever drives it without an engine can import it.

Following Orca, a request reserves its worst case (``prompt + max_tokens`` tokens) when it is
admitted, so a running request can always finish and the scheduler never deadlocks. The
account counts tokens (each token holds K and V for every layer of the stage); a request whose
reservation exceeds the whole capacity can never run and is refused with ``CapacityError``.
The K/V tensors themselves are :mod:`node_agent.kv_cache`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from helix.errors import CapacityError


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
