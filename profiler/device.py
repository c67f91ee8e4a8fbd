"""Probing the device a node is measured on: its name, last-level cache, free memory and step clock.

:func:`device_name` is part of the measurement cache key; :func:`last_level_cache_bytes` sizes
the probe stages (:func:`probe_stage_layers`) so their weights do not run from cache;
:func:`free_memory_bytes` (:mod:`node_agent.memory`'s, which an agent also checks a new layer range
against) is what the node's KV capacity and layer limit come from
(:mod:`profiler.kv_capacity`); :func:`step_clock` is what a probe step is timed by
(:mod:`profiler.measure`). CPU facts come from ``/proc`` and sysfs, a GPU's from ``torch.cuda``
(imported only for a ``cuda`` device).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from pathlib import Path

from node_agent.memory import free_memory_bytes

__all__ = ["device_name", "free_memory_bytes", "last_level_cache_bytes", "probe_stage_layers", "step_clock"]


def device_name(device: str = "cpu") -> str:
    """A stable name of the device the engine runs on (part of the cache key)."""
    if device.startswith("cuda"):
        import torch

        return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model}"


def last_level_cache_bytes(device: str = "cpu") -> int:
    """Size of the device's last-level cache (CPU L3 from sysfs, a GPU's L2); 0 if unknown."""
    if device.startswith("cuda"):
        import torch

        return int(getattr(torch.cuda.get_device_properties(torch.device(device)), "L2_cache_size", 0))
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def probe_stage_layers(num_layers: int, layer_bytes: int, cache_bytes: int, longer: int | None = None) -> tuple[int, int]:
    """(shorter, longer) middle-stage lengths for the per-layer slope.

    The shorter stage's weights are at least twice the last-level cache, so neither stage runs
    from cache (a deployed stage does not); the longer one is twice as long (at least three
    layers more). Both fit between the first and the last layer. ``longer`` overrides.
    """
    room = max(2, num_layers - 2)
    if longer is not None:
        big = max(2, min(longer, room))
        return max(1, big // 2), big
    small = max(1, -(-2 * cache_bytes // max(1, layer_bytes)))
    big = min(room, max(small + 3, 2 * small))
    return min(small, big - 1), big


def step_clock(device: str) -> Callable[[], float]:
    """The clock a step is timed by: on CPU the measuring thread's CPU time (the engine runs one
    torch thread, in the caller), so time the OS gives other processes is not counted as the
    node's work — sharing a host's cores is the simulator's ``host_cores``; on a GPU wall time."""
    return time.perf_counter if str(device).startswith("cuda") else time.thread_time
