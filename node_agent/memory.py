"""How much memory an agent has for more layers: the device's free memory, and whether a new
range's weights (and the KV room its layers add) fit in it.

:func:`free_memory_bytes` is what a device could still allocate (a GPU's from ``torch.cuda``,
imported only for a ``cuda`` device; on CPU ``MemAvailable``); the profiler sizes a node's KV
capacity and layer limit from it too (:mod:`profiler.device`). :func:`why_not_fit` is the check a
SET_LAYERS passes before anything loads: its answer names the bytes. No torch at import.
"""

from __future__ import annotations

import os
from pathlib import Path


def free_memory_bytes(device: str = "cpu") -> int:
    """Memory an engine could still allocate on ``device``."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def why_not_fit(*, weights: int, kv: int, free: int, held: int, limit: int | None) -> str | None:
    """None when ``weights`` more bytes of weights, and ``kv`` bytes of room for the KV of the layers
    they add, fit in the ``free`` bytes of the device, and the weights (``held`` already) stay within
    ``limit`` (None: none); else why not, naming the bytes."""
    if limit is not None and held + weights > limit:
        return (f"not enough memory: the new layers' weights need {weights:,} bytes, but --max-weight-bytes "
                f"{limit:,} leaves {max(0, limit - held):,} bytes (the weights held take {held:,})")
    if weights + kv > free:
        return (f"not enough memory: the new layers need {weights + kv:,} bytes ({weights:,} of weights, {kv:,} "
                f"of KV room for them), but the device has {free:,} bytes free")
    return None
