"""Dense kernels of the stage: linear layers with weights pre-packed once for oneDNN on CPU.

``F.linear`` on CPU re-lays-out the fp32 weight for the GEMM on every call; with the small row
counts of decode steps that dominates (the 49152x576 LM head: ~24 ms at 4 rows vs ~8 ms
pre-packed). vLLM's CPU backend packs weights once at load time; so do we, through PyTorch's own
oneDNN ops (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``). Anything that
is not a float32 CPU tensor, or a PyTorch build without those ops (or where they misbehave:
checked once against ``F.linear``), falls back to ``F.linear``; CUDA tensors never touch them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def onednn_linear_available() -> bool:
    """Whether the oneDNN packed-linear ops exist and agree with ``F.linear`` on this machine."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        ops = torch.ops.mkldnn
        if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
            return False
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=gen)
        x = torch.randn(3, 40, generator=gen)
        r = torch.randn(3, 24, generator=gen)
        with torch.inference_mode():
            packed = ops._reorder_linear_weight(w, None)
            y = ops._linear_pointwise(x, packed, None, "none", [], "")
            y_add = ops._linear_pointwise.binary(x, r, packed, None, "add")
            ref = F.linear(x, w)
        return bool(torch.allclose(y, ref, atol=1e-4, rtol=1e-4)
                    and torch.allclose(y_add, ref + r, atol=1e-4, rtol=1e-4))
    except Exception:  # noqa: BLE001 - any failure of the optional fast path means: do not use it
        return False


class Linear:
    """``y = x @ weight.T`` (optionally ``+ residual``), pre-packed for oneDNN when possible.

    A packed linear keeps only the packed weight (the plain one would double the stage's weight
    memory); inputs are float32 CPU rows, as the engine makes them.
    """

    __slots__ = ("nbytes", "packed", "weight")

    def __init__(self, weight: torch.Tensor) -> None:
        self.nbytes = weight.numel() * weight.element_size()
        self.packed: torch.Tensor | None = None
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 \
                and onednn_linear_available():
            with torch.inference_mode():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.weight: torch.Tensor | None = None if self.packed is not None else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(_cpu_f32(x), self.packed, None, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T`` (one fused oneDNN call on CPU)."""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(_cpu_f32(x), _cpu_f32(residual).contiguous(),
                                                             self.packed, None, "add")  # fmt: skip
        assert self.weight is not None
        return residual + F.linear(x, self.weight)


def _cpu_f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.device.type == "cpu" else x.to("cpu", torch.float32)
