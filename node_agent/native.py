"""The engine's native CPU kernels (``torch.ops.helix``), built on first use.

``csrc/cpu_kernels.cpp`` registers four float32 CPU ops that ``node_agent.model`` and ``node_agent.task_ops`` call:

* ``decode_attention``: all the one-token decodes of a step attend in one call per layer, each
  reading its own cache once (per-request SDPA calls cost ~3x more on CPU);
* ``rms_norm`` and ``silu_mul``: one pass each where PyTorch's CPU ops chain five and two.
* ``lora_segments``: the LoRA deltas of every fine-tuned task of a step on one fused linear in one
  call (Punica's SGMV on CPU), where PyTorch needs two to four ops per task.

It is compiled once per machine with ``torch.utils.cpp_extension`` (g++ and ninja; ~20 s, cached
under ``~/.cache/torch_extensions`` per CPU model, rebuilt when the source changes); ``make setup``
builds it ahead (``python -m node_agent.native``). If it cannot be built or loaded (no compiler,
``HELIX_NATIVE=0``), :func:`ops` returns ``None`` with a logged reason and the model keeps its
PyTorch path (per-request SDPA, ``F.rms_norm``, ``F.silu``, per-task LoRA GEMMs), which gives the same tokens.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
# -ffast-math at compile time only: vectorized exp and reassociated sums. Never at link time, where
# gcc < 13 would add crtfastmath.o and switch the whole process to flush-denormals-to-zero.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"]
LDFLAGS = ["-lmvec"]  # glibc's vector math (the vectorized exp)

_unavailable_reason: str | None = None


def library_name() -> str:
    """``helix_native_<cpu, environment>``: -march=native code is only valid on the CPU it was built
    for, and a home directory (the build cache) can be shared by machines with different CPUs and by
    several Python environments (``.venv`` and ``.venv-vllm``: each would rebuild the other's copy)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = "".join(sorted({line for line in f if line.startswith(("model name", "flags"))}))
    except OSError:
        cpu = platform.processor() or platform.machine()
    return "helix_native_" + hashlib.sha256((cpu + sys.prefix).encode()).hexdigest()[:10]


def disabled() -> bool:
    """Whether the kernels are switched off on purpose (``HELIX_NATIVE=0``)."""
    return os.environ.get("HELIX_NATIVE", "1") == "0"


def unavailable_reason() -> str | None:
    """Why the kernels are not in use (after :func:`ops` returned ``None``), else ``None``."""
    if disabled():
        return "disabled by HELIX_NATIVE=0"
    return _unavailable_reason


def ops() -> Any | None:
    """The ``torch.ops.helix`` namespace, building the kernels if needed; ``None`` if unavailable (logged once)."""
    return None if disabled() else _load()


@functools.cache
def _load() -> Any | None:
    """Build (or find) and load the library once per process; a library cannot be loaded twice."""
    global _unavailable_reason
    try:
        from torch.utils import cpp_extension

        t0 = time.perf_counter()
        cpp_extension.load(name=library_name(), sources=[str(SOURCE)], extra_cflags=CFLAGS,
                           extra_ldflags=LDFLAGS, is_python_module=False, verbose=False)
        namespace = torch.ops.helix
        for name in ("decode_attention", "rms_norm", "silu_mul", "lora_segments"):
            getattr(namespace, name)  # raises if the library did not register it
        if time.perf_counter() - t0 > 2:
            log.info("built the native CPU kernels in %.0f s", time.perf_counter() - t0)
        return namespace
    except Exception as exc:  # noqa: BLE001 - any failure to build or load means: use the PyTorch path
        lines = str(exc).strip().splitlines()
        _unavailable_reason = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
        log.warning("native CPU kernels unavailable (%s); using PyTorch ops", _unavailable_reason)
        return None


def main() -> int:
    """``python -m node_agent.native``: build (or find) the kernels now; exit 1 with the reason if it fails."""
    print("building the native CPU kernels (once per machine, ~20 s)...", file=sys.stderr, flush=True)
    if ops() is None:
        print(f"native CPU kernels unavailable: {unavailable_reason()} (the engine falls back to PyTorch ops)",
              file=sys.stderr)
        return 1
    print("native CPU kernels: ready", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
