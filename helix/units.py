"""Unit conversions. Units live in field names (``bandwidth_gbps`` = 10^9 bits/s)."""

from __future__ import annotations

BITS_PER_BYTE = 8


def gbps_to_bytes_per_s(bandwidth_gbps: float) -> float:
    """Gigabits per second (10^9 bits/s) to bytes per second."""
    return bandwidth_gbps * 1e9 / BITS_PER_BYTE


def link_tokens_per_s(bandwidth_gbps: float, bytes_per_token: float) -> float:
    """How many tokens per second a link of this bandwidth carries at ``bytes_per_token``."""
    return gbps_to_bytes_per_s(bandwidth_gbps) / bytes_per_token
